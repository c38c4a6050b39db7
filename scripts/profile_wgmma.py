"""One launch of the Hopper kernel alone (pre-quantized K/V), for Nsight Compute:

    ncu --kernel-name regex:attention_wgmma --launch-skip 3 --launch-count 1 --set full \\
        python3 scripts/profile_wgmma.py [N] [D] [causal]
"""
import sys

import torch

from sageattention2 import ops

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
stats = ops.smoothing_stats(None, k, None, False)
kv = ops.quantize_kv(k, v, stats.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
for _ in range(5):
    ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None, None, n, d ** -0.5, causal,
                        False, False)
torch.cuda.synchronize()
