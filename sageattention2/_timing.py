"""The package's one GPU clock (``tune``, ``bench``): CUDA events around calls queued back to
back. The lab's benchmarks keep their own (benchmarks/timing.py), which must also time older
builds of this package in A/B runs."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["queued_ms"]


def queued_ms(fn: Callable[[], object], calls: int = 1) -> float:
    """Milliseconds per call of ``calls`` calls of ``fn`` queued back to back between two CUDA
    events (the GPU's time, and the host's where it is the longer), waited for."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls
