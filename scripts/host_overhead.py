"""Host (CPU) cost of one sageattn call next to its GPU time, at short sequences where the two
are close: CPU microseconds per call (launches queued, no sync) and do_bench GPU time.

    python3 scripts/host_overhead.py
"""
import time

import torch
from triton.testing import do_bench

from sageattention2 import ops, sageattn


def cpu_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


print("| D | N | causal | sageattn CPU us/call | GPU us/call (do_bench) | ops only CPU us/call |")
print("|---|---|---|---|---|---|")
for d in (64, 128):
    for n in (1024, 2048):
        q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        for causal in (False, True):
            def ops_only():
                st = ops.smoothing_stats(None, k, v, False)
                kv = ops.quantize_kv(k, v, st.k_mean, None, st.v_scale, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
                ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, st.v_scale, None, st.k_mean, n,
                                    d ** -0.5, causal, False, False)
            full = lambda: sageattn(q, k, v, is_causal=causal)  # noqa: E731
            gpu = do_bench(full, warmup=25, rep=150, return_mode="median") * 1e3
            print(f"| {d} | {n} | {causal} | {cpu_us(full):.0f} | {gpu:.0f} | {cpu_us(ops_only):.0f} |", flush=True)
