"""Training through sageattn: the quantized forward with an exact backward (issue 51, tier 1).

The forward is the quantized kernel; it keeps its output O and the natural-log LSE. The backward
is FlashAttention-2's, from those two (Dao 2023, Algorithm 2): P is recomputed from the exact q
and k and the forward's LSE, then ``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(dO * O)``,
``dS = P * (dP - D)``, ``dQ = scale dS K``, ``dK = scale dS^T Q``. These are the gradients of
exact attention at the inputs, evaluated with the forward's quantized O and LSE (the
straight-through choice: quantization has no useful derivative of its own).

Who runs it: on CUDA, PyTorch's own attention backward kernels fed with our O and LSE (cuDNN's
where it serves the head_dim, FlashAttention-2's otherwise: the issue's "try PyTorch's first");
elsewhere, and where the LSE itself receives a gradient (``return_lse=True`` callers that use
it: ``d lse_i / d S_ij = P_ij`` adds ``g_i`` to ``-D_i``), a chunked float32 version of the same
formulas. GQA: K and V are repeated over each group and the group's gradients summed.

:func:`refusal` says which calls it serves; the others run exact SDPA, differentiable, as
before (the routing table's fallback "inputs that require grad").
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ._call import AttentionCall

__all__ = ["TRAINING_ENVIRONMENT", "attention_backward", "refusal", "training_mode"]

# Opt-in until the quantized forward's gradients meet the exact bar on every input family
# (session 40: dQ's CosSim 0.99 on bias4 and 0.89 on outliers; dK and dV fine): "exact" (the
# default: inputs that require grad run exact SDPA and its backward) or "quantized" (the
# quantized forward, this backward).
TRAINING_ENVIRONMENT = "SAGEATTN_TRAINING"
TRAINING_MODES = ("exact", "quantized")

# Queries per chunk of the float32 backward: a [chunk, N_k] score block per head.
_MATH_CHUNK = 1024
# cuDNN's attention backward in PyTorch serves head_dim up to 128 on sm_90; FlashAttention-2's
# up to 256.
_CUDNN_MAX_HEAD_DIM = 128


def training_mode() -> str:
    """``$SAGEATTN_TRAINING``: how sageattn runs calls whose inputs require grad."""
    mode = os.environ.get(TRAINING_ENVIRONMENT, "exact").strip().lower() or "exact"
    if mode not in TRAINING_MODES:
        raise ValueError(f"{TRAINING_ENVIRONMENT} must be one of {', '.join(TRAINING_MODES)}, "
                         f"got {os.environ[TRAINING_ENVIRONMENT]!r}")
    return mode


def refusal(call: AttentionCall) -> str | None:
    """Why the exact backward does not serve ``call`` (None where it does)."""
    if call.attn_mask is not None:
        return "an attn_mask (the backward takes no mask yet)"
    if call.dropout_p > 0:
        return "dropout_p > 0"
    if call.is_causal and call.q.shape[2] != call.k.shape[2]:
        return "is_causal with query and key lengths that differ"
    if call.head_dim_v != call.head_dim:
        return "v's head_dim differs from q's and k's"
    return None


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_groups(grad: Tensor, heads: int) -> Tensor:
    b, h, n, d = grad.shape
    return grad if h == heads else grad.view(b, heads, h // heads, n, d).sum(2)


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, is_causal: bool, scale: float | None,
                       grad_lse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV (in the inputs' dtypes) of attention ``softmax(scale q k^T) v`` at ``q, k, v``
    ``[B, H, N, D]`` (K and V may have fewer heads: GQA), from its output ``out`` ``[B, Hq, Nq,
    D]``, float32 ``lse`` ``[B, Hq, Nq]`` and the gradients of both. ``is_causal``: query i sees
    keys up to i (as many queries as keys)."""
    heads_kv = k.shape[1]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # K smoothing, as the forward does it (the paper's Sec. 3.2): softmax is invariant to a shift
    # of each score row, so the backward runs on K minus its mean over tokens with the LSE
    # shifted by scale * q . mean. P and dS are the same; dQ = scale dS (K - mean) drops
    # scale rowsum(dS) mean, zero in exact arithmetic but not with the forward's quantized O and
    # LSE: with K's channel offsets (the bias4 and outliers families) it took dQ's CosSim to 0.78
    # (session 40's first GPU run).
    # (The LSE itself is not shift-invariant: a gradient g on it adds scale g mean to dQ.)
    mean = _repeat_heads(k.float().mean(dim=2, keepdim=True), q.shape[1])
    k = (k.float() - mean[:, ::q.shape[1] // heads_kv]).to(k.dtype)
    lse = lse.float() - scale * (q.float() @ mean.transpose(-1, -2)).squeeze(-1)
    k_all, v_all = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
    if (grad_lse is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] <= 256):
        dq, dk, dv = _pytorch_kernels(grad_out, q, k_all, v_all, out, lse, is_causal, scale)
    else:
        dq, dk, dv = _chunked(grad_out, q, k_all, v_all, out, lse, is_causal, scale, grad_lse)
    if grad_lse is not None:
        dq = (dq.float() + scale * grad_lse.float()[..., None] * mean).to(q.dtype)
    return dq, _sum_groups(dk, heads_kv), _sum_groups(dv, heads_kv)


def _pytorch_kernels(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch's cuDNN or FlashAttention-2 backward kernel on our O and LSE. Both read the
    operands with the last dimension contiguous, and dO in O's memory order."""
    q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, out))
    grad_out = torch.empty_like(out).copy_(grad_out)  # O's strides
    n_q, n_k = q.shape[2], k.shape[2]
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # dropout's RNG state: none
    lse = lse.float().contiguous()
    if q.shape[-1] <= _CUDNN_MAX_HEAD_DIM and torch.backends.cuda.cudnn_sdp_enabled():
        # (None stands for the undefined attn_bias and sequence offsets: no mask, no varlen)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1), unused, unused, None, None, None, n_q, n_k,
            0.0, is_causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, n_q, n_k, 0.0, is_causal, unused, unused,
        scale=scale)


def _chunked(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             is_causal: bool, scale: float,
             grad_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's formulas in float32 (float64 for float64 inputs), a chunk of queries at a
    time."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qw, kw, vw, dow = (t.to(work) for t in (q, k, v, grad_out))
    delta = (dow * out.to(work)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(work)
    lse = lse.to(work)
    dq = torch.empty_like(qw)
    dk, dv = torch.zeros_like(kw), torch.zeros_like(vw)
    n_q, n_k = q.shape[2], k.shape[2]
    for start in range(0, n_q, _MATH_CHUNK):
        rows = slice(start, min(start + _MATH_CHUNK, n_q))
        scores = qw[:, :, rows] @ kw.transpose(-1, -2) * scale
        if is_causal:
            query = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(n_k, device=q.device) > query, -torch.inf)
        p = torch.exp(scores - lse[:, :, rows, None])
        dv += p.transpose(-1, -2) @ dow[:, :, rows]
        ds = p * (dow[:, :, rows] @ vw.transpose(-1, -2) - delta[:, :, rows, None])
        dq[:, :, rows] = ds @ kw * scale
        dk += ds.transpose(-1, -2) @ qw[:, :, rows] * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
