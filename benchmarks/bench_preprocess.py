"""Achieved bandwidth of each preprocessing kernel next to the device-to-device copy:

    python3 benchmarks/bench_preprocess.py [--batch 4] [--heads 32] [--head-dim 128]
                                           [--lengths 1024 4096 16384]

Bytes counted are the fewest each op must move: every input element read once, every output
written once. The ratio to the copy bandwidth measured in the same run is the figure of merit.
(Q has no preprocessing kernel: both attention kernels quantize it themselves.)
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
from torch import Tensor

import timing
from sageattention2 import ops


def nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def rows(table: timing.Table, b: int, h: int, n: int, d: int, copy: float) -> None:
    """A row per op at one sequence length."""
    q, k, v = timing.anchors_inputs(n, d, batch=b, heads=h)
    q_mean, k_mean, _, v_scale = ops.smoothing_stats(q, k, v, False)

    def kv(v_in: Tensor | None, v_scale_in: Tensor | None, q_mean_in: Tensor | None, block_k: int, qk: str,
           multiplier: float) -> tuple[Callable[[], object], int]:
        def fn() -> ops.QuantizedKV:
            return ops.quantize_kv(k, v_in, k_mean, None, v_scale_in, q_mean_in, block_k, qk, multiplier)
        return fn, nbytes(k, v_in, *fn())

    cases: dict[str, tuple[Callable[[], object], int]] = {
        "smoothing_stats(k, v)": (lambda: ops.smoothing_stats(None, k, v, False), nbytes(k, v, k_mean, v_scale)),
        "smoothing_stats(q, k, v)": (lambda: ops.smoothing_stats(q, k, v, False),
                                     nbytes(q, k, v, q_mean, k_mean, v_scale)),
        # The Hopper path's preprocessing: K's mean, then K and V with per-tile V scales.
        "smoothing_stats(k)": (lambda: ops.smoothing_stats(None, k, None, False), nbytes(k, k_mean)),
        "quantize_kv int8 (per-tile fp8 V)": kv(v, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0),
        # The warp-level INT8 + FP16 PV path: K only.
        "quantize_kv int8 (K only)": kv(None, None, None, ops.MMA_BLOCK_K, "int8", 1.0),
    }
    multiplier = d ** -0.5 * timing.LOG2E
    for qk in ("int8", "int4"):  # the warp-level FP8 PV paths: + FP8 V, and Delta-S of Q's mean
        cases[f"quantize_kv {qk} (+fp8 V, delta_s)"] = kv(v, v_scale, q_mean, ops.MMA_BLOCK_K, qk, multiplier)
    for name, (fn, moved) in cases.items():
        ms = timing.median_ms(fn)
        gbs = moved / ms / 1e6
        table.row(name, n, f"{ms * 1e3:.1f}", gbs, f"{100 * gbs / copy:.0f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=timing.BATCH)
    parser.add_argument("--heads", type=int, default=timing.HEADS)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    copy = timing.copy_bandwidth_gbs()
    table = timing.Table(["op", "N", "time us", "GB/s", "% copy"],
                         f"{torch.cuda.get_device_name()} | copy bandwidth (read + write) {copy:.0f} GB/s")
    for n in args.lengths:
        rows(table, args.batch, args.heads, n, args.head_dim, copy)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
