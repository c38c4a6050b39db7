"""sageattn per call against every SDPA backend on a grid of shapes that models run (UNet self-
and cross-attention, DiT joint attention, LLM prefill with GQA, padded encoders, short queries on
long keys, 64K), side by side in one process: the GPU time of one call (do_bench median, L2
flushed), and what sageattn runs there (explain).

    python3 benchmarks/bench_grid.py [--rep 100] [--out grid.md] [--quick]

Per row: SDPA flash, cuDNN and its default choice (ms), sageattn's default call (ms: the
quantized kernel, or exact SDPA where the crossover table says it is faster) and its speed over
the fastest SDPA backend, the quantized kernel forced (``qk_quant="int8"``, ms) and its speed over
cuDNN. The summary counts the rows where the default call is at least 0.97x the fastest backend,
and where the forced kernel is at least 1.0x cuDNN (issue 33's per-call criteria).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import timing  # noqa: E402

import sageattention2  # noqa: E402
from sageattention2 import sageattn  # noqa: E402


class Shape(NamedTuple):
    what: str
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    causal: bool = False
    dtype: torch.dtype = torch.float16


GRID: tuple[Shape, ...] = (
    Shape("tiny", 1, 8, 8, 128, 128, 64),
    Shape("SD1.5 self 64x64", 2, 8, 8, 4096, 4096, 40),
    Shape("SD1.5 cross 64x64", 2, 8, 8, 4096, 77, 40),
    Shape("SD1.5 self 32x32", 2, 8, 8, 1024, 1024, 80),
    Shape("SD1.5 cross 32x32", 2, 8, 8, 1024, 77, 80),
    Shape("SDXL self 64x64", 2, 10, 10, 4096, 4096, 64),
    Shape("SDXL cross 64x64", 2, 10, 10, 4096, 77, 64),
    Shape("SDXL self 32x32", 2, 20, 20, 1024, 1024, 64),
    Shape("SDXL cross 32x32", 2, 20, 20, 1024, 77, 64),
    Shape("Flux joint 1024px", 1, 24, 24, 4608, 4608, 128, dtype=torch.bfloat16),
    Shape("CogVideoX 49f", 1, 48, 48, 17776, 17776, 64, dtype=torch.bfloat16),
    Shape("Wan self 81f", 1, 12, 12, 32760, 32760, 128, dtype=torch.bfloat16),
    Shape("Wan cross 81f", 1, 12, 12, 32760, 512, 128, dtype=torch.bfloat16),
    Shape("Hunyuan joint", 1, 24, 24, 32896, 32896, 128, dtype=torch.bfloat16),
    Shape("Llama 8K prefill GQA", 1, 32, 8, 8192, 8192, 128, True, torch.bfloat16),
    Shape("Llama 32K prefill GQA", 1, 32, 8, 32768, 32768, 128, True, torch.bfloat16),
    Shape("BERT 16x512", 16, 12, 12, 512, 512, 64),
    Shape("short q on long k", 1, 32, 8, 256, 8192, 128, False, torch.bfloat16),
    Shape("one query, 8K keys", 1, 32, 8, 1, 8192, 128, False, torch.bfloat16),
    Shape("64K causal", 1, 8, 8, 65536, 65536, 128, True),
    *(Shape(f"B4 H32 {n // 1024}K", 4, 32, 32, n, n, d, causal)
      for d in (64, 128) for n in (1024, 4096, 16384) for causal in (False, True)),
    *(Shape(f"B2 H8 {n // 1024}K", 2, 8, 8, n, n, d, causal, torch.bfloat16)
      for d in (64, 128) for n in (1024, 2048, 8192) for causal in (False, True)),
)
QUICK = ("tiny", "SDXL self 64x64", "SDXL cross 64x64", "B4 H32 4K", "Llama 8K prefill GQA")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rep", type=int, default=100, help="do_bench's time budget per timing (ms)")
    parser.add_argument("--quick", action="store_true", help="five shapes only")
    parser.add_argument("--out", default=None, help="write the table (Markdown) here")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    table = timing.Table(["shape", "B", "Hq/Hkv", "Nq", "Nk", "D", "causal", "dtype", "flash ms", "cuDNN ms",
                          "SDPA default ms", "sageattn ms", "vs fastest", "sageattn runs", "int8 forced ms",
                          "forced vs cuDNN"],
                         f"{torch.cuda.get_device_name()} | one call, GPU time (do_bench median)")
    vs_fastest, vs_cudnn = [], []
    for s in GRID:
        if args.quick and s.what not in QUICK:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(s.b, s.hq, s.nq, s.d, device="cuda", dtype=s.dtype, generator=g)
        k, v = (torch.randn(s.b, s.hkv, s.nk, s.d, device="cuda", dtype=s.dtype, generator=g) for _ in range(2))
        times = {b: timing.sdpa_ms(b, q, k, v, s.causal, args.rep, enable_gqa=s.hq != s.hkv)
                 for b in timing.SDPA_BACKENDS}
        kwargs = dict(is_causal=s.causal, enable_gqa=s.hq != s.hkv)
        ours = timing.median_ms(lambda: sageattn(q, k, v, **kwargs), rep=args.rep)
        forced = timing.median_ms(lambda: sageattn(q, k, v, qk_quant="int8", **kwargs), rep=args.rep)
        fastest = min(t for t in times.values() if t is not None)
        vs_fastest.append(fastest / ours)
        cudnn = times["cudnn"]
        if cudnn is not None:
            vs_cudnn.append(cudnn / forced)
        cell = lambda t: "-" if t is None else f"{t:.4f}"  # noqa: E731
        table.row(s.what, s.b, f"{s.hq}/{s.hkv}", s.nq, s.nk, s.d, s.causal, str(s.dtype).split(".")[-1],
                  cell(times["flash"]), cell(cudnn), cell(times["default"]), f"{ours:.4f}",
                  f"{fastest / ours:.2f}x", sageattention2.explain(q, k, v, **kwargs).kernel,
                  f"{forced:.4f}", "-" if cudnn is None else f"{cudnn / forced:.2f}x")
    table.lines += ["", f"{sum(r >= 0.97 for r in vs_fastest)} of {len(vs_fastest)} shapes: the default call at "
                    f">= 0.97x the fastest SDPA backend; {sum(r >= 1.0 for r in vs_cudnn)} of {len(vs_cudnn)}: "
                    "the forced kernel at >= 1.0x cuDNN"]
    print(table.lines[-1])
    table.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
