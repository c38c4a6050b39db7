"""A/B of a launch setting read from the environment, in one process: the Hopper kernel alone
and the full sageattn call, ANCHORS protocol (B4 H32 fp16), alternating the settings to cancel
drift. Setting: SAGEATTN_WGMMA_GRID (persistent | units, attention_wgmma.cu).

    python3 scripts/ab_env.py [--var SAGEATTN_WGMMA_GRID --values persistent units] [--d 128 64]
                              [--n 1024 4096 16384]
"""
import argparse
import os

import torch

from hopper_timing import anchors_inputs, kernel_alone, ms, tops
from sageattention2 import sageattn

parser = argparse.ArgumentParser()
parser.add_argument("--var", default="SAGEATTN_WGMMA_GRID")
parser.add_argument("--values", nargs=2, default=["persistent", "units"])
parser.add_argument("--d", type=int, nargs="+", default=[128, 64])
parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
a, b = args.values

print(f"{args.var}: TOPS, median of {args.rounds} alternating rounds")
print(f"| D | N | causal | kernel {a} | kernel {b} | ratio | full {a} | full {b} | ratio |")
print("|---|---|---|---|---|---|---|---|---|")
for d in args.d:
    for n in args.n:
        q, k, v, kv = anchors_inputs(n, d)
        for causal in (False, True):
            fns = {
                "kernel": kernel_alone(q, kv, causal),
                "full": lambda: sageattn(q, k, v, is_causal=causal),
            }
            med = {}
            for what, fn in fns.items():
                res = {a: [], b: []}
                for _ in range(args.rounds):
                    for value in (a, b):
                        os.environ[args.var] = value
                        res[value].append(tops(ms(fn), n, d, causal))
                for value in (a, b):
                    med[what, value] = sorted(res[value])[len(res[value]) // 2]
            cells = []
            for what in fns:
                cells += [f"{med[what, a]:.0f}", f"{med[what, b]:.0f}", f"{med[what, a] / med[what, b]:.3f}"]
            print(f"| {d} | {n} | {causal} | " + " | ".join(cells) + " |", flush=True)
        del q, k, v, kv
        torch.cuda.empty_cache()
os.environ.pop(args.var, None)
