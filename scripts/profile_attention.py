"""The profiler driver (GPU), on the speed inputs of docs/PROTOCOL.md#speed-inputs (B4 H32 fp16
randn, HND; benchmarks/timing.py):

    python3 scripts/profile_attention.py launch [--mma] [--kernel] [--n 4096] [--d 128] [--shape B,H,NQ,NK,D] [--causal]
    python3 scripts/profile_attention.py breakdown [--mma] [--n 1024 4096 16384] [--d 128] [--causal]
    python3 scripts/profile_attention.py breakdown --shape 2,8,1024,1024,128 [--shape ...] [--causal] [--smooth-v]

launch: a few calls of one path for Nsight Compute to pick a launch from (scripts/device_check.sh
--ncu "REGEX ARGS" runs it under ncu), e.g.

    ncu --clock-control none -k regex:attention_wgmma --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight python3 scripts/profile_attention.py launch --kernel --n 4096

The path: sageattn's full call (the Hopper one on sm_90, its defaults), --mma its warp-level path
(pv_quant="none": INT8 QK + FP16 PV unless --qk/--pv say otherwise), --kernel the attention
kernel alone on K and V quantized once.

breakdown: where the time of one full call goes (issue 4: the full call within 10 % of the
kernel; at most 0.75x the bytes of q, k and v of extra memory): per-kernel CUDA time of one call
(torch.profiler, mean of 20 calls), the call's wall time from CUDA events (launch gaps show as
the difference), the kernel alone (do_bench median), and the peak memory the call allocates
beyond its inputs and output. With --shape B,H,NQ,NK,D (repeatable) the inputs are randn of those
shapes instead of the protocol's, and the call's do_bench time and SDPA's cuDNN backend on the
same inputs are printed beside. (Host time: benchmarks/host_overhead.py; after the profiler has
run, a process's host times read ~2x.)

(Not named profile.py: run as a script, that would shadow the standard library's profile module,
which cProfile, and so torch._dynamo, imports.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import timing  # noqa: E402

from sageattention2 import sageattn  # noqa: E402


def calls(args: argparse.Namespace, q: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the full call, the kernel alone) of the chosen path."""
    if args.mma:
        pv = args.pv or "none"
        qk = args.qk or "int8"
        full = lambda: sageattn(q, k, v, is_causal=args.causal, qk_quant=qk, pv_quant=pv, strict=True)  # noqa: E731
        return full, timing.mma_kernel_call(q, k, v, args.causal, qk, pv == "fp8")
    full = lambda: sageattn(q, k, v, is_causal=args.causal, qk_quant="int8", smooth_v=args.smooth_v,  # noqa: E731
                            strict=True)
    return full, timing.kernel_call(q, k, v, args.causal)


def _shape_inputs(b: int, h: int, n_q: int, n_k: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp16 randn q [b, h, n_q, d], k and v [b, h, n_k, d] (--shape's inputs)."""
    q = torch.randn(b, h, n_q, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, h, n_k, d, device="cuda", dtype=torch.float16) for _ in range(2))
    return q, k, v


def launch(args: argparse.Namespace) -> None:
    q, k, v = _shape_inputs(*args.shape[0]) if args.shape else timing.anchors_inputs(args.n[0], args.d)
    full, alone = calls(args, q, k, v)
    fn = alone if args.kernel else full
    for _ in range(args.calls):
        fn()
    torch.cuda.synchronize()


def breakdown(args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    cases = args.shape or [(timing.BATCH, timing.HEADS, n, n, args.d) for n in args.n]
    for b, h, n_q, n_k, d in cases:
        q, k, v = _shape_inputs(b, h, n_q, n_k, d)
        call, alone = calls(args, q, k, v)
        for _ in range(5):
            out = call()
        torch.cuda.synchronize()
        wall_us = sum(timing.event_times_ms(lambda: [call() for _ in range(20)], 1)) / 20 * 1e3
        kernel_us = timing.median_ms(alone) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 20) for e in prof.key_averages() if e.device_time_total > 0),
                      key=lambda r: -r[1])
        gpu_us = sum(t for _, t in rows)
        del out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = call()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
        qkv = 3 * q.numel() * q.element_size()
        print(f"B={b} H={h} Nq={n_q} Nk={n_k} D={d} causal={args.causal}: call {wall_us:.1f} us (CUDA events, "
              f"back to back), kernels {gpu_us:.1f} us, kernel alone {kernel_us:.1f} us (call / kernel "
              f"{wall_us / kernel_us:.3f}); extra memory {extra / 2**20:.1f} MiB = {extra / qkv:.3f}x q+k+v")
        if args.shape:
            cudnn_ms = timing.sdpa_ms("cudnn", q, k, v, args.causal)
            print(f"    call do_bench {timing.median_ms(call) * 1e3:.1f} us, SDPA cuDNN "
                  f"{'-' if cudnn_ms is None else f'{cudnn_ms * 1e3:.1f}'} us")
        for name, t in rows:
            print(f"    {t:9.1f} us  {100 * t / gpu_us:5.1f} %  {name[:110]}")
        del q, k, v, out
        torch.cuda.empty_cache()


def _shape(text: str) -> tuple[int, int, int, int, int]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"--shape takes B,H,NQ,NK,D, got {text!r}")
    return parts  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("launch", "breakdown"))
    parser.add_argument("--mma", action="store_true", help="sageattn's warp-level path (pv_quant='none')")
    parser.add_argument("--qk", choices=("int8", "int4"), help="with --mma: qk_quant (default int8)")
    parser.add_argument("--pv", choices=("none", "fp8"), help="with --mma: pv_quant (default none)")
    parser.add_argument("--kernel", action="store_true", help="launch: the attention kernel alone")
    parser.add_argument("--n", type=int, nargs="+", help="sequence lengths (launch: the first; default 4096, "
                        "breakdown: 1024 4096 16384)")
    parser.add_argument("--d", type=int, default=128, help="head_dim")
    parser.add_argument("--shape", type=_shape, action="append",
                        help="B,H,NQ,NK,D: breakdown's shapes (repeatable), launch's inputs (the first)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--smooth-v", action="store_true",
                        help="the full call with smooth_v=True (the kernel alone runs without V's means)")
    parser.add_argument("--calls", type=int, default=4, help="launch: calls to make")
    args = parser.parse_args(argv)
    if args.mode == "launch":
        args.n = args.n or [4096]
        launch(args)
    else:
        args.n = args.n or [1024, 4096, 16384]
        breakdown(args)


if __name__ == "__main__":
    main()
