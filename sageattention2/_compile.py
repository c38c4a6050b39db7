""":func:`sageattn` under ``torch.compile``, and in training: one opaque graph op,
``sageattention2::sageattn``, whose implementation is the eager call (its kernel choice asks the
build and the GPU, and it checks pointers: nothing dynamo can trace), whose fake gives the shapes
after eager mode's own validation, and whose autograd formula is the exact backward from the
forward's O and LSE (``_backward``). A call that tracks grad runs the op (with ``return_lse``,
which the backward reads) where that backward serves it and the quantized kernel runs it
(:func:`training_call`); otherwise the exact fallback, differentiable as SDPA is.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from . import _backward
from ._call import AttentionCall, SmoothQ, SmoothV, smooth_v_flag, validate
from ._execute import decide, heads_inner, run
from ._plan import KERNEL_DTYPES

__all__ = ["graph_call", "tracks_grad", "training_call"]

# smooth_q's booleans as the string the graph op takes (an op argument has one type); every
# string a caller passes stays as it is and is validated as in eager mode.
_SMOOTH_Q_BOOL = {True: ":true", False: ":false"}


def _smooth_q_from_op(value: str) -> SmoothQ | str:
    return {":true": True, ":false": False}.get(value, value)


def tracks_grad(*tensors: object) -> bool:
    """Whether autograd records a call on ``tensors`` (then sageattn runs the graph op only where
    its backward serves the call: :func:`training_call`)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in tensors)


def training_call(call: AttentionCall) -> AttentionCall | None:
    """The call a call that tracks grad runs as the graph op (the quantized forward, then the
    exact backward, which serves it: ``_backward.refusal``), where ``$SAGEATTN_TRAINING`` is
    "quantized"; None where it runs the exact fallback. ``pv_quant="auto"`` becomes PV in the
    input dtype where the kernel serves that ([D51](../docs/DECISIONS.md#d51): the backward's
    ``D = rowsum(dO * O)`` carries O's error into every gradient, and FP8 PV's O error put dQ's
    CosSim at 0.991 on bias4, 16-bit PV's at 0.9991). Decided as the op will decide it, with grad
    off. Under torch.compile the routing cannot be traced (it asks the build and the GPU): the
    op serves the CUDA float16/bfloat16 calls without a mask up to head_dim 128, which the kernel
    runs (the LSE asked for: no crossover) wherever it is built for the GPU; a mask keeps the
    exact fallback there (the op's exact path would compute the LSE in float64). The training
    guard (``_backward.guard``, D52: q or k with channels too wide for INT8 QK's gradients)
    reads a number on the host, so it runs in eager calls only."""
    if (_backward.training_mode() != "quantized" or call.is_empty
            or _backward.refusal(call) is not None):
        return None
    accurate = call if call.pv_quant != "auto" else dataclasses.replace(call, pv_quant="none")
    if torch.compiler.is_compiling():
        served = (call.q.is_cuda and call.q.dtype in KERNEL_DTYPES and call.attn_mask is None
                  and call.head_dim <= 128 and call.head_dim_v == call.head_dim)
        return accurate if served else None
    with torch.no_grad():
        chosen = next((c for c in (accurate, call) if decide(c).quantized), None)
    # The training guard (D52) after the decision: only calls the kernel would run are measured.
    return None if chosen is None or _backward.guard(call) is not None else chosen


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
    # (grad off: the inputs of a training call still require grad in here, and the routing
    # would send them to the exact fallback; the op's backward is its autograd formula below)
    with torch.no_grad():
        result = run(validate(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                              tensor_layout, qk_quant, pv_quant, smooth_k,
                              _smooth_q_from_op(smooth_q), smooth_v, return_lse, strict,
                              causal_alignment))
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


def _as_bhnd(t: Tensor, tensor_layout: str) -> Tensor:
    """An op operand (``[B,] H, N, D`` or ``[B,] N, H, D``) as a ``[B, H, N, D]`` view."""
    t = t.unsqueeze(0) if t.dim() == 3 else t
    return t.transpose(1, 2) if tensor_layout == "NHD" else t


