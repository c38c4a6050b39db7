"""Timing helpers shared by the benchmarks (ANCHORS.md protocol: median of do_bench)."""
from __future__ import annotations

from typing import Callable

import torch


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 150) -> float:
    """Median time of fn in milliseconds, timed with CUDA events (triton's do_bench when
    available, which also flushes L2 between runs)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except ImportError:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        times = event_times_ms(fn, max(20, rep // 5))
        return sorted(times)[len(times) // 2]


def event_times_ms(fn: Callable[[], object], reps: int) -> list[float]:
    """fn's time in milliseconds, ``reps`` times, each between two CUDA events and synchronized
    (so a call's host time counts where the GPU waits for it)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6
