"""The validated :func:`sageattn` call: :func:`validate` checks every argument once and returns an
:class:`AttentionCall`, with q/k/v as canonical ``[B, H, N, D]`` views (no copies) and the
options resolved. Everything after it (the kernel plan, the execution, the graph op's fake) reads
the call, never the raw arguments.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal, Union, cast

import torch
from torch import Tensor

from . import ops

__all__ = [
    "PV_QUANTS",
    "QK_QUANTS",
    "SMOOTH_Q_MODES",
    "SMOOTH_V_AUTO_ABOVE",
    "TENSOR_LAYOUTS",
    "AttentionCall",
    "CAUSAL_ALIGNMENTS",
    "CausalAlignment",
    "PVQuant",
    "QKQuant",
    "SmoothQ",
    "SmoothV",
    "TensorLayout",
    "smooth_v_flag",
    "validate",
]

TensorLayout = Literal["HND", "NHD"]
QKQuant = Literal["auto", "int8", "int4"]
PVQuant = Literal["auto", "fp8", "none"]
SmoothQ = Union[bool, Literal["auto", "head", "block"]]
SmoothV = Union[bool, Literal["auto"]]
CausalAlignment = Literal["top_left", "bottom_right"]

TENSOR_LAYOUTS: tuple[str, ...] = ("HND", "NHD")
QK_QUANTS: tuple[str, ...] = ("auto", *ops.QK_DTYPES)
PV_QUANTS: tuple[str, ...] = ("auto", "fp8", "none")
SMOOTH_Q_MODES: tuple[str, ...] = ("auto", "head", "block")
CAUSAL_ALIGNMENTS: tuple[str, ...] = ("top_left", "bottom_right")

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """A validated :func:`sageattn` call: canonical views and the resolved plan.

    ``q``, ``k``, ``v`` are ``[B, H, N, D]`` views of the inputs (a 3-D input gets B = 1, an NHD
    input is permuted); ``attn_mask`` is as given (it broadcasts against ``[B, Hq, Nq, Nk]``).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    tensor_layout: TensorLayout
    input_ndim: int
    qk_quant: Literal["int8", "int4"]
    qk_quant_auto: bool  # "auto" was asked: exact SDPA serves it where faster (_crossover)
    pv_quant: PVQuant
    smooth_q: Literal["auto", "head", "block", "none"]
    smooth_k: bool
    smooth_v: bool
    return_lse: bool
    strict: bool
    # FlashAttention's causal rule, query i sees keys j <= i + N_kv - N_q (only where is_causal
    # and N_q != N_kv: elsewhere it is SDPA's top-left rule).
    bottom_right: bool = False

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[-1]

    @property
    def is_empty(self) -> bool:
        """No output elements, or no keys (each query then attends to nothing: output 0)."""
        b, h, n_q, _ = self.q.shape
        return b * h * n_q * self.head_dim_v == 0 or self.k.shape[2] == 0

    def input_rank(self, t: Tensor) -> Tensor:
        """Drop the batch dimension that a 3-D input was given (a view)."""
        return t.squeeze(0) if self.input_ndim == 3 else t

    def result(self, out: Tensor, lse: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
        """What sageattn returns, from out ``[B, H, Nq, Dv]`` and float32 lse ``[B, H, Nq]``: out
        as a view in the layout and rank of the inputs, lse in their rank."""
        if self.tensor_layout == "NHD":
            out = out.transpose(1, 2)
        out = self.input_rank(out)
        if not self.return_lse:
            return out
        assert lse is not None
        return out, self.input_rank(lse)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


# smooth_v="auto" is on above this head_dim: there only the Hopper kernel's FP8 tier runs (padded
# to 256), whose one FP8 scale per V tile spans 256 channels, and V's channel offsets cost
# accuracy (bias4 CosSim 0.99987 without, 0.99999 with) for 0.3-1.6 % of the call
# (docs/DECISIONS.md#d42). At 128 and below the scale spans few enough channels: off.
SMOOTH_V_AUTO_ABOVE = 128


def smooth_v_flag(value: object, head_dim: int) -> bool:
    """Resolve smooth_v: True, False, or "auto" (on above SMOOTH_V_AUTO_ABOVE channels)."""
    if isinstance(value, bool):
        return value
    if value == "auto":
        return head_dim > SMOOTH_V_AUTO_ABOVE
    raise ValueError(f"smooth_v must be True, False or 'auto'; got {value!r}")


def _smooth_q_mode(value: object) -> Literal["auto", "head", "block", "none"]:
    """Resolve smooth_q: False -> "none"; True -> "head"; "auto"/"head"/"block" as named ("auto"
    is the kernel's choice: none for INT8 QK, "head" for INT4 QK; ``_plan.smooths_q``)."""
    if isinstance(value, bool):
        return "head" if value else "none"
    if isinstance(value, str) and value in SMOOTH_Q_MODES:
        return cast(Literal["auto", "head", "block"], value)
    raise ValueError(f"smooth_q must be True, False, 'auto', 'head' or 'block'; got {value!r}")


def _to_bhnd(t: Tensor, layout: str) -> Tensor:
    if t.dim() == 3:
        t = t.unsqueeze(0)
    return t.transpose(1, 2) if layout == "NHD" else t


def validate(
    q: object,
    k: object,
    v: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
    tensor_layout: object,
    qk_quant: object,
    pv_quant: object,
    smooth_k: object,
    smooth_q: object,
    smooth_v: object,
    return_lse: object,
    strict: object,
    causal_alignment: object = "top_left",
) -> AttentionCall:
    """Check every argument of :func:`sageattn` (same names, same order) and build the
    :class:`AttentionCall`; bad arguments raise ``TypeError``/``ValueError`` naming them."""
    layout = cast(TensorLayout, _choice("tensor_layout", tensor_layout, TENSOR_LAYOUTS))
    qk = _choice("qk_quant", qk_quant, QK_QUANTS)
    pv = cast(PVQuant, _choice("pv_quant", pv_quant, PV_QUANTS))
    smooth_q_mode = _smooth_q_mode(smooth_q)
    p = _real("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if scale is not None:
        scale = _real("scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite or None, got {scale}")
    causal = _flag("is_causal", is_causal)
    alignment = _choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)
    gqa = _flag("enable_gqa", enable_gqa)

    names = {"HND": "[B, H, N, D] or [H, N, D]", "NHD": "[B, N, H, D] or [N, H, D]"}[layout]
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _INPUT_DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
            )
        if t.dim() not in (3, 4):
            raise ValueError(
                f"{name} must be 3-D or 4-D ({names} for tensor_layout={layout!r}), "
                f"got shape {tuple(t.shape)}"
            )
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    for name, t in (("key", k), ("value", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but query has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but query is on {q.device}; they must match")
        if t.dim() != q.dim():
            raise ValueError(f"{name} is {t.dim()}-D but query is {q.dim()}-D; they must match")

    qc, kc, vc = (_to_bhnd(t, layout) for t in (q, k, v))
    b, h_q, n_q, d = qc.shape
    _, h_kv, n_kv, d_k = kc.shape
    if kc.shape[0] != b or vc.shape[0] != b:
        raise ValueError(
            f"query, key and value must have the same batch size, got {b}, {kc.shape[0]}, {vc.shape[0]}"
        )
    if vc.shape[1] != h_kv:
        raise ValueError(f"key and value must have the same number of heads, got {h_kv} and "
                         f"{vc.shape[1]}")
    if vc.shape[2] != n_kv:
        raise ValueError(f"key and value must have the same sequence length, got {n_kv} and "
                         f"{vc.shape[2]}")
    if d_k != d:
        raise ValueError(f"query and key must have the same head_dim, got {d} and {d_k}")
    if h_q != h_kv:
        if not gqa:
            raise ValueError(
                f"query has {h_q} heads but key and value have {h_kv}; pass enable_gqa=True for "
                "grouped-query attention"
            )
        if h_kv == 0 or h_q % h_kv != 0:
            raise ValueError(
                f"enable_gqa=True needs query's number of heads ({h_q}) to be a multiple of "
                f"key's and value's ({h_kv})"
            )

    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got "
                            f"{type(attn_mask).__name__}")
        if causal:
            raise ValueError("attn_mask and is_causal=True are mutually exclusive")
        if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
            raise TypeError(f"attn_mask must be bool, float32 or query's dtype ({q.dtype}), got "
                            f"{attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {q.device}")
        target = (b, h_q, n_q, n_kv)[4 - q.dim():]
        if attn_mask.dim() > len(target) or any(
            m not in (1, t) for m, t in zip(reversed(attn_mask.shape), reversed(target))
        ):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention "
                f"shape {target} ([..., H_q, N_q, N_kv], whatever the tensor_layout)"
            )

    return AttentionCall(
        q=qc, k=kc, v=vc, attn_mask=attn_mask, dropout_p=p, is_causal=causal, scale=scale,
        enable_gqa=gqa, tensor_layout=layout, input_ndim=q.dim(),
        qk_quant=cast(Literal["int8", "int4"], "int8" if qk == "auto" else qk),
        qk_quant_auto=qk == "auto", pv_quant=pv,
        smooth_q=smooth_q_mode, smooth_k=_flag("smooth_k", smooth_k),
        smooth_v=smooth_v_flag(smooth_v, vc.shape[-1]), return_lse=_flag("return_lse", return_lse),
        strict=_flag("strict", strict),
        bottom_right=causal and alignment == "bottom_right" and n_q != n_kv,
    )
