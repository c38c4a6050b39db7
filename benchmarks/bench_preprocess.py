"""Achieved bandwidth of each preprocessing kernel next to the device-to-device copy.

    python benchmarks/bench_preprocess.py [--heads 32] [--batch 4] [--head-dim 128]

Bytes counted are the fewest each op must move: every input element read once, every output
written once. The ratio to the copy bandwidth measured in the same run is the figure of merit.
"""
from __future__ import annotations

import argparse
import math

import torch

from common import copy_bandwidth_gbs, median_ms
from sageattention2 import ops


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()

    copy = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {copy:.0f} GB/s")
    print(f"{'op':<36}{'N':>7}{'time us':>10}{'GB/s':>9}{'% copy':>8}")
    b, h, d = args.batch, args.heads, args.head_dim
    mult = d ** -0.5 * 1.4426950408889634
    for n in args.lengths:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, False)
        cases = {
            "smoothing_stats(k, v)": (lambda: ops.smoothing_stats(None, k, v, False),
                                      nbytes(k, v) + nbytes(k_mean, v_scale)),
            "smoothing_stats(q, k, v)": (lambda: ops.smoothing_stats(q, k, v, False),
                                         nbytes(q, k, v) + nbytes(q_mean, k_mean, v_scale)),
            # The Hopper kernel's preprocessing: K's mean, then K and V with per-tile V scales.
            "smoothing_stats(k)": (lambda: ops.smoothing_stats(None, k, None, False), nbytes(k, k_mean)),
            "quantize_kv int8 (per-tile fp8 V)": (
                lambda: ops.quantize_kv(k, v, k_mean, None, None, None, 128, "int8", 1.0),
                nbytes(k, v, *ops.quantize_kv(k, v, k_mean, None, None, None, 128, "int8", 1.0))),
            # The warp-level INT8 + FP16 PV path: K only.
            "quantize_kv int8 (K only)": (
                lambda: ops.quantize_kv(k, None, k_mean, None, None, None, 128, "int8", 1.0),
                nbytes(k, *ops.quantize_kv(k, None, k_mean, None, None, None, 128, "int8", 1.0))),
        }
        for qk in ("int8", "int4"):
            qo = ops.quantize_q(q, q_mean, 128, 4, qk, False, mult)
            kvo = ops.quantize_kv(k, v, k_mean, None, v_scale, q_mean, 64, qk, mult)
            cases[f"quantize_q {qk} (head mean)"] = (
                lambda qk=qk: ops.quantize_q(q, q_mean, 128, 4, qk, False, mult), nbytes(q, *qo))
            cases[f"quantize_kv {qk} (+fp8 V, delta_s)"] = (
                lambda qk=qk: ops.quantize_kv(k, v, k_mean, None, v_scale, q_mean, 64, qk, mult),
                nbytes(k, v, *kvo))
        for name, (fn, moved) in cases.items():
            ms = median_ms(fn)
            gbs = moved / ms / 1e6
            print(f"{name:<36}{n:>7}{ms * 1e3:>10.1f}{gbs:>9.0f}{100 * gbs / copy:>7.0f}%")
        del q, k, v
        torch.cuda.empty_cache()
    assert math.isfinite(copy)


if __name__ == "__main__":
    main()
