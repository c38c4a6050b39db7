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
before (the routing table's fallback "inputs that require grad"). :func:`guard` (D52) sends the
calls whose q or k has channels wide enough to break INT8 QK's gradients there too.
"""
from __future__ import annotations

import os
import weakref

import torch
from torch import Tensor

from . import ops
from ._call import AttentionCall
from ._execute import kernel_input
from .reference import _expand_kv_heads

__all__ = ["GUARD_ENVIRONMENT", "TRAINING_ENVIRONMENT", "attention_backward", "guard",
           "guard_verdict", "refusal", "reset_guard", "training_guard", "training_mode"]

# Opt-in until the quantized forward's gradients meet the exact bar on every input family
# (session 41: met on bias0 and bias4 with PV in 16 bits; outliers 0.90 / 0.94 / 0.95, D51,
# which the guard now sends to exact SDPA, D52):
# "exact" (the default: inputs that require grad run exact SDPA and its backward) or "quantized"
# (the quantized forward, this backward).
TRAINING_ENVIRONMENT = "SAGEATTN_TRAINING"
TRAINING_MODES = ("exact", "quantized")

# The training guard (docs/DECISIONS.md#d52): a call whose q or k has a head with a channel spread
# (ops.head_channel_spread: the widest channel's range over the head's mean range) above this runs
# exact SDPA. The gradients through INT8 QK fall with the spread (float64 emulation of the kernel,
# 1,029 and 2,085 tokens, 6 channels widened f times, session 42): spread 2.3 -> dQ CosSim
# 0.99998, 3.3 -> 0.9996-0.9997, 4.2 -> 0.9987, 5-6 -> 0.993-0.997, 9.5 (the outliers family)
# -> 0.92; MiniLM's real heads read 1.4-2.1 on a 419-token sentence, up to 3.2 on 10-token ones.
# SAGEATTN_TRAINING_GUARD sets another threshold (a number >= 1), or "off".
TRAINING_GUARD = 3.5
GUARD_ENVIRONMENT = "SAGEATTN_TRAINING_GUARD"

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
    if call.attn_mask is not None and call.attn_mask.requires_grad:
        return "an attn_mask that requires grad (the backward gives no mask gradient)"
    if call.dropout_p > 0:
        return "dropout_p > 0"
    if call.is_causal and call.q.shape[2] != call.k.shape[2]:
        return "is_causal with query and key lengths that differ"
    if call.head_dim_v != call.head_dim:
        return "v's head_dim differs from q's and k's"
    return None


def training_guard() -> float:
    """The training guard's threshold (0: off): TRAINING_GUARD unless the environment sets
    another."""
    return ops.guard_threshold(GUARD_ENVIRONMENT, TRAINING_GUARD)


# The guard's verdict per call object, so that the fallback's reason reads it back
# (guard_verdict) instead of measuring again.
_VERDICTS: "weakref.WeakKeyDictionary[AttentionCall, str | None]" = weakref.WeakKeyDictionary()
# Measurements a kind of call may leave unread before the oldest is waited for.
_MAX_PENDING = 64


class _Spread:
    """The largest channel spread of q's and k's heads (ops.head_channel_spread), on its way to
    the host: on a GPU copied into pinned memory behind an event, so that it is read without
    waiting for the work queued after it; on the CPU, at once."""

    def __init__(self, q: Tensor, k: Tensor) -> None:
        with torch.no_grad():
            spread = torch.stack([ops.head_channel_spread(x).amax() for x in (q, k)]).amax()
        self._event = None
        if spread.is_cuda:
            self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._host.copy_(spread, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = spread

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def value(self) -> float:
        if self._event is not None:
            self._event.synchronize()
        return float(self._host)


class _GuardKind:
    """What the guard knows of one kind of call: the largest spread read so far, and the
    measurements not read yet."""

    def __init__(self) -> None:
        self.spread: float | None = None
        self.pending: list[_Spread] = []

    def read(self, wait_for: int = 0) -> None:
        """Fold in the measurements whose copies have landed (and the oldest ``wait_for``)."""
        unread = []
        for i, measured in enumerate(self.pending):
            if i < wait_for or measured.ready():
                self.spread = max(self.spread or 0.0, measured.value())
            else:
                unread.append(measured)
        self.pending = unread


# Per kind of call (q's and k's heads, head_dim, dtype, device: a model's layers of one shape
# share one, and so do a varlen call's sequences), for the process (reset_guard forgets).
_KINDS: dict[tuple[object, ...], _GuardKind] = {}


def reset_guard() -> None:
    """Forget what the training guard has measured (every kind is measured anew)."""
    _KINDS.clear()
    _VERDICTS.clear()


def guard(call: AttentionCall) -> str | None:
    """Why the quantized forward's gradients would not hold for ``call`` (D52): its q or k has a
    head whose channel spread is above :func:`training_guard`; None where they hold (or the
    guard is off). The statistic is one pass over q and one over k (ops.head_channel_spread: no
    float32 copies). Reading it on the host would make every training call wait for the GPU
    (4.9 % of Flux's training step, 1.3 % of Wan's: session 45), so only the first call of a
    kind of call waits for its own; each later one is decided by the largest spread read so far
    for its kind and measured on the GPU, read by a later call once its copy has landed (a
    step later at most, in practice): a kind stays exact from the first measurement above the
    threshold on, for all its calls. Asked only of calls the quantized kernel would run, not
    while a CUDA graph is being captured (nor under torch.compile: ``_compile.training_call``)."""
    threshold = training_guard()
    if threshold == 0.0 or (call.q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    if call in _VERDICTS:
        return _VERDICTS[call]
    kind = _KINDS.setdefault((call.q.shape[1], call.k.shape[1], call.head_dim, call.q.dtype,
                              call.q.device), _GuardKind())
    kind.read(wait_for=len(kind.pending) - _MAX_PENDING)
    if kind.spread is None or kind.spread <= threshold:
        kind.pending.append(_Spread(call.q, call.k))
        kind.read(wait_for=1 if kind.spread is None else 0)  # (the first of a kind waits)
    verdict = None
    if kind.spread > threshold:  # (the text without the spread: one warning, not one per step)
        verdict = (f"q or k with a channel spread above the training guard's {threshold:g} "
                   f"(INT8 QK's gradients fall below CosSim 0.999 from about 4: "
                   f"docs/DECISIONS.md#d52; {GUARD_ENVIRONMENT} sets the threshold, or 'off')")
    _VERDICTS[call] = verdict
    return verdict


def guard_verdict(call: AttentionCall) -> str | None:
    """The verdict :func:`guard` gave ``call``, without measuring (None where it was not asked)."""
    return _VERDICTS.get(call)


def _sum_groups(grad: Tensor, heads: int) -> Tensor:
    b, h, n, d = grad.shape
    return grad if h == heads else grad.view(b, heads, h // heads, n, d).sum(2)


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, is_causal: bool, scale: float | None,
                       grad_lse: Tensor | None = None,
                       attn_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV (in the inputs' dtypes) of attention ``softmax(scale q k^T + mask) v`` at ``q,
    k, v`` ``[B, H, N, D]`` (K and V may have fewer heads: GQA), from its output ``out`` ``[B,
    Hq, Nq, D]``, float32 ``lse`` ``[B, Hq, Nq]`` and the gradients of both. ``is_causal``: query
    i sees keys up to i (as many queries as keys). ``attn_mask``: SDPA's (boolean, True where a
    key is seen, or added to the scores), broadcasting against ``[B, Hq, Nq, Nk]``."""
    heads_kv = k.shape[1]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    bias = None if attn_mask is None else _additive(attn_mask, q)
    if _own_kernel(q, k, bias, grad_lse, is_causal):
        # (the op centers its K tiles and shifts the LSE itself; GQA: dK and dV per KV head)
        mean = k.mean(dim=2, keepdim=True, dtype=torch.float32)
        return _wgmma_kernel(grad_out, q, k, v, out, lse, mean, is_causal, scale)
    k, lse, mean = _center_keys(q, k, lse, scale)
    k_all, v_all = _expand_kv_heads(k, q.shape[1]), _expand_kv_heads(v, q.shape[1])
    kernel = _pytorch_kernel(q, bias, grad_lse)
    if kernel is not None:
        dq, dk, dv = _pytorch_kernels(kernel, grad_out, q, k_all, v_all, out, lse, is_causal,
                                      scale, bias)
    else:
        dq, dk, dv = _chunked(grad_out, q, k_all, v_all, out, lse, is_causal, scale, grad_lse,
                              bias)
    if grad_lse is not None:
        dq = (dq.float() + scale * grad_lse.float()[..., None] * mean.float()).to(q.dtype)
    return dq, _sum_groups(dk, heads_kv), _sum_groups(dv, heads_kv)


# SAGEATTN_BACKWARD_KERNEL=wgmma (opt-in, read at each call) runs our own exact backward kernel
# (csrc/hopper/backward) instead of PyTorch's where it serves the call: an sm_90 GPU, 16-bit
# inputs, head_dim 128, GQA, no mask, no LSE gradient, equal lengths when causal. Measured slower
# than cuDNN's: inside a 16K training step its kernels take 84.2 ms to cuDNN's 78.5 (0.93x; H200,
# session 44): the base of the 8-bit tier, not the default (docs/DECISIONS.md#d53).
_OWN_KERNEL_ENVIRONMENT = "SAGEATTN_BACKWARD_KERNEL"


def _own_kernel(q: Tensor, k: Tensor, bias: Tensor | None, grad_lse: Tensor | None,
                is_causal: bool) -> bool:
    return (os.environ.get(_OWN_KERNEL_ENVIRONMENT, "") == "wgmma" and bias is None
            and grad_lse is None and q.shape[-1] == 128 and k.shape[-1] == 128
            and q.shape[1] % k.shape[1] == 0
            and q.dtype in (torch.float16, torch.bfloat16)
            and (not is_causal or q.shape[2] == k.shape[2]) and _own_kernel_runs_on(q.device))


def _own_kernel_runs_on(device: torch.device) -> bool:
    """The kernel has sm_90a code only (other archs of the build compile it empty)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and ops.has_op("attention_backward_wgmma"))


def _wgmma_kernel(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  k_mean: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV from csrc/hopper/backward's kernel (k and v may have fewer heads: dK and dV
    per KV head) at the forward's natural-log ``lse``; the op subtracts ``k_mean`` ``[B, Hkv, 1,
    D]`` (float32) from K, each difference rounded once to k's dtype as in :func:`_center_keys`,
    shifts the LSE to match, and computes D = rowsum(dO * O)."""
    return torch.ops.sageattention2.attention_backward_wgmma(
        q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), grad_out.contiguous(),
        lse.float().contiguous(), k_mean.contiguous(), scale, is_causal)


