"""Running a validated call (:func:`run`): the quantized kernel that :func:`._plan.route` picks,
with each kernel's preprocessing in one op (docs/DESIGN.md), or exact
``F.scaled_dot_product_attention`` with a :class:`SageAttentionFallbackWarning` (or an error with
``strict=True``) when the route says the kernels cannot serve the call.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from . import _plan, ops
from ._call import AttentionCall
from ._plan import KernelChoice

__all__ = [
    "SMOOTHING_SAMPLE_TOKENS",
    "SageAttentionFallbackWarning",
    "empty",
    "exact",
    "quantized",
    "run",
    "smoothing_sample_stride",
]

# K's smoothing vector (and, on the Hopper path, V's with smooth_v) is a mean over at most this
# many tokens, a strided sample (smoothing_sample_stride): any vector subtracted from every key
# shifts each row of S by a constant (and V's mean is added back), so only the quantization error
# can change; the statistics launch then reads ~1/16 of K at 4K instead of all of it.
SMOOTHING_SAMPLE_TOKENS = 256

# The builtin that F.scaled_dot_product_attention names. Bound here so that the fallback still
# reaches the exact kernel while F.scaled_dot_product_attention is patched to sageattn.
_exact_sdpa = torch._C._nn.scaled_dot_product_attention


class SageAttentionFallbackWarning(UserWarning):
    """sageattn computed a call with exact ``F.scaled_dot_product_attention``."""


# Public as sageattention2.api.SageAttentionFallbackWarning (warning filters name it so).
SageAttentionFallbackWarning.__module__ = "sageattention2.api"

_warned_reasons: set[str] = set()


def _warn_fallback_once(reason: str) -> None:
    if reason in _warned_reasons:
        return
    _warned_reasons.add(reason)
    warnings.warn(
        f"sageattn is computing exact F.scaled_dot_product_attention instead of quantized "
        f"attention: {reason}. This warning is shown once per reason; pass strict=True to raise.",
        SageAttentionFallbackWarning,
        stacklevel=4,  # the caller of sageattn (which called run, which called this)
    )


def run(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """What sageattn returns for ``call`` in eager mode."""
    if call.is_empty:
        return empty(call)
    choice, reason = _plan.route(call)
    if reason is None:
        return quantized(call, choice)
    if call.strict:
        raise NotImplementedError(
            f"sageattn(strict=True): the quantized kernels cannot serve this call: {reason}"
        )
    _warn_fallback_once(reason)
    return exact(call)


def empty(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """No output elements or no keys: zeros (what SDPA gives on CPU), lse -inf; nothing runs."""
    b, h, n_q, _ = call.q.shape
    out = call.q.new_zeros((b, h, n_q, call.head_dim_v))
    lse = call.q.new_full((b, h, n_q), -math.inf, dtype=torch.float32) if call.return_lse else None
    return call.result(out, lse)


def exact(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """The fallback: exact SDPA with the call's arguments (lse from the float64 reference)."""
    # SDPA sees the inputs' own rank (it takes another CPU path for 3-D inputs than for 4-D).
    out = _exact_sdpa(
        call.input_rank(call.q), call.input_rank(call.k), call.input_rank(call.v),
        attn_mask=call.attn_mask, dropout_p=call.dropout_p, is_causal=call.is_causal,
        scale=call.scale, enable_gqa=call.enable_gqa,
    )
    if call.input_ndim == 3:
        out = out.unsqueeze(0)
    lse = None
    if call.return_lse:
        from .reference import exact_attention

        _, lse = exact_attention(
            call.q, call.k, call.v, attn_mask=call.attn_mask, is_causal=call.is_causal,
            scale=call.scale, enable_gqa=call.enable_gqa, return_lse=True,
        )
        lse = lse.to(torch.float32)
    return call.result(out, lse)


