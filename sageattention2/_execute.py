"""Running a validated call (:func:`run`): the quantized kernel that :func:`._plan.route` picks,
with each kernel's preprocessing in one op (docs/DESIGN.md#composite-ops), or exact
``F.scaled_dot_product_attention`` with a :class:`SageAttentionFallbackWarning` (or an error with
``strict=True``) when the route says the kernels cannot serve the call.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from . import _crossover, _key_ranges, _plan, ops
from ._call import AttentionCall
from ._key_ranges import KeyRanges
from ._tensor_memo import MISSING as MISSING_RANGES
from ._plan import KernelChoice

__all__ = [
    "SMOOTHING_SAMPLE_TOKENS",
    "Decision",
    "KernelCall",
    "SageAttentionFallbackWarning",
    "MISS",
    "clear_call_cache",
    "decide",
    "empty",
    "exact",
    "quantized",
    "run",
    "native_calls",
    "run_and_remember",
    "smoothing_sample_stride",
]

# K's smoothing vector (and, on the Hopper path, V's with smooth_v) is a mean over at most this
# many tokens, a strided sample (smoothing_sample_stride): any vector subtracted from every key
# shifts each row of S by a constant (and V's mean is added back), so only the quantization error
# can change; the statistics launch then reads ~1/16 of K at 4K instead of all of it.
SMOOTHING_SAMPLE_TOKENS = 256

# The INT4 guard (docs/DECISIONS.md#d38): with INT4 QK, the KV heads whose K, or a Q head sharing
# them, has a channel range more than this many times the head's mean channel range (after
# smoothing; ops.int8_heads) run INT8 QK inside the same call. INT4's per-thread groups share one
# scale over all channels: at a spread of 2 INT4's error is already ~1.6x that of even channels,
# at 8 (the outliers family) CosSim falls to 0.80 (notebook, session 30). SAGEATTN_INT4_GUARD
# sets another threshold (a number >= 1), or "off".
INT4_GUARD = 2.0
INT4_GUARD_ENVIRONMENT = "SAGEATTN_INT4_GUARD"


def int4_guard() -> float:
    """The INT4 guard's threshold for calls decided now (0: off): INT4_GUARD unless the
    environment sets another."""
    return ops.guard_threshold(INT4_GUARD_ENVIRONMENT, INT4_GUARD)


# The builtin that F.scaled_dot_product_attention names. Bound here so that the fallback still
# reaches the exact kernel while F.scaled_dot_product_attention is patched to sageattn.
_sdpa_builtin = torch._C._nn.scaled_dot_product_attention


def _exact_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                enable_gqa: bool = False) -> Tensor:
    """The exact kernel, with a float32 mask beside float64 inputs widened first (exactly):
    PyTorch 2.11's CPU kernel reads that pair wrongly on an AVX2 host (outputs 1.85 off on
    N(0, 1) inputs, session 49), and sageattn takes float32 masks for every input dtype."""
    if attn_mask is not None and q.dtype == torch.float64 and attn_mask.dtype == torch.float32:
        attn_mask = attn_mask.double()
    return _sdpa_builtin(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                         enable_gqa=enable_gqa)


class SageAttentionFallbackWarning(UserWarning):
    """sageattn computed a call with exact ``F.scaled_dot_product_attention``."""


# Public as sageattention2.api.SageAttentionFallbackWarning (warning filters name it so).
SageAttentionFallbackWarning.__module__ = "sageattention2.api"

_warned_reasons: set[str] = set()


def _warn_fallback_once(reason: str, stacklevel: int) -> None:
    """``stacklevel``: of the frame calling sageattn, counted from this function's caller."""
    if reason in _warned_reasons:
        return
    _warned_reasons.add(reason)
    warnings.warn(
        f"sageattn is computing exact F.scaled_dot_product_attention instead of quantized "
        f"attention: {reason}. This warning is shown once per reason; pass strict=True to raise.",
        SageAttentionFallbackWarning,
        stacklevel=stacklevel + 1,
    )


class Decision(NamedTuple):
    """How a call runs: the kernel :func:`._plan.route` picks for it, why that kernel cannot
    serve it (``fallback``: exact SDPA with a warning, or strict's error), or else why exact SDPA
    serves it anyway (``faster_exact``: the measured crossover of ``qk_quant="auto"``; no
    warning, the result is exact)."""

    choice: KernelChoice
    fallback: str | None
    faster_exact: str | None
    # A key-padding mask (_key_ranges): each batch item's keys, which the kernel runs on.
    ranges: KeyRanges | None = None

    @property
    def quantized(self) -> bool:
        return self.fallback is None and self.faster_exact is None


