"""A/B of the Hopper kernel's grid in one process: persistent CTAs (one per SM, static
round-robin over units) against one CTA per unit (the hardware's dynamic block scheduling).
Kernel only, ANCHORS protocol (B4 H32 fp16), alternating the two settings to cancel drift.

    python3 scripts/ab_wgmma_grid.py [--d 128 64] [--n 1024 4096 16384]
"""
import argparse
import os

import torch
from triton.testing import do_bench

from sageattention2 import ops

parser = argparse.ArgumentParser()
parser.add_argument("--d", type=int, nargs="+", default=[128, 64])
parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

print("| D | N | causal | persistent TOPS (rounds) | per-unit TOPS (rounds) | ratio |")
print("|---|---|---|---|---|---|")
for d in args.d:
    for n in args.n:
        q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        stats = ops.smoothing_stats(None, k, v, False)
        kv = ops.quantize_kv(k, v, stats.k_mean, None, stats.v_scale, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
        for causal in (False, True):
            count = 4 * 4 * 32 * n * n * d / (2 if causal else 1)
            fn = lambda: ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, stats.v_scale, None, None,  # noqa: E731
                                             n, d ** -0.5, causal, False, False)
            res = {"persistent": [], "units": []}
            for _ in range(args.rounds):
                for mode in res:
                    os.environ["SAGEATTN_WGMMA_GRID"] = mode
                    res[mode].append(count / do_bench(fn, warmup=25, rep=150, return_mode="median") / 1e9)
            med = {m: sorted(v)[len(v) // 2] for m, v in res.items()}
            fmt = lambda m: f"{med[m]:.0f} ({' '.join(f'{x:.0f}' for x in res[m])})"  # noqa: E731
            print(f"| {d} | {n} | {causal} | {fmt('persistent')} | {fmt('units')} | {med['persistent'] / med['units']:.3f} |",
                  flush=True)
        del q, k, v, kv
        torch.cuda.empty_cache()
os.environ.pop("SAGEATTN_WGMMA_GRID", None)
