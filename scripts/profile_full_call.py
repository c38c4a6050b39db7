"""Where the time of a full sageattn call goes on this GPU (issue 4: the full call within 10 % of
the kernel), and its extra device memory (issue 4: at most 0.75x the bytes of q, k and v):

    python3 scripts/profile_full_call.py [--d 128] [--n 1024 4096 16384] [--causal]

For each N: per-kernel CUDA time of one call (torch.profiler, mean of 20 calls), the call's
wall time from CUDA events (so launch gaps show as the difference), and the peak memory the call
allocates beyond its inputs and output.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from sageattention2 import sageattn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    for n in args.n:
        q, k, v = (torch.randn(4, 32, n, args.d, device="cuda", dtype=torch.float16) for _ in range(3))
        call = lambda: sageattn(q, k, v, is_causal=args.causal, strict=True)  # noqa: E731
        for _ in range(5):
            out = call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call()
        end.record()
        end.synchronize()
        wall_us = start.elapsed_time(end) / 20 * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 20) for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
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
        print(f"N={n} D={args.d} causal={args.causal}: call {wall_us:.1f} us (CUDA events, back to back), "
              f"kernels {gpu_us:.1f} us; extra memory {extra / 2**20:.1f} MiB = {extra / qkv:.3f}x q+k+v")
        for name, t in rows:
            print(f"    {t:9.1f} us  {100 * t / gpu_us:5.1f} %  {name[:110]}")
        del q, k, v, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
