"""The public entry point, :func:`sageattn`, and :func:`kernel_plan`.

Every call goes through one validation step, :func:`_validate`, which checks the arguments,
turns q/k/v into canonical ``[B, H, N, D]`` views (no copies) and resolves the quantization
plan into an :class:`AttentionCall`. :func:`_kernel_for` alone decides which kernel serves it and
in which precisions (:class:`KernelChoice`: the Hopper ``attention_wgmma`` on sm_90, else the
warp-level ``attention_mma`` with INT8 or INT4 QK and FP8 or input-dtype PV);
:func:`_unsupported_reason` says whether the quantized kernels can serve the call at all, and
:func:`_quantized` runs the chosen kernel's preprocessing ops and attention op (docs/DESIGN.md).
A call the kernels cannot serve runs exact ``F.scaled_dot_product_attention`` (or raises, with
``strict=True``).
"""
from __future__ import annotations

import functools
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Literal, NamedTuple, Union, cast

import torch
from torch import Tensor

from . import ops

__all__ = ["AttentionCall", "SageAttentionFallbackWarning", "kernel_plan", "sageattn"]

TensorLayout = Literal["HND", "NHD"]
QKQuant = Literal["auto", "int8", "int4"]
PVQuant = Literal["auto", "fp8", "none"]
SmoothQ = Union[bool, Literal["auto", "head", "block"]]

TENSOR_LAYOUTS: tuple[str, ...] = ("HND", "NHD")
QK_QUANTS: tuple[str, ...] = ("auto", *ops.QK_DTYPES)
PV_QUANTS: tuple[str, ...] = ("auto", "fp8", "none")
SMOOTH_Q_MODES: tuple[str, ...] = ("auto", "head", "block")

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIM_MULTIPLE = 8
_MIN_CAPABILITY = (8, 0)  # mma.sync INT8 m16n8k32 and fp16/bf16 m16n8k16 with FP32 accumulation
# K's smoothing vector (and, on the Hopper path, V's with smooth_v) is a mean over at most this
# many tokens, a strided sample (smoothing_sample_stride): any vector subtracted from every key shifts
# each row of S by a constant (and V's mean is added back), so only the quantization error can
# change; the statistics launch then reads ~1/16 of K at 4K instead of all of it.
SMOOTHING_SAMPLE_TOKENS = 256
# What each attention kernel runs (kernel_plan).
MMA_PLAN = "per-thread quantized QK warp-level kernel (mma.sync)"
WGMMA_PLAN = "INT8 QK (per-thread, Q quantized in the kernel) + FP8 PV Hopper kernel (wgmma)"

# The builtin that F.scaled_dot_product_attention names. Bound here so that the fallback still
# reaches the exact kernel while F.scaled_dot_product_attention is patched to sageattn.
_exact_sdpa = torch._C._nn.scaled_dot_product_attention


class SageAttentionFallbackWarning(UserWarning):
    """sageattn computed a call with exact ``F.scaled_dot_product_attention``."""


class KernelChoice(NamedTuple):
    """The attention kernel that serves a call (:func:`_kernel_for`) and its precisions.

    ``kernel``: "wgmma" (the Hopper ``attention_wgmma``) or "mma" (the warp-level
    ``attention_mma``); ``qk``: the integer format of Q and K; ``pv``: "fp8" (P~ and V in E4M3,
    paper 3.3) or "input" (P and V in the input dtype, FP32 accumulation).
    """

    kernel: Literal["wgmma", "mma"]
    qk: Literal["int8", "int4"]
    pv: Literal["fp8", "input"]


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
    pv_quant: PVQuant
    smooth_q: Literal["auto", "head", "block", "none"]
    smooth_k: bool
    smooth_v: bool
    return_lse: bool
    strict: bool

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


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


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


def _smooth_q_mode(value: object) -> Literal["auto", "head", "block", "none"]:
    """Resolve smooth_q: False -> "none"; True -> "head"; "auto"/"head"/"block" as named ("auto"
    is the kernel's choice: none for INT8 QK, "head" for INT4 QK; :func:`_smooths_q`)."""
    if isinstance(value, bool):
        return "head" if value else "none"
    if isinstance(value, str) and value in SMOOTH_Q_MODES:
        return cast(Literal["auto", "head", "block"], value)
    raise ValueError(f"smooth_q must be True, False, 'auto', 'head' or 'block'; got {value!r}")