def _from_bhnd(t: Tensor, tensor_layout: str, ndim: int) -> Tensor:
    t = t.transpose(1, 2) if tensor_layout == "NHD" else t
    return t.squeeze(0) if ndim == 3 else t


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, attn_mask, _, is_causal, scale, _, tensor_layout, *_ = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # an LSE nobody used has no gradient (not zeros)
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.is_causal, ctx.scale, ctx.tensor_layout = is_causal, scale, tensor_layout


def _sageattn_backward(ctx: Any, grad_out: Tensor | None,
                       grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    none = (None,) * 14  # the op's other arguments (a mask that requires grad is refused)
    if grad_out is None and grad_lse is None:
        return (None, None, None, *none)
    if lse.numel() == 0 and q.numel():
        raise RuntimeError("sageattention2::sageattn: a backward needs the forward's LSE: call the "
                           "op with return_lse=True (sageattn does, for inputs that require grad)")
    layout, ndim = ctx.tensor_layout, q.dim()
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    lse4 = lse.unsqueeze(0) if ndim == 3 else lse
    grad_lse4 = None if grad_lse is None else (grad_lse.unsqueeze(0) if ndim == 3 else grad_lse)
    with torch.no_grad():
        grads = torch.ops.sageattention2.attention_backward(
            _as_bhnd(grad_out, layout), _as_bhnd(q, layout), _as_bhnd(k, layout),
            _as_bhnd(v, layout), _as_bhnd(out, layout), lse4, grad_lse4, attn_mask,
            ctx.is_causal, ctx.scale)
    dq, dk, dv = (_from_bhnd(g, layout, ndim) for g in grads)
    if torch.is_grad_enabled():  # create_graph=True: these gradients have no derivative here
        dq, dk, dv = _NoDoubleBackward.apply(q, dq, dk, dv)
    return (dq, dk, dv, *none)


@torch.library.custom_op("sageattention2::attention_backward", mutates_args=())
def _attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                           lse: Tensor, grad_lse: Tensor | None, attn_mask: Tensor | None,
                           is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward (``_backward.attention_backward``) as one opaque op of a compiled graph, on
    ``[B, H, N, D]`` views: dQ, dK, dV with the strides of ``empty_like`` of q, k and v (its
    fake's). Inductor, given PyTorch's backward kernels and the K-centering around them as
    separate ops, gave gradients at CosSim 0.06-0.99 to eager's (session 41): its buffers' strides
    are its own, and the kernels' outputs need not follow their meta functions'."""
    grads = _backward.attention_backward(grad_out, q, k, v, out, lse, is_causal, scale, grad_lse,
                                         attn_mask)
    return tuple(_with_strides_of(g, t) for g, t in zip(grads, (q, k, v)))  # type: ignore[return-value]


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, grad_lse: Tensor | None, attn_mask: Tensor | None,
                             is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _with_strides_of(grad: Tensor, like: Tensor) -> Tensor:
    """``grad`` with the strides of ``empty_like(like)`` (read on the meta device: no
    allocation where they already agree, the common case)."""
    if grad.stride() == torch.empty_like(like, device="meta").stride():
        return grad
    return torch.empty_like(like).copy_(grad)


class _NoDoubleBackward(torch.autograd.Function):
    """The gradients, as they are; differentiating them again raises (the backward's kernels
    and the forward's saved O and LSE have no derivative of their own)."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, *grads: Tensor) -> tuple[Tensor, ...]:
        # (``anchor``, an input that requires grad, makes the outputs require grad too)
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx: Any, *_: Tensor) -> tuple[Tensor, ...]:
        raise RuntimeError("sageattn: double backward (a gradient of its gradients, "
                           "create_graph=True) is not supported")


torch.library.register_autograd("sageattention2::sageattn", _sageattn_backward,
                                setup_context=_setup_context)
