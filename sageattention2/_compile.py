""":func:`sageattn` under ``torch.compile``: one opaque graph op, ``sageattention2::sageattn``,
whose implementation is the eager call (its kernel choice asks the build and the GPU, and it
checks pointers: nothing dynamo can trace) and whose fake gives the shapes after eager mode's own
validation. Inputs that require grad are not traced as the op (it has no backward): sageattn
traces the exact fallback for them instead.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._call import SmoothQ, SmoothV, smooth_v_flag, validate
from ._execute import heads_inner, run

__all__ = ["graph_call", "tracks_grad"]

# smooth_q's booleans as the string the graph op takes (an op argument has one type); every
# string a caller passes stays as it is and is validated as in eager mode.
_SMOOTH_Q_BOOL = {True: ":true", False: ":false"}


def _smooth_q_from_op(value: str) -> SmoothQ | str:
    return {":true": True, ":false": False}.get(value, value)


def tracks_grad(*tensors: object) -> bool:
    """Whether autograd records a call on ``tensors`` (then the graph op, which has no backward,
    cannot stand for it)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in tensors)


def graph_call(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
               is_causal: bool, scale: float | None, enable_gqa: bool, tensor_layout: str,
               qk_quant: str, pv_quant: str, smooth_k: bool, smooth_q: SmoothQ, smooth_v: SmoothV,
               return_lse: bool, strict: bool,
               causal_alignment: str = "top_left") -> Tensor | tuple[Tensor, Tensor]:
    """What torch.compile traces for a sageattn call (sageattn's arguments, unchecked): the graph
    op, with no graph break."""
    smooth_q_arg = _SMOOTH_Q_BOOL[smooth_q] if isinstance(smooth_q, bool) else smooth_q
    # (the op's schema takes smooth_v as a bool: "auto" is resolved here, by v's head_dim)
    smooth_v_arg = smooth_v_flag(smooth_v, v.shape[-1]) if isinstance(v, Tensor) and v.dim() else smooth_v
    out, lse = torch.ops.sageattention2.sageattn(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, tensor_layout, qk_quant,
        pv_quant, smooth_k, smooth_q_arg, smooth_v_arg, return_lse, strict, causal_alignment)
    return (out, lse) if return_lse else out


@torch.library.custom_op(
    "sageattention2::sageattn", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, "
           "float? scale, bool enable_gqa, str tensor_layout, str qk_quant, str pv_quant, "
           "bool smooth_k, str smooth_q, bool smooth_v, bool return_lse, bool strict, "
           "str causal_alignment) "
           "-> (Tensor, Tensor)")
def _sageattn_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                 is_causal: bool, scale: float | None, enable_gqa: bool, tensor_layout: str,
                 qk_quant: str, pv_quant: str, smooth_k: bool, smooth_q: str, smooth_v: bool,
                 return_lse: bool, strict: bool, causal_alignment: str) -> tuple[Tensor, Tensor]:
    """sageattn as one opaque op of a torch.compile graph: the eager call, returning out in
    the memory order :func:`_heads_inner` gives (as the fake implementation says) and lse,
    empty unless ``return_lse``."""
    result = run(validate(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                          tensor_layout, qk_quant, pv_quant, smooth_k, _smooth_q_from_op(smooth_q),
                          smooth_v, return_lse, strict, causal_alignment))
    out, lse = result if return_lse else (result, q.new_empty(0, dtype=torch.float32))
    assert isinstance(out, Tensor)
    if _heads_inner(q, tensor_layout):  # (a no-op where the kernel wrote it so)
        return out.transpose(-3, -2).contiguous().transpose(-3, -2), lse.contiguous()
    return out.contiguous(), lse.contiguous()


def _heads_inner(q: Tensor, tensor_layout: str) -> bool:
    """Whether the op's out is in ``[.., N, H, D]`` memory although the caller's layout is HND:
    where q's is (``_execute.heads_inner``), as the eager kernel call writes it. Otherwise out
    is contiguous in the caller's layout."""
    return tensor_layout == "HND" and heads_inner(q)


@_sageattn_op.register_fake
def _sageattn_op_fake(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                      tensor_layout: str, qk_quant: str, pv_quant: str, smooth_k: bool,
                      smooth_q: str, smooth_v: bool, return_lse: bool,
                      strict: bool, causal_alignment: str) -> tuple[Tensor, Tensor]:
    """The graph op's shapes, after the eager call's own validation (bad arguments raise while
    tracing, with eager mode's messages): out has q's shape but v's head_dim, lse is
    ``[B, Hq, Nq]`` (``[Hq, Nq]`` for 3-D inputs) float32 or empty."""
    call = validate(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, tensor_layout,
                    qk_quant, pv_quant, smooth_k, _smooth_q_from_op(smooth_q), smooth_v,
                    return_lse, strict, causal_alignment)
    if _heads_inner(q, tensor_layout):
        *lead, h, n, _ = q.shape
        out = q.new_empty((*lead, n, h, call.head_dim_v)).transpose(-3, -2)
    else:
        out = q.new_empty((*q.shape[:-1], call.head_dim_v))
    b, h_q, n_q, _ = call.q.shape
    lse_shape = (b, h_q, n_q)[4 - call.input_ndim:] if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)
