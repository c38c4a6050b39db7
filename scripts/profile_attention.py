"""One launch of attention_mma (B=4, H=32, N=4096, hd128, fp16, non-causal) for Nsight Compute:

    ncu --clock-control none -k regex:attention_mma --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        python3 scripts/profile_attention.py
"""
import torch

from sageattention2 import ops

q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(3))
sm_scale = 128 ** -0.5
_, km, _, _ = ops.smoothing_stats(None, k, None, False)
kc, ks, _, _, _ = ops.quantize_kv(k, None, km, None, None, None, ops.MMA_BLOCK_K, "int8", sm_scale * 1.4426950408889634)
for _ in range(4):  # the INT8 + FP16 PV variant, as sageattn's defaults run it (Q not smoothed)
    ops.attention_mma(q, None, kc, ks, None, v, None, None, km, "int8", 4096, sm_scale, False, False, False)
torch.cuda.synchronize()