def _to_bhnd(t: Tensor, layout: str) -> Tensor:
    if t.dim() == 3:
        t = t.unsqueeze(0)
    return t.transpose(1, 2) if layout == "NHD" else t


def _validate(
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
) -> AttentionCall:
    """Check every argument of :func:`sageattn` and build the :class:`AttentionCall`."""
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
    gqa = _flag("enable_gqa", enable_gqa)

    names = {"HND": "[B, H, N, D] or [H, N, D]", "NHD": "[B, N, H, D] or [N, H, D]"}[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
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
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
        if t.dim() != q.dim():
            raise ValueError(f"{name} is {t.dim()}-D but q is {q.dim()}-D; they must match")

    qc, kc, vc = (_to_bhnd(t, layout) for t in (q, k, v))
    b, h_q, n_q, d = qc.shape
    _, h_kv, n_kv, d_k = kc.shape
    if kc.shape[0] != b or vc.shape[0] != b:
        raise ValueError(
            f"q, k and v must have the same batch size, got {b}, {kc.shape[0]}, {vc.shape[0]}"
        )
    if vc.shape[1] != h_kv:
        raise ValueError(f"k and v must have the same number of heads, got {h_kv} and "
                         f"{vc.shape[1]}")
    if vc.shape[2] != n_kv:
        raise ValueError(f"k and v must have the same sequence length, got {n_kv} and "
                         f"{vc.shape[2]}")
    if d_k != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {d_k}")
    if h_q != h_kv:
        if not gqa:
            raise ValueError(
                f"q has {h_q} heads but k and v have {h_kv}; pass enable_gqa=True for "
                "grouped-query attention"
            )
        if h_kv == 0 or h_q % h_kv != 0:
            raise ValueError(
                f"enable_gqa=True needs q's number of heads ({h_q}) to be a multiple of k's and "
                f"v's ({h_kv})"
            )

    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got "
                            f"{type(attn_mask).__name__}")
        if causal:
            raise ValueError("attn_mask and is_causal=True are mutually exclusive")
        if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
            raise TypeError(f"attn_mask must be bool, float32 or q's dtype ({q.dtype}), got "
                            f"{attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
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
        qk_quant=cast(Literal["int8", "int4"], "int8" if qk == "auto" else qk), pv_quant=pv,
        smooth_q=smooth_q_mode, smooth_k=_flag("smooth_k", smooth_k),
        smooth_v=_flag("smooth_v", smooth_v), return_lse=_flag("return_lse", return_lse),
        strict=_flag("strict", strict),
    )


