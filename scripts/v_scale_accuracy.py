"""Accuracy of the Hopper kernel's algorithm (emulated in float64 on the GPU) with V's FP8 scale
per channel over all tokens or per 128-key tile, on the ANCHORS draw (manual_seed(0), in its
order) and on further draws of the same families: rel. L1 and CosSim against float64 attention.
One draw is a noisy verdict (E4M3's rounding of each value moves with the scale); the mean over
draws is not.

    python3 scripts/v_scale_accuracy.py [--draws 4] [--pow2]
"""
import argparse
import functools

import torch

from accuracy_draws import print_draws
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
        smooth_k=True, smooth_q=None, pv_dtype="e4m3", two_level=True, fp22=True, row_sum="pv", **kw).half()


print_draws({label: functools.partial(emulate, **kw) for label, kw in variants.items()}, args.draws)
