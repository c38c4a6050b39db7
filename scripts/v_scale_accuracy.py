"""Accuracy of the Hopper kernel's algorithm (emulated in float64 on the GPU) with V's FP8 scale
per channel over all tokens or per 128-key tile, on the ANCHORS draw (manual_seed(0), in its
order) and on further draws of the same families: rel. L1 and CosSim against float64 attention.
One draw is a noisy verdict (E4M3's rounding of each value moves with the scale); the mean over
draws is not.

    python3 scripts/v_scale_accuracy.py [--draws 4] [--pow2]
"""
import argparse
import math

import torch

from sageattention2 import reference as ref

parser = argparse.ArgumentParser()
parser.add_argument("--draws", type=int, default=4, help="draws beyond the ANCHORS one")
parser.add_argument("--pow2", action="store_true", help="also per-tile scales rounded up to a power of 2")
args = parser.parse_args()

per_tile = ref.quantize_v_per_tile


def per_tile_pow2(v, v_mean, block_k, fmt="e4m3"):
    codes, scale = per_tile(v, v_mean, block_k, fmt)
    scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).float()
    x = v.float() - (0 if v_mean is None else v_mean.float()[:, :, None, :])
    inv = (1.0 / scale).repeat_interleave(block_k, dim=2)[:, :, : x.shape[2], None]
    return ref.quantize_fp8(x * inv, fmt), scale


variants = {"channel": dict(), "tile": dict(v_granularity="tile")}
if args.pow2:
    variants["tile pow2"] = dict(v_granularity="tile", pow2=True)


def emulate(q, k, v, causal, pow2=False, **kw):
    ref.quantize_v_per_tile = per_tile_pow2 if pow2 else per_tile
    return ref.sage_attention_reference(
        q, k, v, is_causal=causal, qk_dtype="int8", granularity="thread", block_q=128, warps=8, block_k=128,
        smooth_k=True, smooth_q=None, pv_dtype="e4m3", two_level=True, fp22=True, row_sum="pv", **kw)


sums = {}
print("| draw | family | causal | " + " | ".join(variants) + " |")
print("|---|---|---|" + "---|" * len(variants))
for draw in range(args.draws + 1):
    torch.manual_seed(0 if draw == 0 else 1000 + draw)
    families = {name: ref.make_input_family(name, (1, 8, 4096, 128), torch.float16, "cuda")
                for name in ("bias0", "bias4", "outliers")}
    for name, (q, k, v) in families.items():
        for causal in (False, True):
            want = ref.exact_attention(q, k, v, is_causal=causal)
            cells = []
            for label, kw in variants.items():
                out = emulate(q, k, v, causal, **kw).half()
                l1, cos = ref.relative_l1(out, want), ref.cosine_similarity(out, want)
                sums.setdefault((name, causal, label), []).append(l1)
                cells.append(f"{l1:.5f} / {cos:.6f}")
            print(f"| {'ANCHORS' if draw == 0 else draw} | {name} | {causal} | " + " | ".join(cells) + " |",
                  flush=True)
print("\nmean rel. L1 over the draws:")
for name in ("bias0", "bias4", "outliers"):
    for causal in (False, True):
        print(f"| {name} | {causal} | " + " | ".join(
            f"{sum(sums[name, causal, label]) / len(sums[name, causal, label]):.5f}" for label in variants) + " |")