# ------------------------------------------------------------------------------------------------
# What the quantized kernels can serve
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    # torch.cuda.is_available() reads the environment on every call (several microseconds of
    # each sageattn call, which is host-bound at short sequences); it does not change in a process.
    return torch.cuda.is_available()


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device``; None for any other device (without touching
    torch.cuda: a CPU call must not initialise CUDA) or when no GPU is available."""
    if device.type != "cuda" or not _cuda_available():
        return None
    return _capability(_cuda_index(device))


def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"the quantized kernels need CUDA tensors, got {device.type}"
    capability = _cuda_capability(device)
    if capability is None:
        return "no CUDA GPU is available"
    if capability < _MIN_CAPABILITY:
        return (f"the quantized kernels need a GPU of compute capability "
                f"{_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]} or newer, "
                f"got sm_{capability[0]}{capability[1]}")
    return None


def _family_archs(family: str) -> str:
    """The archs the build compiled kernel ``family`` for, as text."""
    info = ops.build_info()
    archs = [] if info is None else [a for key, built in info.kernels.items()
                                     if ops.kernel_family(key) == family for a in built]
    return ", ".join(archs) or "no architectures"


@functools.lru_cache(maxsize=None)
def _arch_reason(capability: tuple[int, int]) -> str | None:
    """The build has no attention_mma code that runs on ``capability`` (only checked when the
    build reports an attention_mma kernel family at all)."""
    info = ops.build_info()
    if info is None or not any(ops.kernel_family(f) == ops.MMA_FAMILY for f in info.kernels):
        return None
    if ops.family_runs_on(ops.MMA_FAMILY, capability):
        return None
    return (f"the attention kernel is not compiled for sm_{capability[0]}{capability[1]} "
            f"(built for {_family_archs(ops.MMA_FAMILY)})")


def _build_reason(device: torch.device | None = None) -> str | None:
    """The extension or its attention op is missing, or (for a CUDA ``device``) not compiled
    for its architecture."""
    if not ops.HAS_EXTENSION:
        return "the sageattention2._C extension is not available"
    if not ops.has_op("attention_mma"):
        return "the attention kernels are not built yet"
    capability = None if device is None else _cuda_capability(device)
    return None if capability is None else _arch_reason(capability)


@functools.lru_cache(maxsize=None)
def _wgmma_runs_on(capability: tuple[int, int]) -> bool:
    return ops.has_op("sageattn_wgmma") and ops.family_runs_on(ops.WGMMA_FAMILY, capability)


def _native_fp8_mma(capability: tuple[int, int]) -> bool:
    """FP8 mma.sync is a native tensor-core instruction (QMMA) on Ada (sm_89) and consumer
    Blackwell (sm_12x); sm_90 has it only emulated (ANCHORS.md), where the INT8 + FP8 variant
    measured 284 TOPS against 363 for INT8 + FP16 (H100, 4K, hd128; benchmarks/RESULTS.md)."""
    return capability == (8, 9) or capability[0] == 12


@functools.lru_cache(maxsize=None)
def _mma_fp8_runs_on(capability: tuple[int, int]) -> bool:
    """attention_mma's FP8 PV variants (INT8 and INT4 QK) run on ``capability``: FP8 mma.sync
    exists from sm_89 on, and the build compiles them only for those archs."""
    return ops.has_op("attention_mma") and ops.family_runs_on(ops.MMA_FP8_FAMILY, capability)


def _kernel_head_dim(head_dim: int) -> int | None:
    """The head_dim the attention kernels run a call of ``head_dim`` at: itself when they are
    built for it (ops.MMA_HEAD_DIMS, the Hopper kernel's as well), else the next larger one, the
    inputs zero-padded (a zero channel adds nothing to a score, so scores, softmax and LSE are
    unchanged, and its output channel, 0, is cut off). None when ``head_dim`` is not a positive
    multiple of 8 or above the largest."""
    if head_dim <= 0 or head_dim % _HEAD_DIM_MULTIPLE != 0:
        return None
    return next((d for d in sorted(ops.MMA_HEAD_DIMS) if d >= head_dim), None)


def _kernel_for(call: AttentionCall) -> KernelChoice:
    """The attention kernel that serves ``call`` and its precisions; the single place that
    decides (:func:`_kernel_reason` only checks what this picked, :func:`_quantized` runs it).

    The Hopper kernel on an sm_90 GPU whose build has it, for what it computes: INT8 QK with
    FP8 PV (pv_quant "auto" or "fp8"), no Q smoothing (smooth_q "auto" or off), head_dim 64/128
    after padding. Else the warp-level kernel with the requested QK format and FP8 PV when asked
    for (pv_quant="fp8"), when INT4 QK needs it (the INT4 variant exists with FP8 PV only), or
    for pv_quant="auto" where FP8 mma.sync is native (:func:`_native_fp8_mma`) and the build's
    attention_mma_fp8 code runs; otherwise PV in the input dtype. CPU calls never touch
    torch.cuda."""
    capability = _cuda_capability(call.q.device)
    if (call.qk_quant == "int8" and call.pv_quant in ("auto", "fp8")
            and call.smooth_q in ("auto", "none")
            and _kernel_head_dim(call.head_dim) in ops.WGMMA_HEAD_DIMS
            and capability is not None and _wgmma_runs_on(capability)):
        return KernelChoice("wgmma", "int8", "fp8")
    fp8 = (call.pv_quant == "fp8" or call.qk_quant == "int4"
           or (call.pv_quant == "auto" and capability is not None
               and _native_fp8_mma(capability) and _mma_fp8_runs_on(capability)))
    return KernelChoice("mma", call.qk_quant, "fp8" if fp8 else "input")


def _kernel_reason(call: AttentionCall, choice: KernelChoice) -> str | None:
    """What ``choice``, the kernel :func:`_kernel_for` picks, cannot do for ``call`` (the Hopper
    kernel is only picked for calls it serves; the warp-level kernel has these limits)."""
    if choice.kernel == "wgmma":
        return None
    if choice.qk == "int4" and call.pv_quant == "none":
        return "INT4 QK runs with FP8 PV only; pv_quant='none' needs qk_quant='int8'"
    if call.smooth_q == "block":
        return ("the attention kernel smooths Q per head, not per block (smooth_q='block'); "
                "smooth_q='head' (the default) is exact as well")
    capability = _cuda_capability(call.q.device)
    if choice.pv == "fp8" and capability is not None and not _mma_fp8_runs_on(capability):
        needs = ("qk_quant='int4' (INT4 QK runs with FP8 PV only)" if choice.qk == "int4"
                 else "pv_quant='fp8'")
        return (f"FP8 PV needs an sm_89+ GPU and a build with {ops.MMA_FP8_FAMILY} code for it "
                f"({needs}); this GPU is sm_{capability[0]}{capability[1]}, "
                f"{ops.MMA_FP8_FAMILY} is built for {_family_archs(ops.MMA_FP8_FAMILY)}")
    return None


def _unsupported_reason(call: AttentionCall, choice: KernelChoice | None = None) -> str | None:
    """Why the quantized path cannot serve ``call`` (with ``choice``, :func:`_kernel_for`'s pick,
    computed here when not given), or ``None`` when it can. The single place that decides
    between the quantized kernels and the exact fallback."""
    reason = _device_reason(call.q.device)
    if reason is not None:
        return reason
    if call.q.dtype not in _KERNEL_DTYPES:
        return f"the quantized kernels need float16 or bfloat16 inputs, got {call.q.dtype}"
    if call.dropout_p > 0.0:
        return "the quantized kernels have no dropout (dropout_p > 0)"
    if call.attn_mask is not None:
        return "the quantized kernels take no attn_mask"
    d = call.head_dim
    if _kernel_head_dim(d) is None:
        dims = " and ".join(map(str, ops.MMA_HEAD_DIMS))
        return (f"the attention kernels are built for head_dim {dims} (other multiples of "
                f"{_HEAD_DIM_MULTIPLE} below {max(ops.MMA_HEAD_DIMS)} are zero-padded to the "
                f"next), got {d}")
    if call.head_dim_v != d:
        return (f"the quantized kernels need v's head_dim to be q's and k's, got {call.head_dim_v} "
                f"and {d}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (call.q, call.k, call.v)):
        return "the inputs require grad and the quantized kernels have no backward"
    return _build_reason(call.q.device) or _kernel_reason(
        call, _kernel_for(call) if choice is None else choice)


_warned_reasons: set[str] = set()


def _warn_fallback_once(reason: str) -> None:
    if reason in _warned_reasons:
        return
    _warned_reasons.add(reason)
    warnings.warn(
        f"sageattn is computing exact F.scaled_dot_product_attention instead of quantized "
        f"attention: {reason}. This warning is shown once per reason; pass strict=True to raise.",
        SageAttentionFallbackWarning,
        stacklevel=3,  # the caller of sageattn
    )


# ------------------------------------------------------------------------------------------------
# Execution
# ------------------------------------------------------------------------------------------------


def _empty(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    b, h, n_q, _ = call.q.shape
    out = call.q.new_zeros((b, h, n_q, call.head_dim_v))
    lse = call.q.new_full((b, h, n_q), -math.inf, dtype=torch.float32) if call.return_lse else None
    return call.result(out, lse)


def _exact(call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
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
        q, k, v, choice.qk, choice.pv, _smooths_q(call, choice), call.smooth_k, call.smooth_v,
        smoothing_sample_stride(k.shape[2]), sm_scale, call.is_causal,
        call.tensor_layout == "NHD", call.return_lse,
    )


def _smooths_q(call: AttentionCall, choice: KernelChoice) -> bool:
    """Whether the warp-level kernel smooths Q (per head) for ``call``: as asked, and for
    smooth_q="auto" with INT4 QK only, whose 4-bit codes need it (paper 3.2: smoothing Q at least
    halves INT4's error on inputs with channel offsets). INT8 QK is accurate without it (the
    Hopper kernel's choice too), and then Q takes no pass before the kernel at all."""
    return call.smooth_q == "head" or (call.smooth_q == "auto" and choice.qk == "int4")


def _quantized(call: AttentionCall, choice: KernelChoice) -> Tensor | tuple[Tensor, Tensor]:
    """Serve ``call`` with ``choice``, the quantized kernel :func:`_kernel_for` picks (only after
    :func:`_unsupported_reason` said it can), at the kernel's head_dim (the only place that pads
    and cuts back)."""
    head_dim = call.head_dim
    kernel_head_dim = _kernel_head_dim(head_dim)
    assert kernel_head_dim is not None  # _unsupported_reason checked it
    # The softmax scale of the true head_dim: padding must not change the scores.
    sm_scale = 1.0 / math.sqrt(head_dim) if call.scale is None else call.scale
    q, k, v = (_kernel_input(t, kernel_head_dim) for t in (call.q, call.k, call.v))
    if choice.kernel == "wgmma":
        out, lse = _wgmma(call, q, k, v, sm_scale)
    else:
        out, lse = _mma(call, choice, q, k, v, sm_scale)
    if kernel_head_dim != head_dim:
        out = _unpad_head_dim(out, head_dim, call.tensor_layout == "NHD")
    return call.result(out, lse if call.return_lse else None)


def sageattn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    smooth_v: bool = False,
    return_lse: bool = False,
    strict: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Quantized attention (SageAttention2), a drop-in for ``F.scaled_dot_product_attention``.

    The parameters up to ``enable_gqa`` are SDPA's, in SDPA's order (SDPA takes ``scale`` and
    ``enable_gqa`` by keyword only; sageattn also positionally), so
    ``F.scaled_dot_product_attention = sageattn`` works, and so does
    :func:`sageattention2.integrations.patch_sdpa`.

    Args:
        q, k, v: float16/bfloat16 (quantized path) or float32/float64 (exact fallback) tensors on
            one device. 4-D ``[B, H, N, D]`` or 3-D ``[H, N, D]`` with ``tensor_layout="HND"``;
            ``[B, N, H, D]`` or ``[N, H, D]`` with ``"NHD"``. All three have the same rank and
            batch size; k and v the same heads and length; q and k the same head_dim (v's may
            differ, which only the fallback serves).
        attn_mask: bool (True = attend) or additive float mask broadcasting to
            ``[..., H_q, N_q, N_kv]`` (always in this order, whatever ``tensor_layout``).
            Served by the fallback only.
        dropout_p: in ``[0, 1)``; > 0 is served by the fallback only (applied as SDPA does).
        is_causal: causal mask aligned to the top-left, as SDPA: query i sees keys j <= i (also
            when N_q != N_kv). Exclusive with ``attn_mask``.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        enable_gqa: allow fewer k/v heads than q heads (H_q a multiple of H_kv); as in SDPA,
            unequal head counts without it are an error.
        tensor_layout: ``"HND"`` or ``"NHD"`` (see q, k, v). The output uses the same layout.
        qk_quant: ``"int8"``, ``"int4"`` or ``"auto"`` (INT8) for Q and K. INT4 (paper 3.2) is
            about 4x coarser: on inputs without channel offsets its error is several times
            INT8's; smoothing Q and K (the defaults) is what makes it usable. It runs with FP8
            PV only, on sm_89+ GPUs (fast on Ada; emulated by the H100's tensor cores).
        pv_quant: ``"fp8"``: P~ and V in E4M3 (paper 3.3: P~ times 448, V per channel), FP32
            accumulation per 128-key tile folded into the FP32 output; ``"none"``: P and V in
            the input dtype with FP32 accumulation (more accurate, and the only PV of GPUs
            without FP8 tensor cores); ``"auto"`` (default): FP8 on the Hopper kernel and where
            FP8 mma.sync is native (Ada sm_89, consumer Blackwell sm_12x, with a build that has
            the FP8 code for it), else the input dtype (also for the warp-level kernel on
            sm_90, whose FP8 mma.sync is emulated: slower and less accurate than FP16 there).
        smooth_k: subtract K's per-head mean before quantizing (exact: softmax is invariant to it).
        smooth_q: ``"head"`` (one mean per head, corrected exactly by Delta-S), ``"block"`` (the
            paper's per-Q-block mean; no kernel, fallback), ``False``, or ``"auto"`` (off for
            INT8 QK, "head" for INT4 QK, whose 4-bit codes need it). ``True`` means ``"head"``.
        smooth_v: subtract V's per-channel mean before FP8 quantization (paper A.3; added back to
            the output). Only matters with FP8 PV; with PV in the input dtype V is not
            quantized and it has no effect.
        return_lse: also return the float32 log-sum-exp of the scaled scores (natural log),
            ``[B, H_q, N_q]`` (``[H_q, N_q]`` for 3-D inputs) in either layout; ``-inf`` for a
            query that sees no key.
        strict: raise ``NotImplementedError`` instead of falling back to exact attention.

    Returns:
        The attention output with q's shape except the last dimension, ``D_v``, contiguous in
        the input layout, in q's dtype; ``(out, lse)`` with ``return_lse=True``.

    Quantized path: CUDA float16/bfloat16 inputs on a GPU of compute capability 8.0 or newer,
    head_dim a multiple of 8 up to 128 (v's the same). The kernels are built for head_dim 64 and
    128; a smaller head_dim is zero-padded to the next of them (a copy of q, k and v; the scores,
    with the softmax scale of the true head_dim, and the LSE are unchanged) and the output cut
    back. Which kernel runs (``kernel_plan`` says it for a GPU):

    * sm_90 with the Hopper build, ``qk_quant`` INT8, ``pv_quant`` "auto"/"fp8", ``smooth_q``
      "auto"/off: ``attention_wgmma`` (INT8 QK with Q quantized in the kernel, FP8 PV);
    * otherwise the warp-level ``attention_mma`` (Q quantized in the kernel), after
      ``smoothing_stats`` (K's mean, Q's per-head mean when Q is smoothed, V's per-channel
      range and mean for FP8 PV) and ``quantize_kv`` (per-thread INT8/INT4 K, FP8 V;
      docs/DESIGN.md): INT8 QK with FP8 PV (sm_89+) or PV in the input dtype
      (``pv_quant="none"``, or any GPU without FP8), INT4 QK with FP8 PV (``qk_quant="int4"``,
      sm_89+).

    The output is written in the input layout. Inputs whose strides the kernels cannot read in
    place (last dimension not contiguous, other strides not multiples of 8 elements, not 16-byte
    aligned) are copied first.

    Fallback: a call the quantized kernels cannot serve (CPU tensors, float32/float64, a GPU
    older than sm_80, dropout, any attn_mask, a head_dim above 128 or not a multiple of 8,
    differing v head_dim, inputs requiring grad while grad is enabled, ``smooth_q="block"``,
    ``qk_quant="int4"`` with ``pv_quant="none"``, FP8 PV (``pv_quant="fp8"`` or
    ``qk_quant="int4"``) on a GPU without the FP8 code (older than sm_89), a build without the
    attention kernel) is computed by exact ``F.scaled_dot_product_attention`` with the same
    arguments, in the input dtype, with a :class:`SageAttentionFallbackWarning` the first time
    each reason occurs. ``strict=True`` raises ``NotImplementedError`` naming the reason instead.
    The lse of the fallback is computed exactly (float64 reference, cast to float32).

    Empty inputs (B, H, N_q or D_v zero) return a correctly shaped empty output without computing
    anything; with no keys (N_kv = 0) the output is zeros (what SDPA returns on CPU) and lse is
    ``-inf``. Neither falls back, warns nor raises with ``strict=True``; the empty output does not
    track autograd.

    NaN/Inf: the fallback behaves exactly like SDPA (a NaN in q row i poisons output row i; a NaN or
    Inf in k or v poisons every output row that attends to that key). The quantized path shares one
    scale per quantization group, computed from the group's max |x|, so a NaN or Inf poisons its
    whole group: in q, every row of its Q group (docs/DESIGN.md; one row on the Hopper kernel), and
    with smooth_q every row of its Q block ("block") or head ("head"); in k, every key of its K
    group, and with smooth_k (the default) every key of the head, hence every output row of the
    head; in v with the warp-level kernels' FP8 PV (one scale per channel over all keys), that
    channel of every output row of the head, and on the Hopper kernel (one scale per 128-key tile)
    every channel of the output rows that attend to that tile; in v with PV in the input dtype, the
    output rows that attend to that key, and possibly the other rows of the same query tile (a
    masked key is multiplied by 0, and 0 * NaN is NaN). Inputs are not checked for non-finite
    values.
    """
    compiling = torch.compiler.is_compiling()
    if compiling and not (torch.is_grad_enabled() and any(
            isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, attn_mask))):
        # What torch.compile traces: one sageattention2::sageattn op (no graph break: the kernel
        # choice below asks the build and the GPU, and the view check reads pointers).
        smooth_q_arg = _SMOOTH_Q_BOOL[smooth_q] if isinstance(smooth_q, bool) else smooth_q
        out, lse = torch.ops.sageattention2.sageattn(
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, tensor_layout, qk_quant,
            pv_quant, smooth_k, smooth_q_arg, smooth_v, return_lse, strict)
        return (out, lse) if return_lse else out
    call = _validate(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        tensor_layout, qk_quant, pv_quant, smooth_k, smooth_q, smooth_v, return_lse, strict,
    )
    if compiling:  # inputs that require grad: eager mode's exact fallback, traced (differentiable)
        return _exact(call)
    if call.is_empty:
        return _empty(call)
    choice = _kernel_for(call)
    reason = _unsupported_reason(call, choice)
    if reason is None:
        return _quantized(call, choice)
    if call.strict:
        raise NotImplementedError(
            f"sageattn(strict=True): the quantized kernels cannot serve this call: {reason}"
        )
    _warn_fallback_once(reason)
    return _exact(call)


# ------------------------------------------------------------------------------------------------
# Under torch.compile
# ------------------------------------------------------------------------------------------------

# smooth_q's booleans as the string the graph op takes (an op argument has one type); every
# string a caller passes stays as it is and is validated as in eager mode.
_SMOOTH_Q_BOOL = {True: ":true", False: ":false"}


def _smooth_q_from_op(value: str) -> SmoothQ | str:
    return {":true": True, ":false": False}.get(value, value)


@torch.library.custom_op(
    "sageattention2::sageattn", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float dropout_p, bool is_causal, "
           "float? scale, bool enable_gqa, str tensor_layout, str qk_quant, str pv_quant, "
           "bool smooth_k, str smooth_q, bool smooth_v, bool return_lse, bool strict) "
           "-> (Tensor, Tensor)")
def _sageattn_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                 is_causal: bool, scale: float | None, enable_gqa: bool, tensor_layout: str,
                 qk_quant: str, pv_quant: str, smooth_k: bool, smooth_q: str, smooth_v: bool,
                 return_lse: bool, strict: bool) -> tuple[Tensor, Tensor]:
    """sageattn as one opaque op of a torch.compile graph: the eager call (its kernel choice
    asks the build and the GPU, and it checks pointers: nothing dynamo can trace), returning
    out contiguous in the caller's layout (as the fake implementation says) and lse, empty
    unless ``return_lse``."""
    result = sageattn(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      tensor_layout=cast(TensorLayout, tensor_layout),
                      qk_quant=cast(QKQuant, qk_quant), pv_quant=cast(PVQuant, pv_quant),
                      smooth_k=smooth_k, smooth_q=cast(SmoothQ, _smooth_q_from_op(smooth_q)),
                      smooth_v=smooth_v, return_lse=return_lse, strict=strict)
    if return_lse:
        out, lse = result
        return out.contiguous(), lse.contiguous()
    assert isinstance(result, Tensor)
    return result.contiguous(), q.new_empty(0, dtype=torch.float32)


@_sageattn_op.register_fake
def _sageattn_op_fake(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                      tensor_layout: str, qk_quant: str, pv_quant: str, smooth_k: bool,
                      smooth_q: str, smooth_v: bool, return_lse: bool,
                      strict: bool) -> tuple[Tensor, Tensor]:
    """The graph op's shapes, after the eager call's own validation (bad arguments raise while
    tracing, with eager mode's messages): out has q's shape but v's head_dim, lse is
    ``[B, Hq, Nq]`` (``[Hq, Nq]`` for 3-D inputs) float32 or empty."""
    call = _validate(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, tensor_layout,
                     qk_quant, pv_quant, smooth_k, _smooth_q_from_op(smooth_q), smooth_v,
                     return_lse, strict)
    out = q.new_empty((*q.shape[:-1], call.head_dim_v))
    b, h_q, n_q, _ = call.q.shape
    lse_shape = (b, h_q, n_q)[4 - call.input_ndim:] if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------
# Kernel plan
# ------------------------------------------------------------------------------------------------


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _mma_variants(capability: tuple[int, int]) -> str:
    """The variants of the warp-level kernel that run on ``capability`` (kernel_plan)."""
    if _mma_fp8_runs_on(capability) and _native_fp8_mma(capability):
        return ("INT8 QK + FP8 PV (pv_quant='none': FP16/BF16 PV), "
                "INT4 QK + FP8 PV with qk_quant='int4'")
    if _mma_fp8_runs_on(capability):
        return ("INT8 QK + FP16/BF16 PV (pv_quant='fp8': INT8 QK + FP8 PV, emulated FP8 "
                "mma.sync here), INT4 QK + FP8 PV with qk_quant='int4' (emulated)")
    return "INT8 QK + FP16/BF16 PV (FP8 PV and INT4 QK need sm_89+)"


def kernel_plan(device: torch.device | str | int | None = None) -> str:
    """What :func:`sageattn` runs for float16/bfloat16 inputs on ``device`` (default: the current
    CUDA device, else the CPU), and which kernels the extension has for it. A call the kernel
    cannot serve (see :func:`sageattn`, "Fallback") still runs exact SDPA."""
    dev = _resolve_device(device)
    reason = _device_reason(dev) or _build_reason(dev)
    capability = _cuda_capability(dev)
    dims = (f"head_dim {' and '.join(map(str, ops.MMA_HEAD_DIMS))} (smaller multiples of "
            f"{_HEAD_DIM_MULTIPLE} zero-padded)")
    if reason or capability is None:
        plan = f"exact SDPA fallback ({reason or 'the quantized kernels need a CUDA GPU'})"
    elif _wgmma_runs_on(capability):
        plan = (f"quantized SageAttention2: {WGMMA_PLAN}, {dims}, INT8 without Q smoothing; the "
                f"{MMA_PLAN} for smooth_q='head'/True, pv_quant='none' or qk_quant='int4': "
                f"{_mma_variants(capability)} (other calls: exact SDPA)")
    else:
        plan = (f"quantized SageAttention2: {MMA_PLAN}: {_mma_variants(capability)}, {dims} "
                f"(other calls: exact SDPA)")
    info = ops.build_info()
    if capability is None or info is None:
        return plan
    arch = f"sm_{capability[0]}{capability[1]}"
    kernels = ops.kernels_for_capability(capability)
    if not kernels:
        built = ", ".join(info.archs) or "no architectures"
        return f"{plan}; no kernels compiled for {arch} (built for {built})"
    listed = ", ".join(f"{family} [{', '.join(archs)}]" for family, archs in kernels.items())
    return f"{plan}; kernels for {arch}: {listed}"
