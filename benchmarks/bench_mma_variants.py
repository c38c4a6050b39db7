"""The warp-level kernel's variants (issue 3), the protocol of docs/PROTOCOL.md
(benchmarks/timing.py), side by side in one process:

    python3 benchmarks/bench_mma_variants.py [--quick] [--out table.md]

TOPS of B=4 H=32 fp16 HND inputs. Columns: SDPA flash (FA2); the INT8 QK + FP16 PV variant (the
one that runs natively on sm_80 and sm_90) as the full sageattn call (pv_quant="none" with
Q smoothed per head, which keeps it off the Hopper kernel's accurate tier; every
preprocessing launch included, strict=True) and as the kernel alone (which quantizes Q itself),
the full call also with SAGEATTN_PDL=0 (its launches serialised); the INT8 + FP8 and INT4 + FP8
variants, kernel alone. On the H100 the FP8 and INT4 mma.sync are emulated
(docs/PROTOCOL.md#tensor-core-rates), so those two columns say nothing of Ada; they show what the
same source costs on Hopper.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

import timing
from sageattention2 import sageattn


def rows(table: timing.Table, n: int, d: int, fp8: bool) -> None:
    """The table's two rows (causal off, on) of one sequence length and head dim."""
    q, k, v = timing.anchors_inputs(n, d)
    for causal in (False, True):
        def tops(fn: Callable[[], object]) -> float:
            return timing.tops(timing.median_ms(fn), n, d, causal)

        def call() -> object:
            return sageattn(q, k, v, is_causal=causal, pv_quant="none", smooth_q="head", strict=True)

        flash = timing.tops(timing.sdpa_ms("flash", q, k, v, causal), n, d, causal)
        full = tops(call)
        with timing.environment(["SAGEATTN_PDL=0"]):
            serial = tops(call)
        kernel = tops(timing.mma_kernel_call(q, k, v, causal, "int8", False))
        # The emulated variants take ~1 s a call at 16K: measured up to 4K.
        emulated = [tops(timing.mma_kernel_call(q, k, v, causal, qk, True)) if fp8 and n <= 4096
                    else float("nan") for qk in ("int8", "int4")]
        table.row(d, n, causal, flash, full, serial, kernel, f"{full / flash:.2f}x", *emulated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="head_dim 128 only")
    parser.add_argument("--out", help="also write the table as Markdown here")
    args = parser.parse_args()
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    table = timing.Table(["D", "N", "causal", "SDPA flash", "INT8+FP16 full", "full, SAGEATTN_PDL=0",
                          "INT8+FP16 kernel", "full / flash", "INT8+FP8 kernel", "INT4+FP8 kernel"],
                         f"{torch.cuda.get_device_name()} | TOPS, B={timing.BATCH} H={timing.HEADS} fp16")
    for d in (128,) if args.quick else (128, 64):
        for n in (1024, 4096, 16384):
            rows(table, n, d, fp8)
            torch.cuda.empty_cache()  # the next size starts from the same free memory
    table.write(args.out)


if __name__ == "__main__":
    main()