def _range_calls(call: AttentionCall, ranges: KeyRanges) -> list[tuple[int, int, int, int,
                                                                      AttentionCall]]:
    """``call`` with a key-padding mask as unmasked calls: per run of batch items that share a
    range of keys, (first item, end item, first key, end key, the call on those items' queries
    and that range of their keys)."""
    return [(b0, b1, start, end, dataclasses.replace(
                call, q=call.q[b0:b1], k=call.k[b0:b1, :, start:end],
                v=call.v[b0:b1, :, start:end], attn_mask=None))
            for b0, b1, start, end in _key_ranges.runs(ranges)]


def decide(call: AttentionCall, ranges: Any = MISSING_RANGES) -> Decision:
    """The :class:`Decision` for ``call`` (made once per kind of call, and for a call with a
    key-padding mask once per mask: the call cache); ``ranges``: its mask's key ranges where
    known (else the mask is examined)."""
    choice, fallback = _plan.route(call)
    if fallback is not None:
        return Decision(choice, fallback, None)
    capability = _plan.cuda_capability(call.q.device)
    if call.attn_mask is None:
        return Decision(choice, None, _crossover.exact_is_faster(call, choice, capability))
    if ranges is MISSING_RANGES:
        ranges = _key_ranges.key_ranges(call.attn_mask, call.q.shape[0], call.k.shape[2],
                                        call.q.shape[2])
    if ranges is None:  # (the route examined it as a key-padding mask before: modified since)
        return Decision(choice, _plan.MASK_RULE.reason, None)
    if one_launch(call, choice):
        # Against SDPA without the mask over all keys: the kernel runs each item's keys alone (at
        # most that call's work), and SDPA with the mask took 1.5-2.3x its unmasked time, but a
        # short call is host-bound inside a model (docs/DECISIONS.md#d43).
        faster = _crossover.exact_is_faster(dataclasses.replace(call, attn_mask=None), choice,
                                            capability)
        return Decision(choice, None, faster, None if faster is not None else ranges)
    for *_, sub in _range_calls(call, ranges):
        faster = _crossover.exact_is_faster(sub, choice, capability)
        if faster is not None:
            return Decision(choice, None, faster)
    return Decision(choice, None, None, ranges)


