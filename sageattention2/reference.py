"""Pure-PyTorch reference for SageAttention2 (ICML 2025).

Everything here runs on any device and depends on torch only. It has three jobs:

* ground truth: :func:`exact_attention` (float64, ``scaled_dot_product_attention`` semantics);
* the op formats of ``docs/DESIGN.md#ops``: :func:`smoothing_stats_reference`,
  :func:`quantize_kv_reference` return exactly what the CUDA ops return (shapes, padding, dtypes,
  bits), so GPU tests compare bit for bit and the op layer can use them as its CPU
  implementation; :func:`quantize_q_reference` is what the attention kernels do to Q inside;
* a readable simulation of the whole quantized forward, :func:`sage_attention_reference`
  (Algorithm 1 of the paper, tile by tile over the keys), with switches for what each kernel
  does (:func:`hopper_kernel_reference` is the Hopper kernel's setting of them).

The paper's ablations (Q and K per token, per block or per tensor) are in
``sageattention2.ablation``; accuracy metrics and the input families of
``docs/PROTOCOL.md#input-families`` in ``sageattention2.testing``.

Citations "paper X" refer to sections, equations, tables and appendices of the paper.

Float32 arithmetic. The quantizer follows docs/DESIGN.md#quantizer-arithmetic bit for bit: IEEE
float32, round to nearest even. The divisions ``amax / qmax`` and ``1 / scale`` are computed in
float64 and rounded once to float32: for operands that are float32 values this is exactly the
correctly rounded float32 quotient (double rounding is innocuous when the wider format has at least
2p+2 bits, 53 >= 50), and it does not depend on how a torch backend implements division by a scalar
(some replace it by a multiplication with the reciprocal). Elementwise float32 subtraction and
multiplication in torch are single IEEE operations on every backend.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "INT_QMAX",
    "FP8_FORMATS",
    "V_KEY_ORDER",
    "exact_attention",
    "q_group_index",
    "k_group_index",
    "q_group_sets",
    "k_group_sets",
    "group_index_sets",
    "int_qmax",
    "pad_tokens",
    "quantize_symmetric",
    "quantize_q_per_thread",
    "quantize_k_per_thread",
    "quantize_per_token",
    "KERNEL_GRANULARITIES",
    "quantize_kernel_rows",
    "RowQuantizer",
    "quantize_fp8",
    "quantize_p_fp8",
    "quantize_v_per_channel",
    "pack_int4",
    "unpack_int4",
    "v_key_permutation",
    "SmoothedQK",
    "smooth_qk",
    "delta_s",
    "smoothing_stats_reference",
    "quantize_q_reference",
    "quantize_kv_reference",
    "fp22_truncate",
    "sage_attention_reference",
    "hopper_kernel_reference",
    "quantize_v_per_tile",
]

# Largest code of each integer format: symmetric ranges, [-7, 7] for INT4 as in paper 2.2.
INT_QMAX: dict[str, int] = {"int8": 127, "int4": 7}

# FP8 formats (paper 3.3, Table 7): torch dtype and largest finite value.
FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}

# docs/DESIGN.md#v-layout: stored order of the keys inside every 16 keys of transposed V, so that
# the S accumulator fragment (keys {2t, 2t+1, 8+2t, 9+2t} in lane t%4) is the A operand of the
# FP8 PV mma without a shuffle.
V_KEY_ORDER: tuple[int, ...] = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)

# Smallest per-tile V scale (quantize_v_per_tile, the Hopper kernel's V): an all-zero tile still
# gets a finite ratio s_prev / s_tile in the fold, and V values down to 2^-39 keep E4M3's relative
# precision. The fold then stays in float32 as long as a head's tile maxima are < 2^60 (always
# for fp16 inputs; bf16 V beyond 1e18 could overflow, csrc/common/quant_math.cuh).
V_TILE_SCALE_MIN = 2.0 ** -30

# K extent of one FP8 mma (mma.m16n8k32.e4m3): the accumulator is rounded (FP22, paper 3.4)
# once per this many keys.
PV_MMA_K = 32

# How the kernels quantize Q and K (quantize_kernel_rows): per thread (paper Eq. 8; both kernels'
# K, the warp-level kernel's Q) and per token (the Hopper kernel's Q).
KERNEL_GRANULARITIES = ("thread", "token")


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _absent(t: Optional[Tensor]) -> bool:
    """An optional op argument is absent when it is None or an empty tensor (docs/DESIGN.md#ops)."""
    return t is None or t.numel() == 0


def _empty(device: torch.device) -> Tensor:
    """Absent op outputs are empty float32 tensors of shape [0] (docs/DESIGN.md#ops)."""
    return torch.empty(0, dtype=torch.float32, device=device)


def _f32_div(a: Tensor | float, b: Tensor | float) -> Tensor:
    """Correctly rounded float32 quotient of float32 values (see the module docstring)."""
    a64 = a.double() if isinstance(a, Tensor) else a
    b64 = b.double() if isinstance(b, Tensor) else b
    return torch.as_tensor(a64 / b64).float()


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_tokens(x: Tensor, multiple: int) -> Tensor:
    """Zero-pad dim -2 (tokens) of [B,H,N,D] to a multiple; contiguous result.

    Padding is applied after smoothing, so padded rows are exactly 0 and never raise a group's
    absmax: "rows and keys past the sequence end are padding: they are in no group's max"
    (docs/DESIGN.md#quantization-groups).
    """
    n = x.shape[-2]
    pad = _ceil_to(n, multiple) - n
    return torch.nn.functional.pad(x, (0, 0, 0, pad)).contiguous()


def _expand_kv_heads(x: Tensor, n_q_heads: int) -> Tensor:
    """GQA: q head hq uses kv head hq // (Hq / Hkv) (SDPA enable_gqa,
    docs/DESIGN.md#canonical-shapes)."""
    n_kv_heads = x.shape[1]
    if n_q_heads == n_kv_heads:
        return x
    if n_q_heads % n_kv_heads != 0:
        raise ValueError(f"q heads ({n_q_heads}) must be a multiple of kv heads ({n_kv_heads})")
    return x.repeat_interleave(n_q_heads // n_kv_heads, dim=1)


def _check_4d(**tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.dim() != 4:
            raise ValueError(f"{name} must be [B, H, N, D], got shape {tuple(t.shape)}")


def int_qmax(qk_dtype: str) -> int:
    """The largest code of ``qk_dtype`` ("int8", "int4"), checked."""
    if qk_dtype not in INT_QMAX:
        raise ValueError(f"qk_dtype must be one of {sorted(INT_QMAX)}, got {qk_dtype!r}")
    return INT_QMAX[qk_dtype]


def _fp8_format(fmt: str) -> tuple[torch.dtype, float]:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    return FP8_FORMATS[fmt]


# --------------------------------------------------------------------------------------------
# Ground truth
# --------------------------------------------------------------------------------------------


def exact_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Float64 attention with the semantics of ``torch.nn.functional.scaled_dot_product_attention``.

    q [B,Hq,Nq,D], k [B,Hkv,Nk,D], v [B,Hkv,Nk,Dv]; returns float64 [B,Hq,Nq,Dv] (and the float64
    natural-log LSE [B,Hq,Nq] of the scaled, masked scores when ``return_lse``).

    * ``scale`` defaults to 1/sqrt(D) (paper 2.1: S = QK^T / sqrt(d)).
    * ``is_causal``: query i attends key j iff j <= i, the top-left aligned lower triangle that SDPA
      builds with ``ones(Nq, Nk).tril()`` also when Nq != Nk. Cannot be combined with a mask.
    * ``attn_mask`` broadcastable to [B,Hq,Nq,Nk]: bool (True = attend) or float (added).
    * A row that attends no key (all False / all -inf) outputs 0, as SDPA's math path does
      (its "safe softmax"), and has LSE -inf.
    * ``enable_gqa``: Hq a multiple of Hkv, q head hq uses kv head hq // (Hq/Hkv); without it the
      head counts must match.
    """
    _check_4d(q=q, k=k, v=v)
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal and attn_mask cannot both be given (as in SDPA)")
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    if k.shape[1] != Hq and not enable_gqa:
        raise ValueError("q and k/v head counts differ; pass enable_gqa=True for GQA")
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k64 = _expand_kv_heads(k.double(), Hq)
    v64 = _expand_kv_heads(v.double(), Hq)
    mask = None if attn_mask is None else torch.broadcast_to(attn_mask, (B, Hq, Nq, Nk))

    # Work on chunks of queries so that the float64 score matrix stays small (~256 MB).
    rows = max(1, min(Nq, (1 << 25) // max(1, B * Hq * Nk)))
    outs, lses = [], []
    for r0 in range(0, Nq, rows):
        r1 = min(Nq, r0 + rows)
        s = torch.matmul(q[:, :, r0:r1].double(), k64.transpose(-1, -2)) * sm_scale
        if is_causal:
            i = torch.arange(r0, r1, device=q.device)[:, None]
            j = torch.arange(Nk, device=q.device)[None, :]
            s = s.masked_fill(j > i, -math.inf)
        if mask is not None:
            m = mask[:, :, r0:r1]
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.double()
        row_max = s.amax(dim=-1, keepdim=True)
        # Fully masked rows: subtract 0 instead of -inf so that they give p = 0, l = 0.
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(s - row_max)
        l = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(p, v64) / l
        outs.append(torch.where(l > 0, o, torch.zeros_like(o)))
        lses.append((row_max + torch.log(l)).squeeze(-1))
    out = torch.cat(outs, dim=2)
    if return_lse:
        return out, torch.cat(lses, dim=2)
    return out


# --------------------------------------------------------------------------------------------
# Per-thread quantization groups (paper 3.2, Eq. 8, Fig. 4, Fig. 18, appendix A.6)
# --------------------------------------------------------------------------------------------


def q_group_index(block_q: int, warps: int) -> Tensor:
    """Group of each row of a Q block: (r // rows_per_warp) * 8 + r % 8
    (docs/DESIGN.md#quantization-groups).

    Lane l of an mma accumulator owns rows l/4 and l/4 + 8 of every 16-row slab (Fig. 18), so the
    rows {i, 8+i, 16+i, ...} of one warp's slice are dequantized by one thread (appendix A.6).
    """
    if block_q % warps != 0 or (block_q // warps) % 16 != 0:
        raise ValueError("block_q / warps must be a positive multiple of 16 (mma row slabs)")
    rows_per_warp = block_q // warps
    r = torch.arange(block_q)
    return (r // rows_per_warp) * 8 + r % 8


def k_group_index(block_k: int) -> Tensor:
    """Group of each key of a K block: (j % 8) // 2 (docs/DESIGN.md#quantization-groups).

    Lane l owns columns 2(l%4) and 2(l%4)+1 of every 8-column slab (Fig. 18), hence the groups
    {8m + 2g, 8m + 2g + 1}. Appendix A.6 prints the group starts as j = 0..3; with the fragment
    layout they are 0, 2, 4, 6, which is what the hardware needs (the same section).
    """
    if block_k <= 0 or block_k % 8 != 0:
        raise ValueError("block_k must be a positive multiple of 8 (mma column slabs)")
    j = torch.arange(block_k)
    return (j % 8) // 2


def group_index_sets(group_index: Tensor) -> list[list[int]]:
    """Explicit member lists of every group: sets[g] = sorted positions with group_index == g."""
    n_groups = int(group_index.max()) + 1
    return [torch.nonzero(group_index == g).flatten().tolist() for g in range(n_groups)]


def q_group_sets(block_q: int = 128, warps: int = 4) -> list[list[int]]:
    """The warps*8 Q groups of one block as row lists (32 groups of 4 rows for 128 / 4)."""
    return group_index_sets(q_group_index(block_q, warps))


def k_group_sets(block_k: int = 64) -> list[list[int]]:
    """The 4 K groups of one block as key lists ({8m+2g, 8m+2g+1} for block_k = 64)."""
    return group_index_sets(k_group_index(block_k))


# --------------------------------------------------------------------------------------------
# Bit-level quantizers (paper 2.2 and 3.2; arithmetic of docs/DESIGN.md#quantizer-arithmetic)
# --------------------------------------------------------------------------------------------


def quantize_symmetric(x: Tensor, reduce_dims: Sequence[int], qmax: int) -> tuple[Tensor, Tensor]:
    """Absmax quantizer over ``reduce_dims`` (kept as size-1 dims in the returned scale).

    docs/DESIGN.md#quantizer-arithmetic: scale = amax / qmax; inv = 1/scale (0 if scale == 0);
    q = clamp(rint(x * inv), -qmax, qmax), all float32, round half to even (torch.round).
    """
    x = x.float()
    amax = x.abs().amax(dim=tuple(reduce_dims), keepdim=True)
    scale = _f32_div(amax, float(qmax))
    inv = torch.where(scale > 0, _f32_div(1.0, scale), torch.zeros_like(scale))
    codes = torch.clamp(torch.round(x * inv), -qmax, qmax).to(torch.int8)
    return codes, scale


def quantize_q_per_thread(x: Tensor, block_q: int, warps: int, qmax: int) -> tuple[Tensor, Tensor]:
    """Per-thread Q quantization (paper Eq. 8): one scale per (Q block, group of q_group_index).

    x: [B,H,N,D] float32 (already smoothed). Returns codes int8 [B,H,N_pad,D] (padding rows 0)
    and scale float32 [B,H,N_pad/block_q, warps*8] (0 for groups made only of padding).
    """
    q_group_index(block_q, warps)  # validates the geometry
    B, H, _, D = x.shape
    xp = pad_tokens(x.float(), block_q)
    n_pad = xp.shape[2]
    rows_per_warp = block_q // warps
    # Row r = w*rows_per_warp + m*8 + i belongs to group w*8 + i: reduce over m and channels.
    view = xp.view(B, H, n_pad // block_q, warps, rows_per_warp // 8, 8, D)
    codes, scale = quantize_symmetric(view, (4, 6), qmax)
    return codes.view(B, H, n_pad, D), scale.view(B, H, n_pad // block_q, warps * 8)


def quantize_k_per_thread(x: Tensor, block_k: int, qmax: int) -> tuple[Tensor, Tensor]:
    """Per-thread K quantization (paper Eq. 8): 4 scales per K block, groups of k_group_index.

    x: [B,H,N,D] float32 (already smoothed). Returns codes int8 [B,H,N_pad,D] and scale float32
    [B,H,N_pad/block_k,4].
    """
    k_group_index(block_k)
    B, H, _, D = x.shape
    xp = pad_tokens(x.float(), block_k)
    n_pad = xp.shape[2]
    # Key j = m*8 + g*2 + p belongs to group g: reduce over m, p and channels.
    view = xp.view(B, H, n_pad // block_k, block_k // 8, 4, 2, D)
    codes, scale = quantize_symmetric(view, (3, 5, 6), qmax)
    return codes.view(B, H, n_pad, D), scale.view(B, H, n_pad // block_k, 4)


def quantize_per_token(x: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """Per-token quantization (the Hopper kernel's Q; paper Table 6 ablation): codes [B,H,N,D],
    scale [B,H,N]."""
    codes, scale = quantize_symmetric(x, (3,), qmax)
    return codes, scale.squeeze(-1)


# (x, qk_dtype, granularity, role, block, warps) -> (codes, row scales): how
# sage_attention_reference quantizes Q and K (quantize_kernel_rows, or ablation.quantize_rows).
RowQuantizer = Callable[[Tensor, str, str, str, int, int], tuple[Tensor, Tensor]]


def quantize_kernel_rows(
    x: Tensor,
    qk_dtype: str,
    granularity: str,
    role: str,
    block: int,
    warps: int = 4,
) -> tuple[Tensor, Tensor]:
    """Quantize Q (role "q", block = block_q) or K (role "k", block = block_k) as the kernels do
    ("thread": the per-thread groups of paper Eq. 8; "token": one scale per row, the Hopper
    kernel's Q) for the simulation.

    Returns the integer codes as float64 [B,H,N,D] (padding dropped) and each token's scale as
    float64 [B,H,N], so that x ~ codes * scale[..., None] and Q K^T ~ (codes_q codes_k^T) *
    scale_q scale_k^T exactly as the dequantization of paper 2.2.
    """
    if granularity not in KERNEL_GRANULARITIES:
        raise ValueError(f"granularity must be one of {KERNEL_GRANULARITIES} (the paper's other "
                         f"granularities: sageattention2.ablation), got {granularity!r}")
    if role not in ("q", "k"):
        raise ValueError("role must be 'q' or 'k'")
    qmax = int_qmax(qk_dtype)
    n = x.shape[2]
    if granularity == "token":
        codes, rows = quantize_per_token(x, qmax)
        return codes.double(), rows.double()
    if role == "q":
        codes, scale = quantize_q_per_thread(x, block, warps, qmax)
        group_index = q_group_index(block, warps)
    else:
        codes, scale = quantize_k_per_thread(x, block, qmax)
        group_index = k_group_index(block)
    r = torch.arange(n, device=scale.device)
    rows = scale[:, :, r // block, group_index.to(scale.device)[r % block]]
    return codes[:, :, :n].double(), rows.double()


def quantize_fp8(x: Tensor, fmt: str = "e4m3") -> Tensor:
    """Round float32 values to FP8, saturating: ``fp8_*_rn_satfinite``
    (docs/DESIGN.md#quantizer-arithmetic).

    torch's conversion rounds to nearest even but gives NaN/inf above the largest finite value, so
    clamp to +-max first (the same result as the saturating hardware conversion).
    """
    dtype, fmax = _fp8_format(fmt)
    return torch.clamp(x.float(), -fmax, fmax).to(dtype)


def quantize_p_fp8(p: Tensor, fmt: str = "e4m3") -> Tensor:
    """P~ in [0, 1] with the static scale 1/fmax (paper 3.3: delta_P = 1/448 for E4M3).

    For E5M2 we use its own largest value 57344 (full range, same relative precision).
    """
    _, fmax = _fp8_format(fmt)
    return quantize_fp8(p.float() * fmax, fmt)


def quantize_v_per_channel(
    v: Tensor, v_mean: Optional[Tensor] = None, fmt: str = "e4m3"
) -> tuple[Tensor, Tensor]:
    """Per-channel FP8 quantization of V (paper 3.3), optional mean subtraction (paper A.3).

    v [B,H,N,D]; v_mean [B,H,D] float32 or None. Returns (codes fp8 [B,H,N,D],
    scale float32 [B,H,D] = max_n |V - v_mean| / fmax).
    """
    dtype, fmax = _fp8_format(fmt)
    x = v.float()
    if not _absent(v_mean):
        x = x - v_mean.float()[:, :, None, :]
    scale = _f32_div(x.abs().amax(dim=2), fmax)
    inv = torch.where(scale > 0, _f32_div(1.0, scale), torch.zeros_like(scale))
    return quantize_fp8(x * inv[:, :, None, :], fmt), scale


def quantize_v_per_tile(
    v: Tensor, v_mean: Optional[Tensor], block_k: int, fmt: str = "e4m3"
) -> tuple[Tensor, Tensor]:
    """FP8 V with one scalar scale per tile of ``block_k`` keys (issue 4 allows per-tile
    scales): no pass over all tokens is needed before V is quantized.

    v [B,H,N,D]; v_mean [B,H,D] float32 or None. Returns (codes fp8 [B,H,N,D], scale float32
    [B,H,ceil(N/block_k)] = max over the tile's keys and channels of |V - v_mean| / fmax,
    floored at V_TILE_SCALE_MIN and rounded up to a power of two, so that the codes are the FP8
    rounding of V itself and the kernel's rescales are exact).
    """
    dtype, fmax = _fp8_format(fmt)
    x = v.float()
    if not _absent(v_mean):
        x = x - v_mean.float()[:, :, None, :]
    n = x.shape[2]
    tiles = pad_tokens(x, block_k).unflatten(2, (-1, block_k))  # [B,H,T,block_k,D]
    scale = torch.clamp(_f32_div(tiles.abs().amax(dim=(3, 4)), fmax), min=V_TILE_SCALE_MIN)
    bits = scale.view(torch.int32)  # rounded up to a power of two: V * (1 / scale) is exact
    scale = torch.where(bits & 0x7FFFFF != 0, (bits & 0x7F800000) + 0x800000, bits).view(torch.float32)
    inv = _f32_div(1.0, scale)
    codes = quantize_fp8(tiles * inv[..., None, None], fmt).flatten(2, 3)[:, :, :n]
    return codes, scale


def pack_int4(x: Tensor) -> Tensor:
    """Pack int4 codes (int8 tensor, values in [-8, 7], even last dim) two per byte.

    Channel 2c goes to the low nibble and channel 2c+1 to the high nibble, both two's complement
    (docs/DESIGN.md#int4-packing; the order mma.m16n8k64.s4 reads along K). Returns int8
    [..., D/2].
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError("the last dimension must be even to pack int4")
    x = x.to(torch.int32)
    low = x[..., 0::2] & 0xF
    high = x[..., 1::2] & 0xF
    return ((high << 4) | low).to(torch.uint8).view(torch.int8)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: int8 [..., D/2] -> int8 [..., D] (sign-extended nibbles)."""
    b = packed.to(torch.int32)
    low = ((b & 0xF) ^ 0x8) - 0x8
    high = b >> 4  # arithmetic shift of the sign-extended byte: the signed high nibble
    return torch.stack((low, high), dim=-1).flatten(-2).to(torch.int8)


def v_key_permutation(n_keys: int, device: torch.device | str | None = None) -> Tensor:
    """Index of the key stored at each position of transposed V (docs/DESIGN.md#v-layout, 16-key
    pattern).

    stored[..., s] = V^T[..., perm[s]]; n_keys must be a multiple of 16.
    """
    if n_keys % 16 != 0:
        raise ValueError("the padded key count must be a multiple of 16")
    s = torch.arange(n_keys, device=device)
    order = torch.tensor(V_KEY_ORDER, device=device)
    return (s // 16) * 16 + order[s % 16]


# --------------------------------------------------------------------------------------------
# Smoothing (paper 3.1 Eq. 2, appendix A.3)
# --------------------------------------------------------------------------------------------


def _token_mean(x: Tensor, stride: int = 1) -> Tensor:
    """Mean over tokens [B,H,N,D] -> [B,H,D]: float64 sum, cast to x's float type; over the
    tokens 0, stride, 2 * stride, ... only when ``stride`` > 1 (a sampled smoothing vector): both
    as docs/DESIGN.md#smoothing says."""
    return x[:, :, ::stride].double().mean(dim=2).to(x.dtype)


def _check_mean_stride(mean_stride: int) -> None:
    if isinstance(mean_stride, bool) or not isinstance(mean_stride, int) or mean_stride < 1:
        raise ValueError(f"mean_stride must be a positive int, got {mean_stride!r}")


def _q_block_means(x: Tensor, block_q: int) -> Tensor:
    """Mean of every Q block over its valid rows: [B,H,N,D] -> [B,H,ceil(N/block_q),D] (Eq. 2)."""
    B, H, n, D = x.shape
    xp = pad_tokens(x.double(), block_q)
    n_blocks = xp.shape[2] // block_q
    sums = xp.view(B, H, n_blocks, block_q, D).sum(dim=3)
    counts = (n - torch.arange(n_blocks, device=x.device) * block_q).clamp(max=block_q)
    return (sums / counts.double()[:, None]).to(x.dtype)


class SmoothedQK(NamedTuple):
    """Q and K after smoothing (paper Eq. 2) plus what is needed to restore Q K^T.

    q K^T = gamma_q gamma_k^T + Delta-S + b with Delta-S_ij = q_offset[g(i)] . gamma_k_j and the
    row bias b_i = q_i . k_mean, which softmax ignores (paper 3.1).
    """

    gamma_q: Tensor  # [B,Hq,Nq,D] Q minus its offset
    gamma_k: Tensor  # [B,Hkv,Nk,D] K minus the token mean
    q_offset: Tensor  # [B,Hq,G,D] vectors subtracted from Q: G = 1 ("head") or #blocks ("block")
    q_offset_index: Tensor  # [Nq] long: offset row used by each query
    k_mean: Tensor  # [B,Hkv,D] (zeros when K is not smoothed)


def smooth_qk(
    q: Tensor,
    k: Tensor,
    *,
    smooth_q: Optional[str] = None,
    smooth_k: bool = True,
    block_q: int = 128,
    mean_stride: int = 1,
) -> SmoothedQK:
    """Smooth Q and K (paper 3.1): gamma(K) = K - mean(K); gamma(Q) = Q - mean per block or head.

    Works in float64 for float64 inputs, else in float32 with means summed in float64 and cast
    to float32 (docs/DESIGN.md#smoothing). ``smooth_q``: None, "block" (paper Eq. 2: each block of
    block_q queries subtracts its mean) or "head" (one mean per head; any vector subtracted from all
    queries is exact because Delta-S compensates it). ``mean_stride`` > 1: K's mean over the
    tokens 0, s, 2s, ... (the Hopper path's sampled smoothing vector; any vector subtracted from
    every key shifts each row of S by a constant).
    """
    _check_4d(q=q, k=k)
    _check_mean_stride(mean_stride)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qx, kx = q.to(dt), k.to(dt)
    B, Hq, Nq, D = qx.shape
    k_mean = _token_mean(kx, mean_stride) if smooth_k else kx.new_zeros(B, kx.shape[1], D)
    gamma_k = kx - k_mean[:, :, None, :] if smooth_k else kx
    rows = torch.arange(Nq, device=q.device)
    if smooth_q is None:
        q_offset = qx.new_zeros(B, Hq, 1, D)
        index = torch.zeros_like(rows)
        gamma_q = qx
    elif smooth_q == "head":
        q_offset = _token_mean(qx)[:, :, None, :]
        index = torch.zeros_like(rows)
        gamma_q = qx - q_offset
    elif smooth_q == "block":
        q_offset = _q_block_means(qx, block_q)
        index = rows // block_q
        gamma_q = qx - q_offset[:, :, index]
    else:
        raise ValueError(f"smooth_q must be None, 'block' or 'head', got {smooth_q!r}")
    return SmoothedQK(gamma_q, gamma_k, q_offset, index, k_mean)


def delta_s(q_offset: Tensor, gamma_k: Tensor) -> Tensor:
    """Delta-S = q_offset . gamma(K)^T in float64 (paper 3.1, the GEMV of Fig. 3 step 2).

    q_offset [B,Hq,G,D], gamma_k [B,Hkv,Nk,D] (GQA-expanded here) -> [B,Hq,G,Nk]. Computed from
    the unquantized gamma(K) and added after dequantization, which makes it exact.
    """
    gk = _expand_kv_heads(gamma_k.double(), q_offset.shape[1])
    return torch.matmul(q_offset.double(), gk.transpose(-1, -2))


# --------------------------------------------------------------------------------------------
# Op-format references (docs/DESIGN.md#ops), bit-exact with the CUDA ops
# --------------------------------------------------------------------------------------------


def smoothing_stats_reference(
    q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor], smooth_v: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``sageattention2::smoothing_stats`` -> (q_mean, k_mean, v_mean, v_scale).

    q_mean [B,Hq,D] (Q smoothing, "head" mode), k_mean [B,Hkv,D] (paper 3.1), v_mean [B,Hkv,D]
    if smooth_v (paper A.3), v_scale [B,Hkv,D] = max_n |V - v_mean| / 448 (paper 3.3), with
    v_mean = 0 without smooth_v. Means: float64 sums cast to float32. Absent: empty float32.
    """
    _check_4d(q=q, k=k, v=v)
    given = [t for t in (q, k, v) if t is not None]
    device = given[0].device if given else torch.device("cpu")
    q_mean = _token_mean(q.float()) if not _absent(q) else _empty(device)
    k_mean = _token_mean(k.float()) if not _absent(k) else _empty(device)
    v_mean, v_scale = _empty(device), _empty(device)
    if not _absent(v):
        if smooth_v:
            v_mean = _token_mean(v.float())
        _, v_scale = quantize_v_per_channel(v, v_mean if smooth_v else None, "e4m3")
    return q_mean, k_mean, v_mean, v_scale


def quantize_q_reference(
    q: Tensor,
    q_mean: Optional[Tensor],
    block_q: int,
    warps: int,
    qk_dtype: str,
    smooth_block: bool,
    scale_multiplier: float,
    *,
    block_mean: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-thread quantization of Q as the attention kernels do it inside (no op of its own since
    both kernels quantize Q themselves) -> (q_quant, q_scale, q_block_mean).

    q [B,Hq,Nq,D] any strides. Subtracts q_mean [B,Hq,D] if given ("head" mode), else, if
    smooth_block, each block's own mean over its valid rows ("block" mode, paper Eq. 2), then
    quantizes per thread (paper Eq. 8). Returns

    * q_quant int8 [B,Hq,Nq_pad,D] (int4: [B,Hq,Nq_pad,D/2] packed), padding rows 0;
    * q_scale float32 [B,Hq,Nq_pad/block_q,warps*8] = scale * scale_multiplier;
    * q_block_mean float32 [B,Hq,Nq_pad/block_q,D] = block mean * scale_multiplier in "block"
      mode, else empty.

    scale_multiplier (sm_scale * log2(e), folded for exp2) is rounded to float32 once and
    multiplied in float32, as a kernel taking it as a float does. ``block_mean`` (keyword only,
    not part of the op) replaces the computed block means [B,Hq,Nq_pad/block_q,D] (unscaled),
    so a test can feed a kernel's own means.
    """
    _check_4d(q=q)
    qmax = int_qmax(qk_dtype)
    device = q.device
    mult = torch.tensor(scale_multiplier, dtype=torch.float32, device=device)
    x = q.float()
    block_mean_out = _empty(device)
    if not _absent(q_mean):
        x = x - q_mean.float()[:, :, None, :]
    elif smooth_block:
        means = _q_block_means(x, block_q) if block_mean is None else block_mean.float()
        rows = torch.arange(x.shape[2], device=device)
        x = x - means[:, :, rows // block_q]
        block_mean_out = (means * mult).contiguous()
    codes, scale = quantize_q_per_thread(x, block_q, warps, qmax)
    if qk_dtype == "int4":
        codes = pack_int4(codes)
    return codes.contiguous(), (scale * mult).contiguous(), block_mean_out


def quantize_kv_reference(
    k: Tensor,
    v: Optional[Tensor],
    k_mean: Optional[Tensor],
    v_mean: Optional[Tensor],
    v_scale: Optional[Tensor],
    q_mean: Optional[Tensor],
    block_k: int,
    qk_dtype: str,
    delta_s_multiplier: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of ``sageattention2::quantize_kv`` -> (k_quant, k_scale, v_fp8, delta_s,
    v_tile_scale).

    * k_quant int8 [B,Hkv,Nk_pad,D] (int4: D/2 packed) of K - k_mean (paper 3.1), per-thread
      groups (paper Eq. 8); k_scale float32 [B,Hkv,Nk_pad/block_k,4].
    * v_fp8 float8_e4m3fn [B,Hkv,D,Nk_pad] if v is given: e4m3((V - v_mean) * (1 / scale)),
      transposed, zero-padded, keys permuted within 16 (V_KEY_ORDER). With v_scale [B,Hkv,D]
      the scale is per channel (paper 3.3); without, one per tile of block_k keys
      (:func:`quantize_v_per_tile`), returned as v_tile_scale float32 [B,Hkv,Nk_pad/block_k].
    * delta_s float32 [B,Hq,Nk_pad] if q_mean [B,Hq,D] is given: delta_s_multiplier *
      q_mean[hq] . (K_j - k_mean) (paper 3.1, "head" mode), float64 dot and product cast once,
      0 for padding keys; q head hq uses kv head hq // (Hq/Hkv).
    Absent outputs are empty float32.
    """
    _check_4d(k=k, v=v)
    qmax = int_qmax(qk_dtype)
    if block_k % 16 != 0:
        raise ValueError("block_k must be a multiple of 16 (V key permutation)")
    device = k.device
    B, Hkv, Nk, D = k.shape
    gamma_k = k.float()
    if not _absent(k_mean):
        gamma_k = gamma_k - k_mean.float()[:, :, None, :]
    k_codes, k_scale = quantize_k_per_thread(gamma_k, block_k, qmax)
    if qk_dtype == "int4":
        k_codes = pack_int4(k_codes)
    n_pad = k_codes.shape[2]

    v_fp8, v_tile_scale = _empty(device), _empty(device)
    if not _absent(v):
        x = v.float()
        if not _absent(v_mean):
            x = x - v_mean.float()[:, :, None, :]
        if _absent(v_scale):
            _, v_tile_scale = quantize_v_per_tile(v, v_mean, block_k, "e4m3")
            inv = _f32_div(1.0, v_tile_scale).repeat_interleave(block_k, dim=2)[:, :, : x.shape[2], None]
        else:
            scale = v_scale.float()
            inv = torch.where(scale > 0, _f32_div(1.0, scale), torch.zeros_like(scale))[:, :, None, :]
        scaled = pad_tokens(x * inv, block_k)  # float32, padding keys 0
        stored = scaled.transpose(-1, -2)[..., v_key_permutation(n_pad, device)]
        v_fp8 = quantize_fp8(stored, "e4m3").contiguous()

    ds = _empty(device)
    if not _absent(q_mean):
        dot = delta_s(q_mean.float()[:, :, None, :], gamma_k)[:, :, 0]  # [B,Hq,Nk] float64
        ds = torch.nn.functional.pad((dot * float(delta_s_multiplier)).float(), (0, n_pad - Nk))
        ds = ds.contiguous()
    return k_codes.contiguous(), k_scale.contiguous(), v_fp8, ds, v_tile_scale.contiguous()


# --------------------------------------------------------------------------------------------
# FP22 accumulator of the FP8 mma (paper 3.4)
# --------------------------------------------------------------------------------------------


def fp22_truncate(x: Tensor) -> Tensor:
    """Keep 13 mantissa bits, truncating toward zero (paper 3.4: the f32.e4m3.e4m3.f32 mma
    accumulator is FP22, 1 sign, 8 exponent, 13 mantissa bits; more bits are zeroed).

    float32 input: zero the 10 low mantissa bits. float64 input (an exact sum that has not been
    rounded to float32 yet): zero the 39 low mantissa bits, the same truncation applied to the
    exact value; the result is exactly representable in float32.
    """
    if x.dtype == torch.float32:
        return (x.view(torch.int32) & ~((1 << 10) - 1)).view(torch.float32)
    if x.dtype == torch.float64:
        return (x.view(torch.int64) & ~((1 << 39) - 1)).view(torch.float64)
    raise TypeError(f"fp22_truncate expects float32 or float64, got {x.dtype}")


# --------------------------------------------------------------------------------------------
# The quantized forward (paper Algorithm 1)
# --------------------------------------------------------------------------------------------


def _quantize_p(p: Tensor, pv_dtype: str) -> Tensor:
    """P~ as the PV mma sees it, as float64 values (paper 3.3); P8 = fp8(P~ * fmax)."""
    if pv_dtype in FP8_FORMATS:
        return quantize_p_fp8(p, pv_dtype).double()
    if pv_dtype == "fp16":
        return p.half().double()
    if pv_dtype == "bf16":
        return p.bfloat16().double()
    return p.float().double()


def sage_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    qk_dtype: str = "int8",
    granularity: str = "thread",
    q_granularity: Optional[str] = None,
    row_quantizer: Optional[RowQuantizer] = None,
    block_q: int = 128,
    warps: int = 4,
    block_k: int = 64,
    smooth_k: bool = True,
    smooth_q: Optional[str] = None,
    smooth_v: bool = False,
    pv_dtype: str = "e4m3",
    two_level: bool = True,
    fp22: bool = True,
    row_sum: str = "p",
    v_granularity: str = "channel",
    mean_stride: int = 1,
    softmax_block: Optional[int] = None,
    lazy_rescale: Optional[float] = None,
    rescale_rows: int = 32,
    integer_max: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Simulate SageAttention2's forward (paper Algorithm 1) on [B,H,N,D] inputs.

    q [B,Hq,Nq,D], k/v [B,Hkv,Nk,D] (GQA: Hq a multiple of Hkv). Returns float32 [B,Hq,Nq,D]
    (and the natural-log LSE [B,Hq,Nq] of the true scaled scores, i.e. with the row bias
    q_i . k_mean that smoothing drops added back, when ``return_lse``).

    * qk_dtype "int8" / "int4": Q, K quantized at ``granularity`` ("thread": paper Eq. 8 with
      block_q, warps, block_k); "fp16": no quantization of Q, K (the smoothed float32 values are
      used). ``q_granularity``, when given, is Q's instead (the Hopper kernel: "token", one
      scale per query row, with K per thread). ``row_quantizer`` replaces the kernels'
      quantizer, :func:`quantize_kernel_rows` (``ablation.sage_attention_ablation`` passes the
      paper's other granularities this way).
    * smooth_k, smooth_q (None / "block" / "head"), smooth_v: paper 3.1 and A.3.
    * pv_dtype: "e4m3" (paper 3.3), "e5m2" (Table 7), "fp16" / "bf16" (P~ and V rounded to that
      type, FP32 accumulation: the PV of the warp-level kernels, docs/DESIGN.md#attention-mma),
      "fp32" (P~ and V unquantized).
    * fp22: the FP8 mma accumulator keeps 13 mantissa bits, truncated after every k-step of 32
      keys (paper 3.4); only for the FP8 pv_dtypes. two_level: a fresh accumulator per KV tile
      folded into an FP32 buffer (paper 3.4); else the FP32 output itself is the mma accumulator.
    * row_sum: the softmax denominator l sums "p", the P~ of the softmax (unrounded), or "pv",
      the P8 the PV mma multiplies, summed by that mma (a column of ones next to V's channels,
      accumulated like the output: the Hopper kernel); "pv" needs an FP8 pv_dtype.
    * v_granularity (FP8 pv_dtypes): "channel", one V scale per channel over all tokens (paper
      3.3, the warp-level kernels), or "tile", one scalar per block_k-key tile (the Hopper
      kernel, issue 4): its R = P8 V8 is in units of the tile's scale, and O is kept in units of
      the current tile's, rescaled at each fold by alpha * s_prev / s_tile (as the kernel does).
    * mean_stride: K's and (smooth_v) V's means over the tokens 0, s, 2s, ... only (the Hopper
      path's sampled smoothing vectors, ``api.smoothing_sample_stride``); 1: all tokens.
    * softmax_block: the keys of one online-softmax step (a divisor of block_k; default
      block_k, which v_granularity "tile" requires): K is still quantized in block_k groups.
    * lazy_rescale: the running max m of a row moves (and O, l are rescaled) only when a tile's
      max passes m by more than 2^lazy_rescale, tested in base 2, for some row of its group of
      ``rescale_rows`` consecutive queries (a warp's rows); else P~ = exp(S - m) with the old
      m, up to 2^lazy_rescale (attention_mma's FP16/BF16 PV). None: m is the exact running max.
    * integer_max (with lazy_rescale): a running max that moves is rounded up to an integer in
      base 2, so that the kernel's exponent is one exact FFMA (attention_mma's FP16/BF16 PV at
      head_dim 64 without Q smoothing: kFoldedExponent).
    * Causal masking and tails follow SDPA (top-left aligned, see :func:`exact_attention`).

    Numerics: Q K^T of the integer codes is exact (float64), dequantized and corrected with
    Delta-S in float64; the online softmax runs in float64; each mma k-step of P V is an exact
    float64 sum rounded like the accumulator (FP22 truncation or float32 RNE); the outer
    buffer is float32.
    """
    _check_4d(q=q, k=k, v=v)
    if qk_dtype not in (*INT_QMAX, "fp16"):
        raise ValueError(f"qk_dtype must be 'int8', 'int4' or 'fp16', got {qk_dtype!r}")
    if row_quantizer is None:  # the kernels' granularities (a row_quantizer checks its own)
        if granularity != "thread":
            raise ValueError(f"granularity must be 'thread' (the kernels' K; the paper's other "
                             f"granularities: sageattention2.ablation), got {granularity!r}")
        if q_granularity is not None and q_granularity not in KERNEL_GRANULARITIES:
            raise ValueError(f"q_granularity must be None or one of {KERNEL_GRANULARITIES}, got "
                             f"{q_granularity!r}")
    if pv_dtype not in (*FP8_FORMATS, "fp16", "bf16", "fp32"):
        raise ValueError(
            f"pv_dtype must be 'e4m3', 'e5m2', 'fp16', 'bf16' or 'fp32', got {pv_dtype!r}"
        )
    if row_sum not in ("p", "pv") or (row_sum == "pv" and pv_dtype not in FP8_FORMATS):
        raise ValueError(f"row_sum must be 'p' or (with an FP8 pv_dtype) 'pv', got {row_sum!r}")
    if block_k % PV_MMA_K != 0:
        raise ValueError(f"block_k must be a multiple of {PV_MMA_K} (FP8 mma k-step)")
    if v_granularity not in ("channel", "tile") or (v_granularity == "tile" and pv_dtype not in FP8_FORMATS):
        raise ValueError(f"v_granularity must be 'channel' or (with an FP8 pv_dtype) 'tile', got {v_granularity!r}")
    step_k = block_k if softmax_block is None else softmax_block
    if step_k <= 0 or block_k % step_k != 0 or step_k % PV_MMA_K != 0 or (
            v_granularity == "tile" and step_k != block_k):
        raise ValueError(f"softmax_block must divide block_k={block_k} in multiples of {PV_MMA_K} "
                         f"(and equal it with v_granularity='tile'), got {softmax_block!r}")
    if lazy_rescale is not None and (lazy_rescale < 0 or pv_dtype in FP8_FORMATS):
        raise ValueError(f"lazy_rescale must be None or >= 0 with a non-FP8 pv_dtype, got {lazy_rescale!r}")
    if rescale_rows <= 0:
        raise ValueError(f"rescale_rows must be positive, got {rescale_rows}")
    if integer_max and lazy_rescale is None:
        raise ValueError("integer_max needs lazy_rescale")
    q_group_index(block_q, warps)  # validates block_q / warps
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if Hq % Hkv != 0:
        raise ValueError("q heads must be a multiple of kv heads")
    device = q.device
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    # Step 1, paper 3.1 / Fig. 3: smooth Q and K (float32, means from float64 sums).
    sm = smooth_qk(q.float(), k.float(), smooth_q=smooth_q, smooth_k=smooth_k, block_q=block_q,
                   mean_stride=mean_stride)

    # Step 3, paper 3.2: quantize gamma(Q), gamma(K); S = (codes_q codes_k^T) * dq dk.
    if qk_dtype == "fp16":
        ones = dict(dtype=torch.float64, device=device)
        q_codes, q_rows = sm.gamma_q.double(), torch.ones(1, 1, Nq, **ones)
        k_codes, k_rows = sm.gamma_k.double(), torch.ones(1, 1, Nk, **ones)
    else:
        quantize = quantize_kernel_rows if row_quantizer is None else row_quantizer
        q_codes, q_rows = quantize(sm.gamma_q, qk_dtype, q_granularity or granularity, "q", block_q, warps)
        k_codes, k_rows = quantize(sm.gamma_k, qk_dtype, granularity, "k", block_k, warps)
    # Fold each key's scale into its codes: code * scale is exact in float64 (8 + 24 bits) and so
    # is every partial sum of a row (|integer dot| < 2^22 times a 24-bit scale), so
    # q_codes @ (k_codes * dk)^T * (dq * sm_scale) is the exact integer product, dequantized.
    k_scaled = _expand_kv_heads(k_codes * k_rows.expand(B, Hkv, Nk)[..., None], Hq)
    q_factor = (q_rows.expand(B, Hq, Nq) * sm_scale)[..., None]  # [B,Hq,Nq,1]

    # Paper 3.3 / A.3: V per channel to FP8 (optionally minus its mean), or kept as is.
    v_mean = _token_mean(v.float(), mean_stride) if smooth_v else v.new_zeros(B, Hkv, v.shape[-1]).float()
    tile_scale = None
    if pv_dtype in FP8_FORMATS and v_granularity == "tile":
        v8, tile_scale = quantize_v_per_tile(v, v_mean, block_k, pv_dtype)
        v_vals = v8.double()
        out_scale = torch.full_like(v_mean, 1.0 / FP8_FORMATS[pv_dtype][1], dtype=torch.float64)
    elif pv_dtype in FP8_FORMATS:
        v8, v_scale = quantize_v_per_channel(v, v_mean, pv_dtype)
        v_vals = v8.double()
        # Alg. 1 last line: O = O / l / fmax * delta_V (undo the P and V scales).
        out_scale = v_scale.double() / FP8_FORMATS[pv_dtype][1]
    else:
        v_centered = v.float() - v_mean[:, :, None, :]
        if pv_dtype == "fp16":
            v_centered = v_centered.half()
        elif pv_dtype == "bf16":
            v_centered = v_centered.bfloat16()
        v_vals = v_centered.double()
        out_scale = torch.ones_like(v_mean, dtype=torch.float64)
    v_vals = _expand_kv_heads(v_vals, Hq)
    out_scale = _expand_kv_heads(out_scale[:, :, None, :], Hq)
    v_mean_q = _expand_kv_heads(v_mean[:, :, None, :].double(), Hq)
    truncate = fp22 and pv_dtype in FP8_FORMATS

    def accumulate(acc: Tensor, p8: Tensor, vals: Tensor) -> Tensor:
        """acc (float32) + P V over one tile, one mma k-step of 32 keys at a time (paper 3.4).

        The products of FP8 values and their sum over 32 keys are exact in float64; the sum
        with the accumulator is then rounded like the hardware: truncated to FP22 or RNE to
        float32. A tail tile has fewer keys: the missing ones would contribute exact zeros.
        """
        for s0 in range(0, p8.shape[-1], PV_MMA_K):
            step = torch.matmul(p8[..., s0 : s0 + PV_MMA_K], vals[..., s0 : s0 + PV_MMA_K, :])
            exact = acc.double() + step
            acc = fp22_truncate(exact).float() if truncate else exact.float()
        return acc

    # Online softmax state (paper Eq. 1): running max m, running sum l, output O (FP32).
    m = torch.full((B, Hq, Nq, 1), -math.inf, dtype=torch.float64, device=device)
    l = torch.zeros((B, Hq, Nq, 1), dtype=torch.float64, device=device)
    o = torch.zeros((B, Hq, Nq, v.shape[-1]), dtype=torch.float32, device=device)
    if tile_scale is not None:
        tile_scale = _expand_kv_heads(tile_scale[:, :, :, None, None], Hq)  # [B,Hq,tiles,1,1]
        prev_scale = tile_scale[:, :, 0]
    for j0 in range(0, Nk, step_k):
        if is_causal and j0 > Nq - 1:
            break  # SDPA causal: no query i < j0 attends this tile or any later one
        j1 = min(Nk, j0 + step_k)  # the last tile may be short (tail keys are padding)
        # Paper 3.1: S = dequant(codes_q codes_k^T) + Delta-S, times the softmax scale.
        s = torch.matmul(q_codes, k_scaled[:, :, j0:j1].transpose(-1, -2)) * q_factor
        if smooth_q is not None:
            ds = delta_s(sm.q_offset, sm.gamma_k[:, :, j0:j1]) * sm_scale  # [B,Hq,G,tile]
            s = s + (ds if ds.shape[2] == 1 else ds[:, :, sm.q_offset_index])
        if is_causal and j1 - 1 > 0:
            # Query i attends key j iff j <= i: only rows i < j1 - 1 lose keys of this tile.
            r = min(Nq, j1 - 1)
            rows = torch.arange(r, device=device)[:, None]
            cols = torch.arange(j0, j1, device=device)[None, :]
            s[:, :, :r] = s[:, :, :r].masked_fill(cols > rows, -math.inf)
        # Paper Eq. 1: m_ij = max(m_i,j-1, rowmax S_ij), P~ = exp(S - m_ij), l and O rescaled.
        # A row with no key so far keeps m = -inf; subtracting 0 then gives P~ = 0, alpha = 0.
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        if lazy_rescale is not None:
            grows = (m_new - m) / math.log(2) > lazy_rescale  # [B,Hq,Nq,1]; -inf - -inf: NaN, False
            pad = (-Nq) % rescale_rows
            grows = torch.nn.functional.pad(grows[..., 0], (0, pad)).view(B, Hq, -1, rescale_rows)
            grows = grows.any(dim=-1).repeat_interleave(rescale_rows, dim=-1)[..., :Nq, None]
            m_new = torch.where(grows, m_new, m)
            if integer_max:  # (m is already an integer in base 2 where the max does not move)
                m_new = torch.where(grows, torch.ceil(m_new / math.log(2)) * math.log(2), m_new)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        p8 = _quantize_p(p, pv_dtype)  # paper 3.3 / Alg. 1: (P~ * 448).to(e4m3)
        if row_sum == "pv":
            ones = torch.ones(*p8.shape[:-2], p8.shape[-1], 1, dtype=torch.float64, device=device)
            tile_sum = accumulate(torch.zeros_like(l, dtype=torch.float32), p8, ones)
            l = alpha * l + tile_sum.double() / FP8_FORMATS[pv_dtype][1]
        else:
            l = alpha * l + p.sum(dim=-1, keepdim=True)
        if tile_scale is not None:
            # O in units of this tile's V scale: the fold's factor alpha * s_prev / s_tile.
            s_tile = tile_scale[:, :, j0 // block_k]
            factor = alpha.float() * (prev_scale / s_tile)
            prev_scale = s_tile
        else:
            factor = alpha.float()
        if two_level:
            # Paper 3.4: R_ij = P~ V in a fresh mma accumulator, O = diag(alpha) O + R in FP32.
            r_acc = accumulate(torch.zeros_like(o), p8, v_vals[:, :, j0:j1])
            o = factor * o + r_acc
        else:
            # One level: the rescaled FP32 output is itself the mma accumulator.
            o = accumulate(factor * o, p8, v_vals[:, :, j0:j1])
        m = m_new
    if tile_scale is not None:
        out_scale = out_scale * prev_scale.double()  # the last visited tile's V scale

    # Alg. 1: O = diag(l)^-1 O / 448 * delta_V; paper A.3: + V_m.
    out = o.double() / l * out_scale + v_mean_q
    # Both kernels multiply O by (l > 0 ? 1 / l : 0): a row that saw no key (O = 0) gives 0, a row
    # that a NaN reached (O and l NaN) stays NaN.
    out = torch.where(l > 0, out, o.double() * 0).float()
    if not return_lse:
        return out
    row_bias = torch.matmul(
        q.double(), _expand_kv_heads(sm.k_mean.double()[..., None], Hq)
    )  # [B,Hq,Nq,1] = q_i . k_mean, the row bias b dropped by smoothing (paper 3.1)
    lse = (m + torch.log(l) + sm_scale * row_bias).squeeze(-1).float()
    return out, lse


# --------------------------------------------------------------------------------------------
# The Hopper kernel's algorithm
# --------------------------------------------------------------------------------------------


def hopper_kernel_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_k: int,
    mean_stride: int,
    is_causal: bool = False,
    scale: Optional[float] = None,
    smooth_k: bool = True,
    smooth_v: bool = False,
    pv: str = "fp8",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The algorithm of the Hopper kernel (attention_wgmma, docs/DESIGN.md#attention-wgmma): INT8 Q
    with one scale per query row and no Q smoothing, INT8 K per thread in ``block_k``-key blocks
    (K's mean over every ``mean_stride``-th token with ``smooth_k``); ``pv`` "fp8": P~ x448 and V
    with one power-of-two FP8 scale per tile (V's mean with ``smooth_v``), FP32 two-level
    accumulation, l summed by the PV product; "input" (the accurate tier): P and V rounded to
    v's dtype, the FP32 output the accumulator, l the sum of the unrounded P (``smooth_v``
    ignored: V is not quantized). The tests and ``python -m sageattention2 check`` emulate the
    kernel with this one definition."""
    if pv not in ("fp8", "input"):
        raise ValueError(f"pv must be 'fp8' or 'input', got {pv!r}")
    common = dict(is_causal=is_causal, scale=scale, qk_dtype="int8", granularity="thread",
                  q_granularity="token", block_k=block_k, smooth_k=smooth_k, smooth_q=None,
                  fp22=False, mean_stride=mean_stride, return_lse=return_lse)
    if pv == "input":
        return sage_attention_reference(
            q, k, v, smooth_v=False, pv_dtype="bf16" if v.dtype == torch.bfloat16 else "fp16",
            two_level=False, row_sum="p", **common)
    return sage_attention_reference(
        q, k, v, smooth_v=smooth_v, pv_dtype="e4m3", two_level=True, row_sum="pv",
        v_granularity="tile", **common)
