"""One launch of attention_mma (B=4, H=32, N=4096, hd128, fp16, non-causal) for Nsight Compute:

    ncu --clock-control none -k regex:attention_mma --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        python3 scripts/profile_attention.py
"""
import torch

from sageattention2 import ops

q, k, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(3))
mult = 128 ** -0.5 * 1.4426950408889634
qm, km, _, _ = ops.smoothing_stats(q, k, None, False)
qc, qs, _ = ops.quantize_q(q, qm, ops.MMA_BLOCK_Q, ops.MMA_WARPS, "int8", False, mult)
kc, ks, _, ds = ops.quantize_kv(k, None, km, None, None, qm, ops.MMA_BLOCK_K, "int8", mult)
for _ in range(4):  # the INT8 + FP16 PV variant
    ops.attention_mma(qc, qs, kc, ks, ds, v, None, None, "int8", 4096, 4096, q.dtype, False, False, False)
torch.cuda.synchronize()
