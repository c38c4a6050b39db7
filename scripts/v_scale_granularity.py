"""Accuracy of V's FP8 scale granularity alone (CPU, float64 softmax): P exact, V quantized to
E4M3 per channel over all tokens (the kernels now, reference.quantize_v_per_channel), per
128-key tile with one scalar, or per tile and channel; rel. L1 of P V against exact attention
on the ANCHORS families (B1 H8 N4096 D128) and a family with V channel outliers (4 channels
x30, 4 x0.01, on bias4).

    python3 scripts/v_scale_granularity.py
"""
import math

import torch

from sageattention2 import reference as ref

TILE = 128
FP8_MAX = ref.FP8_FORMATS["e4m3"][1]


def per_tile(v: torch.Tensor, channel_wise: bool) -> torch.Tensor:
    """V dequantized from E4M3 codes with one scale per 128-key tile (and channel)."""
    b, h, n, d = v.shape
    tiles = v.float().view(b, h, n // TILE, TILE, d)
    scale = tiles.abs().amax(dim=3 if channel_wise else (3, 4), keepdim=True) / FP8_MAX
    return (ref.quantize_fp8(tiles / scale).double() * scale.double()).view(b, h, n, d)


def per_channel(v: torch.Tensor) -> torch.Tensor:
    codes, scale = ref.quantize_v_per_channel(v)
    return codes.double() * scale.double()[:, :, None, :]


for family in ("bias0", "bias4", "outliers", "v-outlier-channels"):
    gen = torch.Generator().manual_seed(1)
    q, k, v = ref.make_input_family("bias4" if family == "v-outlier-channels" else family,
                                    (1, 8, 4096, 128), generator=gen)
    if family == "v-outlier-channels":
        v = v.clone()
        v[..., :4] *= 30
        v[..., 4:8] *= 0.01
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(128), dim=-1)
    exact = p @ v.double()
    for name, vq in (("per channel (now)", per_channel(v)), ("per tile, one scalar", per_tile(v, False)),
                     ("per tile and channel", per_tile(v, True))):
        print(f"{family:20s} {name:22s} rel. L1 of P V {ref.relative_l1(p @ vq, exact):.3e}", flush=True)