def _center_keys(q: Tensor, k: Tensor, lse: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """K smoothing, as the forward does it (the paper's Sec. 3.2), for PyTorch's kernels and the
    float32 formulas: ``(k - mean, lse - scale q . mean, mean)``, the mean over K's tokens (in
    float32; float64 for float64 inputs), each difference rounded once to k's dtype, the LSE in
    float32 (float64) with +inf where it was -inf (a row that sees no key: P = 0 where
    exp(-inf - -inf) would be NaN), ``mean`` per query head ``[B, Hq, 1, D]``.

    Softmax is invariant to a shift of each score row: P and dS are the same. But dQ = scale dS
    (K - mean) drops scale rowsum(dS) mean, zero in exact arithmetic and not with the forward's
    quantized O and LSE: with K's channel offsets (the bias4 and outliers families) it took dQ's
    CosSim to 0.78 (session 40's first GPU run). (The LSE itself is not shift-invariant: a
    gradient g on it adds scale g mean to dQ.) On CUDA, one launch of the ``center_keys`` op; in
    PyTorch's ops a broadcast subtraction, a float32 copy of q and a GEMV took 1.9 ms of a 16K
    training step (B4 H32 hd128, H200, session 45)."""
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    mean = k.mean(dim=2, dtype=work)  # [B, Hkv, D]
    query_mean = _expand_kv_heads(mean[:, :, None], q.shape[1])
    if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and ops.has_op("center_keys")):
        k, lse = torch.ops.sageattention2.center_keys(
            kernel_input(q, q.shape[-1]), kernel_input(k, k.shape[-1]), lse.float().contiguous(),
            mean, scale)
    else:
        lse = lse.to(work) - scale * (q.to(work) * query_mean).sum(-1)
        lse = lse.masked_fill(lse == -torch.inf, torch.inf)
        k = (k.to(work) - mean[:, :, None]).to(k.dtype)
    return k, lse, query_mean


