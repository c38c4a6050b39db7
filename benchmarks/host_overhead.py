"""Host (CPU) cost of one sageattn call next to its GPU time, at short sequences where the two
are close: CPU microseconds per call (launches queued, no sync) and the do_bench GPU time.

    python3 benchmarks/host_overhead.py            (the table, the Hopper path)
    python3 benchmarks/host_overhead.py --mma      (the table, the warp-level path: pv_quant="none")
    python3 benchmarks/host_overhead.py --profile  (where a call's CPU time goes: each op alone,
                                                    and cProfile's top functions of sageattn)
    python3 benchmarks/host_overhead.py --tiny     (short calls: sageattn's CPU time per call next
                                                    to SDPA's, and the exact fallback's next to a
                                                    direct SDPA call, in this process)

CPU time is taken over 50 calls without a sync: few enough that the launch queue never fills
(a full queue would make the CPU wait for the GPU and time the GPU instead).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Callable

import torch

import sageattention2
import timing
from sageattention2 import ops, sageattn


def cpu_us(fn: Callable[[], object], calls: int = 50, repeats: int = 15) -> float:
    """The best of ``repeats`` of fn's host time per call, over ``calls`` calls queued without a
    sync (the best: the host's noise only ever adds time)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best


def table(path: str) -> None:
    """``path`` "wgmma" or "mma": the call as one op (sageattn_<path>) and as its chain of ops
    called from Python (sageattn_<path>_chain, what sageattn ran before the op existed)."""
    kwargs = ({"qk_quant": "int8"} if path == "wgmma"
              else {"pv_quant": "none", "smooth_q": "head", "strict": True})
    op = f"sageattn_{path}"
    out = timing.Table(["D", "N", "causal", "sageattn CPU us/call", "GPU us/call (do_bench)",
                        "sageattn, ops from Python: CPU", "GPU", "ops only CPU us/call"], f"{path} path")
    for d in (64, 128):
        for n in (1024, 2048):
            q, k, v = timing.anchors_inputs(n, d)
            for causal in (False, True):
                def ops_only() -> None:
                    st = ops.smoothing_stats(None, k, None, False)
                    kv = ops.quantize_kv(k, v, st.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
                    ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None, st.k_mean, n,
                                        d ** -0.5, causal, False, False)
                full = lambda: sageattn(q, k, v, is_causal=causal, **kwargs)  # noqa: E731
                gpu = timing.median_ms(full) * 1e3
                cpu = cpu_us(full)
                one_op = getattr(ops, op)
                setattr(ops, op, getattr(ops, f"{op}_chain"))
                try:
                    chain_gpu = timing.median_ms(full) * 1e3
                    chain_cpu = cpu_us(full)
                finally:
                    setattr(ops, op, one_op)
                only = cpu_us(ops_only) if path == "wgmma" else float("nan")
                out.row(d, n, causal, cpu, gpu, chain_cpu, chain_gpu, only)


def tiny() -> None:
    """Calls too short for the GPU to hide the host (the UNets' attention, cross-attention to a
    few text tokens): sageattn's CPU time per call next to SDPA's (default backend choice), and
    the exact fallback (a boolean mask) next to the same SDPA call made directly."""
    import warnings

    import torch.nn.functional as F

    warnings.simplefilter("ignore")
    out = timing.Table(["shape (B, H, Nq, Nk, D)", "SDPA CPU us", "sageattn CPU us", "ratio",
                        "sageattn runs", "int8 forced CPU us", "ratio", "SDPA + mask us",
                        "fallback us", "fallback extra us"],
                       "short calls, CPU time per call")
    for b, h, nq, nk, d in ((1, 8, 128, 128, 64), (2, 10, 1024, 77, 64), (2, 8, 4096, 77, 40),
                            (2, 20, 1024, 1024, 64), (1, 24, 512, 512, 128)):
        q = torch.randn(b, h, nq, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(b, h, nk, d, device="cuda", dtype=torch.float16) for _ in range(2))
        mask = torch.ones(nq, nk, device="cuda", dtype=torch.bool)
        sdpa = cpu_us(lambda: F.scaled_dot_product_attention(q, k, v))
        ours = cpu_us(lambda: sageattn(q, k, v))
        forced = cpu_us(lambda: sageattn(q, k, v, qk_quant="int8"))
        sdpa_mask = cpu_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        fallback = cpu_us(lambda: sageattn(q, k, v, attn_mask=mask))
        explain = getattr(sageattention2, "explain", None)  # (builds before it: A/B runs)
        runs = explain(q, k, v).kernel if explain is not None else "?"
        out.row((b, h, nq, nk, d), f"{sdpa:.1f}", f"{ours:.1f}", f"{ours / sdpa:.2f}x", runs, f"{forced:.1f}",
                f"{forced / sdpa:.2f}x", f"{sdpa_mask:.1f}", f"{fallback:.1f}", f"{fallback - sdpa_mask:.1f}")


def profile() -> None:
    n, d = 1024, 128
    q, k, v = timing.anchors_inputs(n, d)
    st = ops.smoothing_stats(None, k, None, False)
    kv = ops.quantize_kv(k, v, st.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    parts: dict[str, Callable[[], object]] = {
        "torch.empty x1 (allocator)": lambda: torch.empty(4, 32, n, d, device="cuda", dtype=torch.float16),
        "smoothing_stats (ops wrapper)": lambda: ops.smoothing_stats(None, k, None, False),
        "smoothing_stats (torch.ops direct)": lambda: torch.ops.sageattention2.smoothing_stats.default(
            None, k, v, False),
        "quantize_kv (ops wrapper)": lambda: ops.quantize_kv(k, v, st.k_mean, None, None, None,
                                                             ops.WGMMA_BLOCK_K, "int8", 1.0),
        "attention_wgmma (ops wrapper)": lambda: ops.attention_wgmma(
            q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None, st.k_mean, n, d ** -0.5, False, False,
            False),
        "sageattn_wgmma (ops wrapper)": lambda: ops.sageattn_wgmma(q, k, v, "fp8", True, False, 5, d ** -0.5, False,
                                                                  False, False),
        "sageattn_wgmma_chain (3 ops from Python)": lambda: ops.sageattn_wgmma_chain(
            q, k, v, "fp8", True, False, 5, d ** -0.5, False, False, False),
        "sageattn": lambda: sageattn(q, k, v, qk_quant="int8"),
    }
    for name, fn in parts.items():
        print(f"{name:40s} {cpu_us(fn):7.1f} us/call CPU", flush=True)
    for _ in range(20):
        sageattn(q, k, v, qk_quant="int8")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        sageattn(q, k, v, qk_quant="int8")
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
    print(s.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="where one call's CPU time goes")
    parser.add_argument("--mma", action="store_true", help="the warp-level path instead of the Hopper one")
    parser.add_argument("--tiny", action="store_true", help="short calls next to SDPA, and the fallback")
    args = parser.parse_args()
    if args.tiny:
        tiny()
    elif args.profile:
        profile()
    else:
        table("mma" if args.mma else "wgmma")


if __name__ == "__main__":
    main()
