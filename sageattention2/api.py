"""The public entry point, :func:`sageattn`, and :func:`kernel_plan`.

A call goes through three private modules: ``_call.validate`` checks every argument once and
returns an :class:`AttentionCall` (canonical ``[B, H, N, D]`` views, the options resolved);
``_plan.route`` picks the kernel and says why it cannot serve the call, from the routing rules
(README.md's routing table); ``_execute.run`` runs the kernel or the exact fallback. Under
``torch.compile`` the call is one graph op, ``sageattention2::sageattn`` (``_compile``).
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _compile, _execute
from ._call import (AttentionCall, CausalAlignment, PVQuant, QKQuant, SmoothQ, SmoothV, TensorLayout,
                    validate)
from ._execute import SageAttentionFallbackWarning, exact
# Re-exported (not in __all__): scripts and benchmarks take the sample stride from here.
from ._execute import smoothing_sample_stride as smoothing_sample_stride
from ._plan import kernel_plan

__all__ = ["AttentionCall", "Explanation", "SageAttentionFallbackWarning", "explain", "kernel_plan",
           "sageattn"]


def sageattn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    tensor_layout: TensorLayout = "HND",
    qk_quant: QKQuant = "auto",
    pv_quant: PVQuant = "auto",
    smooth_k: bool = True,
    smooth_q: SmoothQ = "auto",
    smooth_v: SmoothV = "auto",
    return_lse: bool = False,
    strict: bool = False,
    causal_alignment: CausalAlignment = "top_left",
) -> Tensor | tuple[Tensor, Tensor]:
    """Quantized attention (SageAttention2), a drop-in for ``F.scaled_dot_product_attention``.

    The parameters up to ``enable_gqa`` are SDPA's, with SDPA's names, in SDPA's order (SDPA
    takes ``scale`` and ``enable_gqa`` by keyword only; sageattn also positionally), so every
    call of ``F.scaled_dot_product_attention``, positional or by keyword (diffusers' attention
    dispatcher passes ``query=``, ``key=``, ``value=``), is a call of sageattn:
    ``F.scaled_dot_product_attention = sageattn`` works, and so does
    :func:`sageattention2.integrations.patch_sdpa`.

    Args:
        query, key, value: float16/bfloat16 (quantized path) or float32/float64 (exact
            fallback) tensors on one device. 4-D ``[B, H, N, D]`` or 3-D ``[H, N, D]`` with
            ``tensor_layout="HND"``; ``[B, N, H, D]`` or ``[N, H, D]`` with ``"NHD"``. All three
            have the same rank and batch size; key and value the same heads and length; query
            and key the same head_dim (value's may differ, which only the fallback serves).
        attn_mask: bool (True = attend) or additive float mask broadcasting to
            ``[..., H_q, N_q, N_kv]`` (always in this order, whatever ``tensor_layout``). A
            key-padding mask (``[B, 1, 1, N_kv]``, leaving each batch item one contiguous range
            of keys: right or left padding; additive: 0 or -inf) runs the kernel on each item's
            range of keys (examined once per mask tensor, one GPU synchronisation); any other
            mask is served by the fallback.
        dropout_p: in ``[0, 1)``; > 0 is served by the fallback only (applied as SDPA does).
        is_causal: causal mask aligned to the top-left, as SDPA: query i sees keys j <= i (also
            when N_q != N_kv; see ``causal_alignment``). Exclusive with ``attn_mask``.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        enable_gqa: allow fewer key/value heads than query heads (H_q a multiple of H_kv); as in SDPA,
            unequal head counts without it are an error.
        tensor_layout: ``"HND"`` or ``"NHD"`` (see query, key, value). The output uses the same layout.
        qk_quant: ``"int8"``, ``"int4"`` or ``"auto"``: INT8, except where exact SDPA is
            measured faster for the call's shape on this GPU (short or few sequences; the
            crossover table, ``python -m sageattention2 tune``): there exact SDPA runs, without
            a warning (not with ``return_lse=True``: SDPA has no LSE to return). ``"int8"``
            and ``"int4"`` always run the quantized kernel. INT4 (paper 3.2) is about 4x
            coarser: on inputs without channel offsets its error is several
            times INT8's; smoothing Q and K (the defaults) is what makes it usable. Which GPUs
            run it, and with which PV: the routing table (below).
        pv_quant: ``"fp8"``: P~ and V in E4M3 (paper 3.3: P~ times 448, V per channel), FP32
            accumulation per 128-key tile folded into the FP32 output; ``"none"``: P and V in
            the input dtype with FP32 accumulation (more accurate, and the only PV of GPUs
            without FP8 tensor cores); ``"auto"`` (default): FP8 where it is the fast PV, else
            the input dtype (per GPU: the routing table).
        smooth_k: subtract K's per-head mean before quantizing (exact: softmax is invariant to it).
        smooth_q: ``"head"`` (one mean per head, corrected exactly by Delta-S), ``"block"`` (the
            paper's per-Q-block mean; no kernel, fallback), ``False``, or ``"auto"`` (off for
            INT8 QK, "head" for INT4 QK, whose 4-bit codes need it). ``True`` means ``"head"``.
        smooth_v: subtract V's per-channel mean before FP8 quantization (paper A.3; added back to
            the output). Only matters with FP8 PV; with PV in the input dtype V is not
            quantized and it has no effect. ``"auto"`` (default): on above head_dim 128, where
            one FP8 scale per V tile spans 256 channels (bias4 family CosSim 0.99987 without,
            0.99999 with, for 0.3-1.6 % of the call), off at 128 and below.
        return_lse: also return the float32 log-sum-exp of the scaled scores (natural log),
            ``[B, H_q, N_q]`` (``[H_q, N_q]`` for 3-D inputs) in either layout; ``-inf`` for a
            query that sees no key.
        causal_alignment: ``"top_left"`` (SDPA's rule, the default) or ``"bottom_right"``
            (FlashAttention's: query i sees keys j <= i + N_kv - N_q, what chunked prefill over
            a KV cache needs; queries that see no key, when N_q > N_kv, give 0 and LSE -inf).
            Where N_q < N_kv the kernel runs it as two calls, the keys every query sees and the
            last N_q keys under SDPA's rule, merged by their LSE.
        strict: raise ``NotImplementedError`` instead of falling back to exact attention
            (where the quantized kernels cannot serve a call; not where ``qk_quant="auto"``
            chooses exact SDPA for speed).

    Returns:
        The attention output with query's shape except the last dimension, ``D_v``, contiguous
        in the input layout, in query's dtype; ``(out, lse)`` with ``return_lse=True``.

    Routing: which kernel serves a call (the Hopper ``attention_wgmma`` or the warp-level
    ``attention_mma``, and in which precisions) and which calls fall back to exact attention,
    each rule with its reason, is the routing table: README.md, "Which GPU runs what"
    (``python -m sageattention2 routing-table`` prints it; ``kernel_plan`` says what a GPU
    runs). Both kernels quantize Q themselves, after ``smoothing_stats`` and ``quantize_kv``
    (K, V and the smoothing means; docs/DESIGN.md#composite-ops) in the same op. They are built
    for head_dim 64 and 128; a smaller multiple of 8 is zero-padded to the next of them (a copy of
    q, k and v; the scores, with the softmax scale of the true head_dim, and the LSE are unchanged)
    and the output cut back.

    The output is written in the input layout. Inputs whose strides the kernels cannot read in
    place (last dimension not contiguous, other strides not multiples of 8 elements, not 16-byte
    aligned) are copied first.

    Training: inputs that require grad run exact SDPA (differentiable) unless
    ``SAGEATTN_TRAINING=quantized``, which opts in to the quantized forward with an exact
    backward from its O and LSE where that backward serves the call (README, "Training").

    Fallback: a call the quantized kernels cannot serve (the routing table's fallback rules) is
    computed by exact ``F.scaled_dot_product_attention`` with the same arguments, in the input
    dtype, with a :class:`SageAttentionFallbackWarning` the first time each reason occurs.
    ``strict=True`` raises ``NotImplementedError`` naming the reason instead. The lse of the
    fallback is computed exactly (float64 reference, cast to float32).

    Empty inputs (B, H, N_q or D_v zero) return a correctly shaped empty output without computing
    anything; with no keys (N_kv = 0) the output is zeros (what SDPA returns on CPU) and lse is
    ``-inf``. Neither falls back, warns nor raises with ``strict=True``; the empty output does not
    track autograd.

    NaN/Inf: the fallback behaves exactly like SDPA (a NaN in q row i poisons output row i; a NaN or
    Inf in k or v poisons every output row that attends to that key). The quantized path shares one
    scale per quantization group, computed from the group's max |x|, so a NaN or Inf poisons its
    whole group: in q, every row of its Q group (docs/DESIGN.md#q-quantizer; one row on the Hopper
    kernel), and with smooth_q every row of its Q block ("block") or head ("head"); in k, every key
    of its K group, and with smooth_k (the default) every key of the head, hence every output row
    of the head; in v with the warp-level kernels' FP8 PV (one scale per channel over all keys),
    that channel of every output row of the head, and on the Hopper kernel (one scale per 128-key
    tile) every channel of the output rows that attend to that tile; in v with PV in the input
    dtype, the output rows that attend to that key, and possibly the other rows of the same query
    tile (a masked key is multiplied by 0, and 0 * NaN is NaN). Inputs are not checked for
    non-finite values.
    """
    q, k, v = query, key, value
    compiling = torch.compiler.is_compiling()
    if compiling and not _compile.tracks_grad(q, k, v, attn_mask):
        # What torch.compile traces: one sageattention2::sageattn op (no graph break: the kernel
        # choice asks the build and the GPU, and the view check reads pointers).
        return _compile.graph_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                   tensor_layout, qk_quant, pv_quant, smooth_k, smooth_q,
                                   smooth_v, return_lse, strict, causal_alignment)
    # A call of a kind seen before (same shapes, dtypes, devices and options) runs as the first
    # one was decided, without validating and routing it again: most of a short call's host time
    # (models make dozens of calls of a few kinds per forward). The call cache is the
    # extension's (_execute.native_calls): one call from here, nothing built in Python but the
    # tuple of options.
    options = (dropout_p, is_causal, scale, enable_gqa, tensor_layout, qk_quant, pv_quant,
               smooth_k, smooth_q, smooth_v, return_lse, strict, causal_alignment)
    calls = _execute.native_calls
    if calls is not None and not compiling:
        out = calls.run(q, k, v, attn_mask, options, _execute.MISS)
        if out is not _execute.MISS:
            return out
    call = validate(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        tensor_layout, qk_quant, pv_quant, smooth_k, smooth_q, smooth_v, return_lse, strict,
        causal_alignment,
    )
    if compiling or _compile.tracks_grad(q, k, v, attn_mask):
        # Training (after the cache, which never holds a call that tracks grad: the hot path
        # pays nothing for it): the graph op, whose autograd formula is the exact backward from
        # the forward's O and LSE, where that backward serves the call and the quantized kernel
        # runs it; else the exact fallback (differentiable; traced as such when compiling).
        trained = _compile.training_call(call)
        if trained is not None:
            out, lse = _compile.graph_call(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                           enable_gqa, tensor_layout, qk_quant, trained.pv_quant,
                                           smooth_k, smooth_q, smooth_v, True, strict,
                                           causal_alignment)
            return (out, lse) if return_lse else out
        return exact(call) if compiling else _execute.run(call)
    return _execute.run_and_remember(call, (q, k, v, attn_mask, options))


class Explanation(NamedTuple):
    """What :func:`sageattn` runs for a call (:func:`explain`)."""

    quantized: bool     # a quantized kernel serves the call
    kernel: str         # "attention_wgmma", "attention_mma", "exact SDPA" or "nothing (empty)"
    qk: str | None      # "int8" / "int4" when quantized
    pv: str | None      # "fp8" / "input" when quantized
    reason: str | None  # why no quantized kernel serves it: the fallback's warning text, or
    #                     the measured crossover (exact SDPA is faster for this shape here)

    def __str__(self) -> str:
        if self.quantized:
            pv = "FP8" if self.pv == "fp8" else "the input dtype"
            return f"{self.kernel}: {self.qk.upper()} QK, PV in {pv}"  # type: ignore[union-attr]
        return self.kernel if self.reason is None else f"{self.kernel}: {self.reason}"


_SAGEATTN_SIGNATURE = inspect.signature(sageattn)


def validated_call(*args: Any, **kwargs: Any) -> AttentionCall:
    """The validated call of ``sageattn(*args, **kwargs)``: its arguments bound by sageattn's
    signature (names, defaults) and checked as sageattn checks them."""
    bound = _SAGEATTN_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return validate(*bound.arguments.values())  # sageattn's parameters are validate's, in order


def explain(*args: Any, **kwargs: Any) -> Explanation:
    """What ``sageattn(*args, **kwargs)`` would run, and why, without running it: the same
    arguments (validated as sageattn validates them, so a bad one raises the same error), the
    decision of the same routing rules (README.md, "Which GPU runs what")."""
    call = validated_call(*args, **kwargs)
    if call.is_empty:
        return Explanation(False, "nothing (empty)", None, None, None)
    trained = (_compile.training_call(call)
               if _compile.tracks_grad(call.q, call.k, call.v, call.attn_mask) else None)
    if trained is not None:
        with torch.no_grad():  # sageattn's training path: the graph op, deciding with grad off
            decision = _execute.decide(trained)
    else:
        decision = _execute.decide(call)
    if not decision.quantized:
        return Explanation(False, "exact SDPA", None, None,
                           decision.fallback or decision.faster_exact)
    choice = decision.choice
    return Explanation(True, f"attention_{choice.kernel}", choice.qk, choice.pv, None)
