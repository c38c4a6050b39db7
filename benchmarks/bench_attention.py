"""Attention throughput, ANCHORS.md protocol, side by side in one process:

    python3 bench_attention.py [--quick] [--out results.md]

q, k, v = randn(4, 32, N, D) fp16 (HND); TOPS = 4*B*H*N*N*D / time (halved for causal); time =
median of triton's do_bench(warmup=25, rep=150). Columns: SDPA flash (FA2), SDPA cuDNN, our
sageattn (the full call: every preprocessing launch included, strict=True so a fallback cannot
be timed) and the attention kernel sageattn runs on this GPU, alone, on pre-quantized inputs
(attention_wgmma on sm_90, attention_mma elsewhere).
"""
from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import median_ms
from sageattention2 import api, ops, sageattn

LOG2E = 1.4426950408889634


def sdpa_ms(backend: SDPBackend, q, k, v, causal: bool) -> float | None:
    try:
        with sdpa_kernel(backend):
            return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    except RuntimeError:
        return None


def kernel_ms(q, k, v, causal: bool) -> float:
    d = q.shape[-1]
    bound = inspect.signature(sageattn).bind(q, k, v, is_causal=causal, strict=True)
    bound.apply_defaults()
    choice = api._kernel_for(api._validate(**bound.arguments))
    if choice.kernel == "wgmma":
        stats = ops.smoothing_stats(None, k, None, False)
        kv = ops.quantize_kv(k, v, stats.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
        return median_ms(lambda: ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8,
                                                     kv.v_tile_scale, None, None, k.shape[2],
                                                     d ** -0.5, causal, False, False))
    mult = d ** -0.5 * LOG2E
    fp8 = choice.pv == "fp8"
    stats = ops.smoothing_stats(q, k, v if fp8 else None, False)
    qc, qs, _ = ops.quantize_q(q, stats.q_mean, ops.MMA_BLOCK_Q, ops.MMA_WARPS, choice.qk, False, mult)
    kv = ops.quantize_kv(k, v if fp8 else None, stats.k_mean, None, stats.v_scale if fp8 else None, stats.q_mean,
                         ops.MMA_BLOCK_K, choice.qk, mult)
    pv = (kv.v_fp8, stats.v_scale, None) if fp8 else (v, None, None)
    return median_ms(lambda: ops.attention_mma(qc, qs, kv.k_quant, kv.k_scale, kv.delta_s, *pv, choice.qk,
                                               q.shape[2], k.shape[2], q.dtype, causal, False, False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="head_dim 128, N in {1K, 4K} only")
    parser.add_argument("--out", help="also write the table as markdown here")
    args = parser.parse_args()
    dims = (128,) if args.quick else (128, 64)
    lengths = (1024, 4096) if args.quick else (1024, 4096, 16384)
    rows = ["| D | N | causal | SDPA flash | SDPA cuDNN | sageattn full | kernel only | full / flash "
            "| full / cuDNN |", "|---|---|---|---|---|---|---|---|---|"]
    print(torch.cuda.get_device_name(), "| TOPS, B=4 H=32 fp16")
    for d in dims:
        for n in lengths:
            q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
            for causal in (False, True):
                ops_count = 4 * 4 * 32 * n * n * d / (2 if causal else 1)
                tops = lambda ms: ops_count / ms / 1e9 if ms else float("nan")  # noqa: E731
                flash = tops(sdpa_ms(SDPBackend.FLASH_ATTENTION, q, k, v, causal))
                cudnn = tops(sdpa_ms(SDPBackend.CUDNN_ATTENTION, q, k, v, causal))
                full = tops(median_ms(lambda: sageattn(q, k, v, is_causal=causal, strict=True)))
                kernel = tops(kernel_ms(q, k, v, causal))
                row = (f"| {d} | {n} | {causal} | {flash:.0f} | {cudnn:.0f} | {full:.0f} | {kernel:.0f} "
                       f"| {full / flash:.2f}x | {full / cudnn:.2f}x |")
                rows.append(row)
                print(row)
            del q, k, v
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
