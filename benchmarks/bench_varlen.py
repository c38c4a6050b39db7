"""sageattn_varlen against padding to the longest sequence, side by side in one process: packed
sequences of random lengths (1 to --max tokens, seeded) through ``sageattn_varlen`` (in one
launch where it runs so, and with one ``sageattn`` call per sequence), against the same
sequences padded to the longest as one batch through ``sageattn`` (the padding computed: what a
caller without varlen runs) and through SDPA with the key-padding mask.

    python3 benchmarks/bench_varlen.py [--sequences 16] [--max 8192] [--heads 16] [--d 128] [--equal]
                                       [--causal] [--pv-quant auto|none|fp8] [--prefill N]
                                       [--kernel mma] [--qk-quant auto|int8]

--equal: every sequence --max tokens (no padding: the packed path against the batched call).
--pv-quant none: the accurate tier in every sageattn row (fp8: FP8 PV).
--qk-quant int8: every sageattn row quantized (no crossover to exact SDPA per sequence).
--kernel mma: route as on a GPU without the Hopper kernel (Ampere, Ada): every sageattn row runs
the warp-level kernel (on sm_90 its FP8 mma.sync is emulated: time --pv-quant fp8 there only to
compare the two sageattn_varlen rows).
--prefill N: chunked prefill over a KV cache: each sequence's queries are its last N tokens (all
of a shorter one), causal aligned to the bottom-right (flash-attn's rule); the padded rows are
left out (padding moves each sequence's diagonal).

Time per call, do_bench median (timing.py): the GPU's, or the host's where it is the longer
(a call per sequence).
"""
from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F

import timing

from sageattention2 import _varlen, sageattn, sageattn_varlen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--max", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--equal", action="store_true", help="every sequence --max tokens")
    parser.add_argument("--pv-quant", default="auto", choices=("auto", "none", "fp8"),
                        help="none: the accurate tier (P and V in the input dtype)")
    parser.add_argument("--kernel", choices=("mma",), help="the warp-level kernel's routes")
    parser.add_argument("--qk-quant", default="auto", choices=("auto", "int8"))
    parser.add_argument("--prefill", type=int, default=0,
                        help="queries per sequence, its last tokens, causal bottom-right")
    args = parser.parse_args()
    if args.kernel == "mma":  # before any call: the routes and the call cache read the target
        from sageattention2 import _plan
        hopper = _plan.target_of(torch.device("cuda"))
        _plan.target_of = lambda device: hopper._replace(wgmma=False)
    options = dict(is_causal=args.causal or args.prefill > 0, pv_quant=args.pv_quant,
                   qk_quant=args.qk_quant)
    if args.prefill:
        options["causal_alignment"] = "bottom_right"
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    lengths = ([args.max] * args.sequences if args.equal
               else torch.randint(1, args.max + 1, (args.sequences,), generator=g).tolist())
    total, longest, h, d = sum(lengths), max(lengths), args.heads, args.d
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    padded = [torch.zeros(len(lengths), longest, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    mask = torch.zeros(len(lengths), 1, 1, longest, device="cuda", dtype=torch.bool)
    for i, (s, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        for dst, src in zip(padded, (q, k, v)):
            dst[i, : e - s] = src[s:e]
        mask[i, ..., : e - s] = True
    pq, pk, pv = padded
    cu_q = cu
    if args.prefill:
        chunks = [min(args.prefill, n) for n in lengths]
        q = torch.cat([q[e - n:e] for e, n in zip(cu.tolist()[1:], chunks)])
        cu_q = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], device="cuda", dtype=torch.int32)

    def per_sequence() -> torch.Tensor:
        one_launch, _varlen._one_launch = _varlen._one_launch, lambda *_: None
        try:
            return sageattn_varlen(q, k, v, cu_q, cu, longest, longest, **options)  # type: ignore[return-value]
        finally:
            _varlen._one_launch = one_launch

    rows = {
        "sageattn_varlen": lambda: sageattn_varlen(q, k, v, cu_q, cu, longest, longest, **options),
        "sageattn_varlen, a sageattn call per sequence": per_sequence,
    }
    if not args.prefill:
        rows["sageattn, padded to the longest"] = lambda: sageattn(pq, pk, pv, tensor_layout="NHD", **options)
    if not args.causal and not args.prefill:  # SDPA takes a mask or is_causal, not both
        rows["SDPA, padded, key mask"] = lambda: F.scaled_dot_product_attention(
            pq.transpose(1, 2), pk.transpose(1, 2), pv.transpose(1, 2), attn_mask=mask)
    table = timing.Table(["call", "ms"], f"{torch.cuda.get_device_name()} | {len(lengths)} sequences of "
                         f"{min(lengths)}-{longest} tokens ({total} in all), H{h} D{d}, causal={args.causal}, "
                         f"prefill={args.prefill}, qk_quant={args.qk_quant}, "
                         f"pv_quant={args.pv_quant}")
    for name, fn in rows.items():
        table.row(name, f"{timing.median_ms(fn):.3f}")


if __name__ == "__main__":
    main()