def _kernel_view(t: Tensor) -> Tensor:
    """``t`` if the preprocessing and attention ops can read it in place (last dimension
    contiguous, the other strides multiples of 8 elements, 16-byte aligned), else a contiguous
    copy (an unusual input layout costs one copy, not the quantized path)."""
    if (t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _kernel_input(t: Tensor, head_dim: int) -> Tensor:
    """``t`` ``[B, H, N, D]`` as the kernels read it: zero-padded to ``head_dim`` channels (a
    contiguous copy) when D is smaller, else :func:`_kernel_view`."""
    if t.shape[-1] < head_dim:
        return torch.nn.functional.pad(t, (0, head_dim - t.shape[-1]))
    return _kernel_view(t)


def _unpad_head_dim(out: Tensor, head_dim: int, out_nhd: bool) -> Tensor:
    """The first ``head_dim`` channels of a kernel output ``[B, H, N, D_kernel]`` (NHD memory
    when ``out_nhd``), copied so that sageattn's output is contiguous in the caller's layout,
    as SDPA's is."""
    memory = out.transpose(1, 2) if out_nhd else out
    memory = memory[..., :head_dim].contiguous()
    return memory.transpose(1, 2) if out_nhd else memory


def smoothing_sample_stride(tokens: int) -> int:
    """The stride of the token sample whose mean is K's smoothing vector (and the Hopper path's
    V mean; not with the warp-level kernel's FP8 PV, whose V range reads all tokens): at most
    SMOOTHING_SAMPLE_TOKENS tokens (all of them up to that many; the statistics launch then
    reduces each head in one CTA, with no second launch), and odd, so that it is coprime with
    any power-of-two period of the token order (image rows, frames): the sample then visits
    every position of such a period rather than one column of an image."""
    return -(-tokens // SMOOTHING_SAMPLE_TOKENS) | 1


def _wgmma(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor,
           sm_scale: float) -> tuple[Tensor, Tensor]:
    """The Hopper kernel's call, one op (``ops.sageattn_wgmma_chain`` says what it runs): the
    smoothing means over the token sample of :func:`smoothing_sample_stride`, K and V
    quantized, then the kernel, which quantizes Q itself."""
    return ops.sageattn_wgmma(
        q, k, v, call.smooth_k, call.smooth_v, smoothing_sample_stride(k.shape[2]), sm_scale,
        call.is_causal, call.tensor_layout == "NHD", call.return_lse,
    )


def _mma(call: AttentionCall, choice: KernelChoice, q: Tensor, k: Tensor, v: Tensor,
         sm_scale: float) -> tuple[Tensor, Tensor]:
    """The warp-level kernel's call, one op (``ops.sageattn_mma_chain`` says what it runs: at
    most one statistics launch, whose K mean takes the token sample of
    :func:`smoothing_sample_stride` with PV in the input dtype, quantize_kv, then attention_mma,
    which quantizes Q itself and returns the complete LSE)."""
    return ops.sageattn_mma(
        q, k, v, choice.qk, choice.pv, _plan.smooths_q(call, choice), call.smooth_k,
        call.smooth_v, smoothing_sample_stride(k.shape[2]), sm_scale, call.is_causal,
        call.tensor_layout == "NHD", call.return_lse,
    )


def quantized(call: AttentionCall, choice: KernelChoice) -> Tensor | tuple[Tensor, Tensor]:
    """Serve ``call`` with ``choice``, the quantized kernel :func:`._plan.route` picks (only
    when it says the kernel can), at the kernel's head_dim (the only place that pads and cuts
    back)."""
    head_dim = call.head_dim
    padded_head_dim = _plan.kernel_head_dim(head_dim)
    assert padded_head_dim is not None  # a fallback rule checked it
    # The softmax scale of the true head_dim: padding must not change the scores.
    sm_scale = 1.0 / math.sqrt(head_dim) if call.scale is None else call.scale
    q, k, v = (_kernel_input(t, padded_head_dim) for t in (call.q, call.k, call.v))
    if choice.kernel == "wgmma":
        out, lse = _wgmma(call, q, k, v, sm_scale)
    else:
        out, lse = _mma(call, choice, q, k, v, sm_scale)
    if padded_head_dim != head_dim:
        out = _unpad_head_dim(out, head_dim, call.tensor_layout == "NHD")
    return call.result(out, lse if call.return_lse else None)
