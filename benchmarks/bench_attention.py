"""Attention throughput side by side (ANCHORS.md protocol).

    python benchmarks/bench_attention.py [--quick] [--out RESULTS_FILE.md]

q, k, v = torch.randn(B, H, N, D, fp16, cuda), HND, B=4, H=32; TOPS = 4*B*H*N*N*D / time (half
for causal); time = median of triton.testing.do_bench(fn, warmup=25, rep=150). Columns, all
measured in this one process:

* SDPA flash: F.scaled_dot_product_attention under SDPBackend.FLASH_ATTENTION;
* SDPA cuDNN: the same under SDPBackend.CUDNN_ATTENTION ("-" when unavailable);
* ours full: sageattn(q, k, v, is_causal=...), everything a user pays (means, quantization,
  attention);
* ours kernel: attention_mma alone on inputs quantized beforehand;
* prep %: share of the full call that is not the kernel, (full - kernel) / full;
* full/flash, full/cuDNN: speed ratios (> 1: ours is faster).

--quick runs D=128, N in {1024, 4096} only.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import median_ms
from sageattention2 import api, kernel_plan, ops, sageattn


def tops(b: int, h: int, n: int, d: int, causal: bool, ms: float | None) -> float | None:
    if ms is None:
        return None
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    return flops / (ms * 1e-3) / 1e12


def time_sdpa(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> float | None:
    """Median ms under ``backend``, or None when the backend cannot run this call."""
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    with sdpa_kernel(backend):  # entered once, outside the timed function
        try:
            fn()
            torch.cuda.synchronize()
        except RuntimeError:
            return None
        return median_ms(fn)


def time_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> tuple[float | None, float | None, str | None]:
    """(full ms, kernel ms, why the quantized path cannot run or None)."""
    def full() -> object:
        return sageattn(q, k, v, is_causal=causal, strict=True)

    try:
        full()
    except NotImplementedError as error:
        return None, None, str(error)
    inputs = api._quantize_for_mma(q, k, smooth_q=True, smooth_k=True,
                                   sm_scale=q.shape[-1] ** -0.5)
    n = q.shape[2]
    kernel = lambda: ops.attention_mma(  # noqa: E731
        inputs.q_codes, inputs.q_scale, inputs.k_codes, inputs.k_scale, inputs.delta_s, v, n,
        causal, False, False)
    kernel()
    torch.cuda.synchronize()
    return median_ms(full), median_ms(kernel), None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="D=128, N in {1024, 4096} only")
    parser.add_argument("--out", help="also write the table as markdown to this file")
    args = parser.parse_args()

    dims = [128] if args.quick else [128, 64]
    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    b, h = args.batch, args.heads
    header = [
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}",
        f"sageattn plan: {kernel_plan()}",
        f"B={b} H={h} fp16 randn HND; TOPS = 4*B*H*N*N*D / median time (half for causal)",
    ]
    columns = ["N", "causal", "D", "SDPA flash", "SDPA cuDNN", "ours full", "ours kernel",
               "prep %", "full/flash", "full/cuDNN"]
    rows: list[list[str]] = []
    notes: list[str] = []
    print("\n".join(header))
    widths = [6, 7, 4, 11, 11, 10, 12, 7, 11, 11]
    print("".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for d in dims:
        for causal in (False, True):
            for n in lengths:
                q, k, v = (torch.randn(b, h, n, d, dtype=torch.float16, device="cuda")
                           for _ in range(3))
                flash = time_sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)
                cudnn = time_sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)
                full, kernel, why = time_ours(q, k, v, causal)
                if why is not None and why not in notes:
                    notes.append(why)
                t = {name: tops(b, h, n, d, causal, ms) for name, ms in
                     (("flash", flash), ("cudnn", cudnn), ("full", full), ("kernel", kernel))}
                prep = None if full is None or kernel is None else 100 * (full - kernel) / full
                row = [
                    f"{n // 1024}K", "yes" if causal else "no", str(d), fmt(t["flash"], ".0f"),
                    fmt(t["cudnn"], ".0f"), fmt(t["full"], ".0f"), fmt(t["kernel"], ".0f"),
                    fmt(prep, ".0f"),
                    fmt(None if flash is None or full is None else flash / full, ".2f"),
                    fmt(None if cudnn is None or full is None else cudnn / full, ".2f"),
                ]
                rows.append(row)
                print("".join(f"{c:>{w}}" for c, w in zip(row, widths)), flush=True)
                del q, k, v
                torch.cuda.empty_cache()
    for note in notes:
        print(f"note: {note}")
    if args.out:
        lines = [f"- {line}" for line in header]
        lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += [f"\nnote: {note}" for note in notes]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
