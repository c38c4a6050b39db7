"""Attention throughput, the protocol of docs/PROTOCOL.md (benchmarks/timing.py), side by side in
one process:

    python3 benchmarks/bench_attention.py [--quick] [--out table.md] [--env NAME=VALUE ...]
                                          [--no-sdpa] [--d 128 64] [--n 1024 4096 16384] [--rep 150]
                                          [--pv-quant auto|none]

TOPS of B=4 H=32 fp16 HND inputs. Columns: SDPA flash (FA2) and cuDNN; sageattn, the full call
(every preprocessing launch included, strict=True so that a fallback cannot be timed); the
attention kernel sageattn runs on this GPU alone, on K and V quantized once (attention_wgmma on
sm_90, attention_mma elsewhere); with --env, the full call again under each launch setting
(e.g. SAGEATTN_PDL=0: each launch waits for the one before to end), in the same process.
--no-sdpa drops the SDPA columns (an A/B of two builds: SDPA is the same code on both sides).
--pv-quant none times the accurate tier (P and V in the input dtype) instead of the default PV.
"""
from __future__ import annotations

import argparse

import torch

import sageattention2
import timing
from sageattention2 import sageattn


def rows(table: timing.Table, args: argparse.Namespace, n: int, d: int, sdpa: tuple[str, ...]) -> None:
    """The table's two rows (causal off, on) of one sequence length and head dim."""
    q, k, v = timing.anchors_inputs(n, d)
    for causal in (False, True):
        def tops(ms: float | None) -> float:
            return timing.tops(ms, n, d, causal)

        def full() -> object:
            return sageattn(q, k, v, is_causal=causal, qk_quant="int8", pv_quant=args.pv_quant,
                            strict=True)  # the kernel, not auto's choice

        base = [tops(timing.sdpa_ms(b, q, k, v, causal, args.rep)) for b in sdpa]
        full_tops = tops(timing.median_ms(full, rep=args.rep))
        alone = tops(timing.median_ms(timing.kernel_call(q, k, v, causal, args.pv_quant), rep=args.rep))
        variants = []
        for env in args.env:
            with timing.environment(env.split(",")):
                variants.append(tops(timing.median_ms(full, rep=args.rep)))
        ratios = [f"{full_tops / b:.2f}x" if b == b else "-" for b in base]  # b != b: NaN, no SDPA time
        table.row(d, n, causal, *base, full_tops, alone, *variants, *ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="head_dim 128, N in {1K, 4K} only")
    parser.add_argument("--d", type=int, nargs="+", help="head dims (default 128 64)")
    parser.add_argument("--n", type=int, nargs="+", help="sequence lengths (default 1024 4096 16384)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="a column of the full call under these environment variables (repeatable)")
    parser.add_argument("--no-sdpa", action="store_true", help="without the SDPA columns")
    # do_bench's time budget per measurement: one 16K hd128 call takes ~19 ms, so 150 ms gives
    # ~8 samples and +-7 % (docs/PROTOCOL.md#timing); ~1000 steadies that row.
    parser.add_argument("--rep", type=int, default=timing.REP_MS, help="do_bench rep, ms")
    parser.add_argument("--out", help="also write the table as Markdown here")
    parser.add_argument("--pv-quant", choices=("auto", "none"), default="auto",
                        help="none: the accurate tier (PV in the input dtype)")
    args = parser.parse_args()
    dims = args.d or ((128,) if args.quick else (128, 64))
    lengths = args.n or ((1024, 4096) if args.quick else (1024, 4096, 16384))
    kernel, qk, fp8_v = timing.default_kernel()
    sdpa = () if args.no_sdpa else ("flash", "cudnn")
    names = [{"flash": "flash", "cudnn": "cuDNN"}[b] for b in sdpa]
    columns = ["D", "N", "causal", *(f"SDPA {b}" for b in names), "sageattn full", "kernel only",
               *(f"full, {e}" for e in args.env), *(f"full / {b}" for b in names)]
    title = (f"{torch.cuda.get_device_name()} | TOPS, B={timing.BATCH} H={timing.HEADS} fp16 | kernel only: "
             f"attention_{kernel} {qk}{' + fp8 PV' if fp8_v else ''} | pv_quant {args.pv_quant} | sageattention2 of "
             f"{sageattention2.__path__[0]}")
    table = timing.Table(columns, title)
    for d in dims:
        for n in lengths:
            rows(table, args, n, d, sdpa)
            torch.cuda.empty_cache()  # the next size starts from the same free memory
    table.write(args.out)


if __name__ == "__main__":
    main()
