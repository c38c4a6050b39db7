"""Where a sageattn call on the warp-level INT8 + FP16 PV path spends its time (B4 H32 hd128
fp16, non-causal): the launches' CUDA times by torch.profiler, and the call next to the kernel
alone (benchmarks/bench_mma_variants.kernel_call) timed with CUDA events, alternated, median.

    python3 scripts/profile_mma_call.py N [N ...]
"""
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_mma_variants import kernel_call  # noqa: E402
from common import event_times_ms  # noqa: E402

from sageattention2 import sageattn  # noqa: E402


for n in map(int, sys.argv[1:]):
    q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    call = lambda: sageattn(q, k, v, pv_quant="none", strict=True)  # noqa: E731
    kernel = kernel_call(q, k, v, False, "int8", False)
    for _ in range(3):
        call(), kernel()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    print(f"N={n}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=50))
    full, alone = [], []
    for _ in range(5):
        full += event_times_ms(call, 4)
        alone += event_times_ms(kernel, 4)
    tops = lambda ms: 4 * 4 * 32 * n * n * 128 / ms / 1e9  # noqa: E731
    f, a = statistics.median(full), statistics.median(alone)
    print(f"N={n}: call {f:.3f} ms ({tops(f):.0f} TOPS), kernel alone {a:.3f} ms ({tops(a):.0f} TOPS), "
          f"call / kernel {f / a:.3f}")
