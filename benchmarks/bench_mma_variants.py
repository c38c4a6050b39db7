"""The warp-level kernel's variants (issue 3), ANCHORS.md protocol, side by side in one process:

    python3 bench_mma_variants.py [--quick] [--out results.md]

q, k, v = randn(4, 32, N, D) fp16 (HND); TOPS = 4*B*H*N*N*D / time (halved for causal); time =
median of triton's do_bench(warmup=25, rep=150). Columns: SDPA flash (FA2); the INT8 QK + FP16 PV
variant (the one that runs natively on sm_80 and sm_90) as the full sageattn call (its defaults
with pv_quant="none", every preprocessing launch included, strict=True) and as the kernel alone
(which quantizes Q itself), the full call also with SAGEATTN_PDL=0 (its launches serialised); the
INT8 + FP8 and INT4 +
FP8 variants, kernel alone. On the H100 the FP8 and INT4 mma.sync are emulated (ANCHORS.md), so
those two columns say nothing of Ada; they are here to show what the same source costs on Hopper.
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import median_ms
from sageattention2 import ops, sageattn

LOG2E = 1.4426950408889634


def flash_call(q, k, v, causal: bool) -> Callable[[], object]:
    """SDPA with the flash backend (FA2), as a callable to time."""
    def run() -> object:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def kernel_call(q, k, v, causal: bool, qk: str, fp8_v: bool) -> Callable[[], object]:
    """attention_mma alone (it quantizes Q itself) on K and V prepared as sageattn's defaults
    prepare them: K smoothed, Q smoothed for INT4 only."""
    sm_scale = q.shape[-1] ** -0.5
    smooth_q = qk == "int4"
    stats = ops.smoothing_stats(q if smooth_q else None, k, v if fp8_v else None, False)
    q_mean = stats.q_mean if smooth_q else None
    kv = ops.quantize_kv(k, v if fp8_v else None, stats.k_mean, None, stats.v_scale if fp8_v else None,
                         q_mean, ops.MMA_BLOCK_K, qk, sm_scale * LOG2E)
    pv = (kv.v_fp8, stats.v_scale, None) if fp8_v else (v, None, None)
    return lambda: torch.ops.sageattention2.attention_mma(
        q, q_mean, kv.k_quant, kv.k_scale, kv.delta_s if smooth_q else None, *pv, stats.k_mean, qk, k.shape[2],
        sm_scale, causal, False, False)


def flash_ms(q, k, v, causal: bool) -> float:
    return median_ms(flash_call(q, k, v, causal))


def kernel_ms(q, k, v, causal: bool, qk: str, fp8_v: bool) -> float:
    return median_ms(kernel_call(q, k, v, causal, qk, fp8_v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="head_dim 128 only")
    parser.add_argument("--out", help="also write the table as markdown here")
    args = parser.parse_args()
    dims = (128,) if args.quick else (128, 64)
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    rows = ["| D | N | causal | SDPA flash | INT8+FP16 full | full, SAGEATTN_PDL=0 | INT8+FP16 kernel | full / flash "
            "| INT8+FP8 kernel | INT4+FP8 kernel |", "|---|---|---|---|---|---|---|---|---|---|"]
    print(torch.cuda.get_device_name(), "| TOPS, B=4 H=32 fp16")
    for d in dims:
        for n in (1024, 4096, 16384):
            q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
            for causal in (False, True):
                ops_count = 4 * 4 * 32 * n * n * d / (2 if causal else 1)
                tops = lambda ms: ops_count / ms / 1e9  # noqa: E731
                flash = tops(flash_ms(q, k, v, causal))
                call = lambda: sageattn(q, k, v, is_causal=causal, pv_quant="none", strict=True)  # noqa: E731
                full = tops(median_ms(call))
                # The same call with its launches serialised (no programmatic dependent launch).
                os.environ["SAGEATTN_PDL"] = "0"
                try:
                    serial = tops(median_ms(call))
                finally:
                    del os.environ["SAGEATTN_PDL"]
                kernel = tops(kernel_ms(q, k, v, causal, "int8", False))
                # The emulated variants take ~1 s a call at 16K: measured up to 4K.
                emulated = [tops(kernel_ms(q, k, v, causal, qk, True)) if fp8 and n <= 4096 else float("nan")
                            for qk in ("int8", "int4")]
                row = (f"| {d} | {n} | {causal} | {flash:.0f} | {full:.0f} | {serial:.0f} | {kernel:.0f} "
                       f"| {full / flash:.2f}x "
                       f"| {emulated[0]:.0f} | {emulated[1]:.0f} |")
                rows.append(row)
                print(row, flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
