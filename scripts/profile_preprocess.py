"""The preprocessing launches of the Hopper path at one shape, for Nsight Compute:

    ncu -k regex:"quantize_kv|smoothing_stats" --section SpeedOfLight --section Occupancy \\
        python3 scripts/profile_preprocess.py [N] [D]
"""
import sys

import torch

from sageattention2 import ops

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
d = int(sys.argv[2]) if len(sys.argv) > 2 else 128
k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(2))
for _ in range(2):
    stats = ops.smoothing_stats(None, k, None, False)
    ops.quantize_kv(k, v, stats.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
torch.cuda.synchronize()