def _additive(attn_mask: Tensor, q: Tensor) -> Tensor:
    """SDPA's mask as a ``[B|1, H|1, Nq|1, Nk]`` bias added to the scores, in q's dtype: 0 where
    a boolean mask is True, -inf where it is False."""
    mask = attn_mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, -torch.inf)
    return mask.to(q.dtype)


def _pytorch_kernel(q: Tensor, bias: Tensor | None, grad_lse: Tensor | None) -> str | None:
    """Which of PyTorch's backward kernels serves: "cudnn", "flash" or None (the float32
    formulas: other devices and dtypes, a gradient on the LSE, a mask beyond cuDNN's
    head_dim)."""
    if grad_lse is not None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.shape[-1] <= _CUDNN_MAX_HEAD_DIM and torch.backends.cuda.cudnn_sdp_enabled():
        return "cudnn"
    return "flash" if bias is None and q.shape[-1] <= 256 else None


def _pytorch_kernels(kernel: str, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                     out: Tensor, lse: Tensor, is_causal: bool, scale: float,
                     bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch's cuDNN or FlashAttention-2 backward kernel on our O and LSE. Both read the
    operands with the last dimension contiguous, and dO in O's memory order. A mask's bias:
    cuDNN's only (FlashAttention-2's takes none), expanded to ``[B, H, Nq, Nk]`` as SDPA's own
    cuDNN path passes it."""
    q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, out))
    if grad_out.stride() != out.stride():
        grad_out = torch.empty_like(out).copy_(grad_out)  # O's strides
    n_q, n_k = q.shape[2], k.shape[2]
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # dropout's RNG state: none
    lse = lse.float().contiguous()
    if kernel == "cudnn":
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], n_q, n_k)
        # (None stands for the undefined sequence offsets: no varlen)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1), unused, unused, bias, None, None, n_q, n_k,
            0.0, is_causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, n_q, n_k, 0.0, is_causal, unused, unused,
        scale=scale)


def _chunked(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             is_causal: bool, scale: float, grad_lse: Tensor | None,
             bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
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
        if bias is not None:
            scores = scores + (bias if bias.shape[2] == 1 else bias[:, :, rows]).to(work)
        if is_causal:
            query = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(n_k, device=q.device) > query, -torch.inf)
        p = torch.exp(scores - lse[:, :, rows, None])
        dv += p.transpose(-1, -2) @ dow[:, :, rows]
        ds = p * (dow[:, :, rows] @ vw.transpose(-1, -2) - delta[:, :, rows, None])
        dq[:, :, rows] = ds @ kw * scale
        dk += ds.transpose(-1, -2) @ qw[:, :, rows] * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