def run(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """What sageattn returns for ``call`` in eager mode."""
    if call.is_empty:
        return empty(call)
    return _run_decided(call, decide(call))


def _run_decided(call: AttentionCall, decision: Decision) -> Tensor | tuple[Tensor, Tensor]:
    if decision.quantized:
        return quantized(call, decision.choice, decision.ranges)
    if decision.fallback is None:  # exact by choice: faster here
        return exact(call)
    _fall_back(decision.fallback, call.strict, stacklevel=4)  # sageattn's caller: sageattn, run, this
    return exact(call)


def _fall_back(reason: str, strict: bool, stacklevel: int) -> None:
    """strict's error, or the fallback's warning (``stacklevel``: of sageattn's caller, counted
    from this function's caller)."""
    if strict:
        raise NotImplementedError(
            f"sageattn(strict=True): the quantized kernels cannot serve this call: {reason}"
        )
    _warn_fallback_once(reason, stacklevel=stacklevel + 1)


def empty(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """No output elements or no keys: zeros (what SDPA gives on CPU), lse -inf; nothing runs."""
    b, h, n_q, _ = call.q.shape
    out = call.q.new_zeros((b, h, n_q, call.head_dim_v))
    lse = call.q.new_full((b, h, n_q), -math.inf, dtype=torch.float32) if call.return_lse else None
    return call.result(out, lse)


def _bottom_right_mask(call: AttentionCall) -> Tensor:
    """FlashAttention's causal rule as SDPA's lazy mask (torch.nn.attention.bias)."""
    from torch.nn.attention.bias import causal_lower_right

    with warnings.catch_warnings():  # "NaNs when seq_len_q > seq_len_kv": those rows are zeroed
        warnings.simplefilter("ignore")
        return causal_lower_right(call.q.shape[2], call.k.shape[2])


def exact(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """The fallback: exact SDPA with the call's arguments (lse from the float64 reference)."""
    mask, causal = call.attn_mask, call.is_causal
    if call.bottom_right:
        mask, causal = _bottom_right_mask(call), False
    # SDPA sees the inputs' own rank (it takes another CPU path for 3-D inputs than for 4-D).
    out = _exact_sdpa(
        call.input_rank(call.q), call.input_rank(call.k), call.input_rank(call.v),
        attn_mask=mask, dropout_p=call.dropout_p, is_causal=causal,
        scale=call.scale, enable_gqa=call.enable_gqa,
    )
    if call.input_ndim == 3:
        out = out.unsqueeze(0)
    blind = max(call.q.shape[2] - call.k.shape[2], 0) if call.bottom_right else 0
    if blind:  # queries before the first key's diagonal see no key: 0, as a kernel gives
        out = out.clone()
        out[:, :, :blind] = 0
    lse = None
    if call.return_lse:
        from .reference import exact_attention

        if call.bottom_right:
            n_q, n_k = call.q.shape[2], call.k.shape[2]
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=call.q.device).tril(n_k - n_q)
        _, lse = exact_attention(
            call.q, call.k, call.v, attn_mask=mask, is_causal=causal,
            scale=call.scale, enable_gqa=call.enable_gqa, return_lse=True,
        )
        lse = lse.to(torch.float32)
    return call.result(out, lse)


def heads_inner(t: Tensor) -> bool:
    """Whether a ``[.., H, N, D]`` view has each token's heads side by side in memory (a view of
    ``[.., N, H, D]`` memory, as diffusers' dispatcher passes): a kernel output then goes into
    the same memory order, as SDPA's flash and cuDNN backends do (docs/DECISIONS.md#d32)."""
    return t.dim() >= 3 and t.stride(-3) < t.stride(-2)


def _kernel_view(t: Tensor) -> Tensor:
    """``t`` if the preprocessing and attention ops can read it in place (last dimension
    contiguous, the other strides multiples of 16 bytes, 16-byte aligned), else a contiguous
    copy (an unusual input layout costs one copy, not the quantized path)."""
    if ops.readable_in_place(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def kernel_input(t: Tensor, head_dim: int) -> Tensor:
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


@dataclass(frozen=True)
class KernelCall:
    """All of a quantized call that its shapes and options decide (so computed once per kind of
    call: the call cache), run on its ``[B, H, N, D]`` views: each kernel's path is one op
    (``ops.sageattn_wgmma_chain`` / ``ops.sageattn_mma_chain`` say what it runs: the smoothing
    means, K and V quantized, the kernel, which quantizes Q itself), at the kernel's head_dim
    (the only place that pads and cuts back)."""

    choice: KernelChoice
    smooth_q: bool      # the warp-level kernel smooths Q per head (_plan.smooths_q)
    smooth_k: bool
    smooth_v: bool
    head_dim: int
    padded_head_dim: int
    sm_scale: float     # of the true head_dim: padding must not change the scores
    sample_stride: int  # of the smoothing means' token sample (smoothing_sample_stride)
    is_causal: bool
    out_nhd: bool
    return_lse: bool
    int4_guard: float   # the INT4 guard's threshold with INT4 QK (int4_guard()), else 0

    @staticmethod
    def of(call: AttentionCall, choice: KernelChoice) -> KernelCall:
        padded_head_dim = _plan.kernel_head_dim(call.head_dim, _plan.head_dims_of(choice))
        assert padded_head_dim is not None  # a fallback rule checked it
        return KernelCall(
            choice, _plan.smooths_q(call, choice), call.smooth_k, call.smooth_v, call.head_dim,
            padded_head_dim, 1.0 / math.sqrt(call.head_dim) if call.scale is None else call.scale,
            smoothing_sample_stride(call.k.shape[2]), call.is_causal, call.tensor_layout == "NHD",
            call.return_lse, int4_guard() if choice.qk == "int4" else 0.0)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, key_ranges: Tensor | None = None,
                 key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(out ``[B, H, Nq, D]``; lse, empty unless return_lse). The output's memory is NHD
        with ``out_nhd`` or where q's is (a ``[B, H, N, D]`` view of ``[B, N, H, D]`` memory, as
        diffusers' dispatcher passes), as SDPA's flash and cuDNN backends do: the caller's
        transpose back to ``[B, N, H * D]`` is then free, not a copy of the output.
        ``key_ranges`` or ``key_mask``: the Hopper kernel's key ranges, or the mask it reads
        them from (:class:`KeyRangeKernel`)."""
        out_nhd = self.out_nhd or heads_inner(q)
        q, k, v = (kernel_input(t, self.padded_head_dim) for t in (q, k, v))
        if self.choice.kernel == "wgmma":
            out, lse = ops.sageattn_wgmma(
                q, k, v, self.choice.pv, self.smooth_k, self.smooth_v, self.sample_stride, self.sm_scale,
                self.is_causal, out_nhd, self.return_lse, key_ranges, key_mask,
                SMOOTHING_SAMPLE_TOKENS if key_mask is not None else 0)
        else:
            out, lse = ops.sageattn_mma(
                q, k, v, self.choice.qk, self.choice.pv, self.smooth_q, self.smooth_k,
                self.smooth_v, self.sample_stride, self.sm_scale, self.is_causal, out_nhd,
                self.return_lse, self.int4_guard)
        if self.padded_head_dim != self.head_dim:
            out = _unpad_head_dim(out, self.head_dim, out_nhd)
        return out, lse


def quantized(call: AttentionCall, choice: KernelChoice,
              ranges: KeyRanges | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Serve ``call`` with ``choice``, the quantized kernel :func:`._plan.route` picks (only
    when it says the kernel can); with ``ranges``, on each batch item's range of keys."""
    if call.bottom_right:
        out, lse = _bottom_right(call, choice)
    elif ranges is None:
        out, lse = KernelCall.of(call, choice)(call.q, call.k, call.v)
    else:
        out, lse = _run_ranges(call.q, call.k, call.v, _range_kernels(call, choice, ranges))
    return call.result(out, lse if call.return_lse else None)


@dataclass(frozen=True)
class KeyRangeKernel:
    """A key-padding mask's batch items on the Hopper kernel in one launch (docs/DECISIONS.md#d43):
    each item attends its own range of keys, its K and V groups and means over them alone, its
    smoothing sample as an unmasked call on its range would take (so each item's output is that
    call's, bit for bit). With ``key_mask`` (a 4-D view of the mask) the launch reads the ranges
    from the mask on the GPU instead: an inference tensor's, which may have changed in place
    since it was examined."""

    kernel: KernelCall  # (sample_stride 1: each item's is in ranges)
    ranges: Tensor  # int32 [B, 3] on the inputs' device: each item's first and end key, sample stride

    def __call__(self, q: Tensor, k: Tensor, v: Tensor,
                 key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if key_mask is not None:
            return self.kernel(q, k, v, key_mask=key_mask)
        return self.kernel(q, k, v, self.ranges)


RangeKernels = list[tuple[int, int, int, int, "KernelCall"]]


def one_launch(call: AttentionCall, choice: KernelChoice) -> bool:
    """Whether a key-padding mask's ranges run in one launch: on the Hopper kernel, without
    is_causal (the warp-level kernel runs one call per run of items that share a range)."""
    return choice.kernel == "wgmma" and not call.is_causal


def _range_kernels(call: AttentionCall, choice: KernelChoice,
                   ranges: KeyRanges) -> RangeKernels | KeyRangeKernel:
    """The kernel call of a key-padding mask's ranges: one launch over all of them
    (:func:`one_launch`), or one kernel call per run of batch items that share a range (its
    smoothing sample of the range's length)."""
    if one_launch(call, choice):
        kernel = dataclasses.replace(KernelCall.of(call, choice), sample_stride=1)
        rows = [(start, end, smoothing_sample_stride(end - start)) for start, end in ranges]
        return KeyRangeKernel(kernel, torch.tensor(rows, dtype=torch.int32).to(call.q.device))
    return [(b0, b1, start, end, KernelCall.of(sub, choice))
            for b0, b1, start, end, sub in _range_calls(call, ranges)]


def _run_ranges(q: Tensor, k: Tensor, v: Tensor,
                kernels: RangeKernels | KeyRangeKernel) -> tuple[Tensor, Tensor]:
    """(out, lse) of ``[B, H, N, D]`` views run per range of keys: one kernel call where one
    range serves the whole batch (no copy) or the Hopper kernel takes the ranges, else each
    run's output copied into its items."""
    if isinstance(kernels, KeyRangeKernel):
        return kernels(q, k, v)
    batch = q.shape[0]
    if len(kernels) == 1:
        _, _, start, end, kernel = kernels[0]
        return kernel(q, k[:, :, start:end], v[:, :, start:end])
    first = kernels[0][4]
    b, h, n_q = q.shape[:3]
    out = q.new_empty((b, n_q, h, v.shape[-1])).transpose(1, 2) \
        if first.out_nhd or heads_inner(q) else \
        q.new_empty((b, h, n_q, v.shape[-1]))
    lse = q.new_empty((batch, h, n_q) if first.return_lse else (0,), dtype=torch.float32)
    for b0, b1, start, end, kernel in kernels:
        part, part_lse = kernel(q[b0:b1], k[b0:b1, :, start:end], v[b0:b1, :, start:end])
        out[b0:b1].copy_(part)
        if first.return_lse:
            lse[b0:b1].copy_(part_lse)
    return out, lse


def _bottom_right(call: AttentionCall, choice: KernelChoice) -> tuple[Tensor, Tensor]:
    """FlashAttention's causal rule on the kernels, which run SDPA's: with N_q > N_kv the last
    N_kv queries under SDPA's rule over all keys (the others see none: 0, LSE -inf); with
    N_q < N_kv the keys every query sees (the first N_kv - N_q) without a mask and the last N_q
    under SDPA's rule, the two merged by their LSE."""
    q, k, v = call.q, call.k, call.v
    n_q, n_k = q.shape[2], k.shape[2]
    part = dataclasses.replace(call, bottom_right=False, return_lse=True)
    if n_q > n_k:
        rows = dataclasses.replace(part, q=q[:, :, n_q - n_k:])
        out_rows, lse_rows = KernelCall.of(rows, choice)(rows.q, k, v)
        b, h, _ = q.shape[:3]
        out = (out_rows.new_zeros((b, n_q, h, v.shape[-1])).transpose(1, 2)
               if call.tensor_layout == "NHD" else out_rows.new_zeros((b, h, n_q, v.shape[-1])))
        lse = lse_rows.new_full(q.shape[:3], -math.inf)
        out[:, :, n_q - n_k:] = out_rows
        lse[:, :, n_q - n_k:] = lse_rows
        return out, lse
    seen = n_k - n_q
    first = dataclasses.replace(part, k=k[:, :, :seen], v=v[:, :, :seen], is_causal=False)
    last = dataclasses.replace(part, k=k[:, :, seen:], v=v[:, :, seen:])
    out_a, lse_a = KernelCall.of(first, choice)(q, first.k, first.v)
    out_b, lse_b = KernelCall.of(last, choice)(q, last.k, last.v)
    return merge_parts([out_a, out_b], [lse_a, lse_b], heads_inner(out_a))


def merge_by_lse(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over two disjoint sets of keys as one: ``out_*`` ``[..., D]``, ``lse_*`` ``[...]``
    (natural log). A part in which a row sees no key (LSE -inf, output 0) adds nothing to it; a
    row that sees no key in either keeps output 0 and LSE -inf. In float32, then out_a's dtype
    (sageattn_varlen's bottom-right parts and the context-parallel ring merge with this one
    definition)."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # (no key in either)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    divisor = torch.where(total > 0, total, torch.ones_like(total))  # (no key: 0 / 1)
    out = (out_a.float() * (w_a / divisor)[..., None] + out_b.float() * (w_b / divisor)[..., None])
    return out.to(out_a.dtype), top + torch.log(total)


def merge_parts(outs: list[Tensor], lses: list[Tensor], out_nhd: bool) -> tuple[Tensor, Tensor]:
    """:func:`merge_by_lse` over any number of parts, outputs ``[B, H, N, D]`` and LSEs
    ``[B, H, N]``: (out in the parts' dtype, NHD memory if ``out_nhd``; lse float32). In one pass
    of the extension's op where it reads every part as it is (the same arithmetic: two parts give
    merge_by_lse's bits), else folded here in float32 and rounded once."""
    if ops.merges_in_one_pass(outs, lses):
        return ops.merge_attention_parts(outs, lses, out_nhd)
    out, lse = outs[0].float(), lses[0].float()
    for part, part_lse in zip(outs[1:], lses[1:]):
        out, lse = merge_by_lse(out, lse, part, part_lse)
    merged = (torch.empty(out.shape[0], out.shape[2], out.shape[1], out.shape[3], dtype=outs[0].dtype,
                          device=out.device).transpose(1, 2) if out_nhd
              else torch.empty(out.shape, dtype=outs[0].dtype, device=out.device))
    return merged.copy_(out), lse


# ------------------------------------------------------------------------------------------------
# The call cache: validation and routing once per kind of call
# ------------------------------------------------------------------------------------------------

# A runner takes sageattn's first eight arguments (SDPA's) and returns its result.
Runner = Callable[[Tensor, Tensor, Tensor, Optional[Tensor], float, bool, Optional[float], bool],
                  Tensor]
# The call cache lives in the extension (csrc/torch/call_cache.cpp: its key is read from the
# tensors there, and the crossover's exact calls run from there): sageattn asks it first, with
# its arguments and MISS; what decides a kind of call is the shapes, dtypes and devices of q, k,
# v and the mask, whether autograd would track the call, and the other arguments with their
# types (``1`` is not ``True`` to the validation); not the values, strides or addresses (each
# call still checks that the kernels can read its tensors in place). Tensor subclasses and
# active torch function modes are not remembered (their __torch_function__ runs in Python).
# Without the extension (a pure-Python install: every call is an exact fallback) nothing is
# remembered and every call is validated.
native_calls: Any = getattr(ops._C, "call_cache", None) if ops.HAS_EXTENSION else None
MISS = object()


def clear_call_cache() -> None:
    """Forget every remembered call (tests that pretend other GPUs or builds call this)."""
    if native_calls is not None:
        native_calls.clear()


def _in_bhnd(t: Tensor, nhd: bool) -> Tensor:
    """A 3-D or 4-D input as the ``[..., H, N, D]`` view SDPA and the kernels take."""
    return t.transpose(-3, -2) if nhd else t


def _runner(call: AttentionCall, decision: Decision) -> Runner | None:
    """How to run the next call of this kind without validating or routing it again: exactly
    what :func:`run` does for it. None for the calls run takes another way each time (empty
    ones, strict fallbacks, and exact calls asked for an lse)."""
    nhd = call.tensor_layout == "NHD"
    if call.bottom_right:
        return None  # validated and run each time (it runs as parts: _bottom_right)
    if (call.attn_mask is not None and decision.fallback in (None, _plan.MASK_RULE.reason)
            and _key_ranges.could_be_key_mask(call.attn_mask.shape, call.q.shape[0],
                                              call.k.shape[2], call.q.shape[2])
            and (decision.quantized or not _exact_at_full_length(call, decision))):
        return _mask_runner(call)  # the mask's values decide, call by call
    if not decision.quantized:
        reason = decision.fallback
        if (reason is not None and call.strict) or call.return_lse:
            return None
        if reason is None and not nhd:
            return _exact_as_called  # the crossover's exact calls: one frame before SDPA

        def exact_runner(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                         dropout_p: float, is_causal: bool, scale: float | None,
                         enable_gqa: bool) -> Tensor:
            if reason is not None:
                _warn_fallback_once(reason, stacklevel=3)  # sageattn's caller: sageattn, this
            if not nhd:
                return _exact_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                   enable_gqa=enable_gqa)
            return _exact_in_layout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                    nhd)
        return exact_runner

    kernel = KernelCall.of(call, decision.choice)
    rank3 = call.input_ndim == 3

    def kernel_runner(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None,
                      enable_gqa: bool) -> Any:
        views = [_in_bhnd(t, nhd) for t in (q, k, v)]
        if rank3:
            views = [t.unsqueeze(0) for t in views]
        out, lse = kernel(*views)
        out = _in_bhnd(out, nhd)
        if rank3:
            out, lse = out.squeeze(0), lse.squeeze(0)
        return (out, lse) if kernel.return_lse else out
    return kernel_runner


def _exact_at_full_length(call: AttentionCall, decision: Decision) -> bool:
    """With ``qk_quant="auto"``, whether exact SDPA is faster than the kernel on the call without
    its mask (all keys): then no range of keys would run the kernel either (the crossover's
    speed-up grows with the key length), and no mask of this kind of call is examined (no
    synchronisation per call); exact SDPA runs with the mask, without a warning."""
    if not call.qk_quant_auto:
        return False
    unmasked = dataclasses.replace(call, attn_mask=None)
    return _crossover.exact_is_faster(unmasked, decision.choice,
                                      _plan.cuda_capability(call.q.device)) is not None


def _exact_as_called(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                     is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    return _exact_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _exact_in_layout(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                     is_causal: bool, scale: float | None, enable_gqa: bool, nhd: bool) -> Tensor:
    """Exact SDPA on the caller's tensors (any rank), in their layout."""
    if nhd:  # (SDPA's own layout goes straight through: no call between)
        q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
    out = _exact_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=scale, enable_gqa=enable_gqa)
    return out.transpose(-3, -2) if nhd else out


_MAX_MASK_PLANS = 64  # kinds of key ranges one runner remembers


def _mask_runner(call: AttentionCall) -> Runner:
    """The runner of a kind of call with a mask whose fate depends on its values: each call's
    mask is examined (``_key_ranges``: once per mask tensor), a key-padding mask runs the kernel
    on each item's keys (the decision made once per set of ranges), any other mask runs exact
    SDPA with the mask rule's warning, as :func:`run` does."""
    nhd, rank3 = call.tensor_layout == "NHD", call.input_ndim == 3
    options = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)
               if f.name not in ("q", "k", "v", "attn_mask")}  # not the tensors: kept alive
    batch, n_q, n_k = call.q.shape[0], call.q.shape[2], call.k.shape[2]
    plans: dict[KeyRanges, RangeKernels | KeyRangeKernel | Decision] = {}

    def views(q: Tensor, k: Tensor, v: Tensor) -> list[Tensor]:
        found = [_in_bhnd(t, nhd) for t in (q, k, v)]
        return [t.unsqueeze(0) for t in found] if rank3 else found

    def mask_runner(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                    is_causal: bool, scale: float | None, enable_gqa: bool) -> Any:
        assert attn_mask is not None
        def plan_of(ranges: KeyRanges | None) -> RangeKernels | KeyRangeKernel | Decision | None:
            plan = None if ranges is None else plans.get(ranges)
            if ranges is not None and plan is None:
                this = AttentionCall(*views(q, k, v), attn_mask, **options)  # type: ignore[misc]
                decision = decide(this, ranges)
                plan = (_range_kernels(this, decision.choice, decision.ranges)
                        if decision.quantized and decision.ranges is not None else decision)
                if len(plans) >= _MAX_MASK_PLANS:
                    plans.clear()
                plans[ranges] = plan
            return plan

        # An inference tensor seen before: its ranges then, which the one launch reads again on
        # the GPU (or exact SDPA takes the mask itself); else examined here (_key_ranges), as
        # also where the plan would use the ranges as they were (one call per run of items).
        ranges = _key_ranges.remembered_unverified(attn_mask, batch, n_k, n_q)
        read_on_gpu = ranges is not MISSING_RANGES
        plan = plan_of(ranges) if read_on_gpu else None
        if not read_on_gpu or isinstance(plan, list):
            read_on_gpu = False
            plan = plan_of(_key_ranges.key_ranges(attn_mask, batch, n_k, n_q))
        if plan is None or isinstance(plan, Decision):  # exact SDPA: not a key-padding mask, or faster here
            reason = _plan.MASK_RULE.reason if plan is None else plan.fallback
            if reason is not None:
                _fall_back(reason, options["strict"], stacklevel=3)  # sageattn's caller: sageattn, this
            if options["return_lse"]:  # the exact LSE: the float64 reference
                return exact(AttentionCall(*views(q, k, v), attn_mask, **options))  # type: ignore[misc]
            return _exact_in_layout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                    nhd)
        if read_on_gpu and isinstance(plan, KeyRangeKernel):
            out, lse = plan(*views(q, k, v), key_mask=attn_mask[(None,) * (4 - attn_mask.dim())])
        else:
            out, lse = _run_ranges(*views(q, k, v), plan)
        out = _in_bhnd(out, nhd)
        if rank3:
            out, lse = out.squeeze(0), lse.squeeze(0)
        return (out, lse) if options["return_lse"] else out
    return mask_runner


def run_and_remember(call: AttentionCall, arguments: tuple[Any, ...]) -> Any:
    """:func:`run`, remembering in the call cache how to run the next call of this kind
    (``arguments``: sageattn's q, k, v, attn_mask as given and the tuple of its other
    arguments, what the cache keys on)."""
    if call.is_empty or native_calls is None:
        return run(call)
    decision = decide(call)
    runner = _runner(call, decision)
    if runner is not None:
        native_calls.remember(*arguments, runner, runner is _exact_as_called)
    return _run_decided(call, decision)
