"""The authors' ``sageattention`` API on sageattention2's kernels: the one place where foreign
names and keywords become :func:`sageattn` arguments.

Most people who run SageAttention never call it themselves: ComfyUI, diffusers' ``sage*``
backends, yunchang/xDiT, SGLang's diffusion runtime and others ``import sageattention`` and call
the authors' functions (SageAttention 2.x) by their names. The opt-in ``sageattention``
distribution in ``compat/`` re-exports the functions below, so that those callers run our
kernels unchanged (README, "Replacing the authors' package").

Every keyword those callers pass is honoured or refused with a clear error, never dropped (the
authors' functions swallow unknown keywords: a mask, ``causal=`` or ``softmax_scale=`` passed
there is silently ignored):

- the authors' own: ``tensor_layout``, ``is_causal``, ``sm_scale``, ``return_lse``, ``smooth_k``,
  ``smooth_v``, ``qk_quant_gran``, ``pv_accum_dtype``, ``quantization_backend``; the LSE is the
  natural-log, float32 ``[B, H, N_q]`` of the true scores in both layouts (the K-smoothing
  correction included), as theirs;
- ``attn_mask`` (in the signature: ComfyUI sends masks only where it sees the parameter): any
  mask SDPA takes, as :func:`sageattn` serves it;
- flash-attn's, from ring and Ulysses wrappers (yunchang, xDiT): ``causal``, ``softmax_scale``,
  ``dropout_p``, ``deterministic``; and ``window_size``, ``softcap``, ``alibi_slopes``,
  ``return_softmax``/``return_attn_probs`` at their "off" values only.

What each name runs (the authors' per-kernel choices become ours; ``python -m sageattention2
explain`` or :func:`sageattention2.explain` says what a call runs):

| name | runs |
|---|---|
| ``sageattn`` | :func:`sageattn` as configured (``qk_quant="auto"``: the quantized kernel, or exact SDPA where it is measured faster) |
| ``sageattn_qk_int8_pv_fp8_cuda``, ``..._sm90`` | INT8 QK, FP8 PV (``qk_quant="int8", pv_quant="fp8"``) |
| ``sageattn_qk_int8_pv_fp16_cuda``, ``..._triton`` | INT8 QK, PV in the input dtype (``pv_quant="none"``) |
| ``sageattn_varlen`` | :func:`sageattention2.sageattn_varlen` |

``qk_quant_gran="per_warp"`` and the FP16 or FP32+FP16 ``pv_accum_dtype`` of the authors'
kernels are accepted and served more finely: our kernels quantize Q and K per thread and
accumulate PV in FP32 always (at least the accuracy asked for).
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ._varlen import sageattn_varlen as _sageattn_varlen
from .api import sageattn as _sageattn

__all__ = ["COMPAT_VERSION", "check_installation", "sageattn", "sageattn_qk_int8_pv_fp16_cuda",
           "sageattn_qk_int8_pv_fp16_triton", "sageattn_qk_int8_pv_fp8_cuda",
           "sageattn_qk_int8_pv_fp8_cuda_sm90", "sageattn_varlen"]

# The ``sageattention`` distribution's version: the authors' API level it answers to (diffusers'
# sage backends ask for >= 2.1.1), and a local label saying it is this package.
COMPAT_VERSION = "2.2.0+sageattention2"


@dataclass(frozen=True)
class _Function:
    """One of the authors' functions: what of sageattn it pins, and the values its own keywords
    take."""

    qk_quant: str
    pv_quant: str
    pv_accum_dtypes: tuple[str, ...]   # empty: the function has no such keyword


_FUNCTIONS = {
    "sageattn": _Function("auto", "auto", ()),
    "sageattn_qk_int8_pv_fp16_triton": _Function("int8", "none", ()),
    "sageattn_qk_int8_pv_fp16_cuda": _Function("int8", "none", ("fp32", "fp16", "fp16+fp32")),
    "sageattn_qk_int8_pv_fp8_cuda": _Function("int8", "fp8", ("fp32", "fp32+fp32", "fp32+fp16")),
    "sageattn_qk_int8_pv_fp8_cuda_sm90": _Function("int8", "fp8", ("fp32", "fp32+fp32")),
}
_QK_QUANT_GRANS = ("per_thread", "per_warp")
_QUANTIZATION_BACKENDS = ("triton", "cuda")

# flash-attn's keywords (yunchang, xDiT) at the values that mean "off": accepted; anything
# else is a feature sageattn does not have.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "window_size": (None, (-1, -1), [-1, -1]),
    "softcap": (None, 0, 0.0),
    "alibi_slopes": (None,),
    "return_softmax": (False, None),
    "return_attn_probs": (False, None),
}


def _translate(function: str, given: dict[str, Any]) -> dict[str, Any]:
    """The authors' keywords of ``function`` (``given``: every keyword of the call but q, k, v)
    as :func:`sageattn`'s; raises on a keyword or value it cannot honour."""
    spec = _FUNCTIONS[function]
    extra = dict(given.pop("kwargs"))
    for name, value in list(extra.items()):
        if name in _OFF_VALUES:
            if not any(value is off or (value == off and type(value) is type(off))
                       for off in _OFF_VALUES[name]):
                raise NotImplementedError(
                    f"{function}: {name}={value!r} is not supported by sageattention2 (only "
                    f"{' or '.join(repr(v) for v in _OFF_VALUES[name] if v is not None)} or None)")
            del extra[name]
    deterministic = extra.pop("deterministic", False)  # the forward is deterministic anyway
    if not isinstance(deterministic, bool):
        raise TypeError(f"{function}: deterministic must be a bool, got {deterministic!r}")
    causal = extra.pop("causal", None)      # flash-attn's names
    softmax_scale = extra.pop("softmax_scale", None)
    dropout_p = extra.pop("dropout_p", 0.0)
    if extra:
        raise TypeError(
            f"{function}() got unexpected keyword(s) {', '.join(sorted(extra))}; the authors' "
            f"sageattention API as sageattention2 serves it takes tensor_layout, is_causal, "
            f"sm_scale, return_lse, smooth_k, smooth_v, qk_quant_gran, pv_accum_dtype, attn_mask "
            f"and flash-attn's causal, softmax_scale, dropout_p, deterministic (and window_size, "
            f"softcap, alibi_slopes, return_softmax at their off values)")
    is_causal = given["is_causal"]
    if causal is not None:
        if given["is_causal_given"] and bool(causal) != bool(is_causal):
            raise ValueError(f"{function}: is_causal={is_causal!r} and causal={causal!r} disagree")
        is_causal = causal
    scale = given["sm_scale"]
    if softmax_scale is not None:
        if scale is not None and float(scale) != float(softmax_scale):
            raise ValueError(f"{function}: sm_scale={scale!r} and softmax_scale={softmax_scale!r} "
                             "disagree")
        scale = softmax_scale
    gran = given.get("qk_quant_gran", "per_thread")
    if gran not in _QK_QUANT_GRANS:
        raise ValueError(f"{function}: qk_quant_gran must be one of {', '.join(map(repr, _QK_QUANT_GRANS))}; "
                         f"got {gran!r}")
    accum = given.get("pv_accum_dtype")
    if accum is not None and accum not in spec.pv_accum_dtypes:
        raise ValueError(f"{function}: pv_accum_dtype must be one of "
                         f"{', '.join(map(repr, spec.pv_accum_dtypes))}; got {accum!r}")
    backend = given.get("quantization_backend", "triton")
    if backend not in _QUANTIZATION_BACKENDS:
        raise ValueError(f"{function}: quantization_backend must be one of "
                         f"{', '.join(map(repr, _QUANTIZATION_BACKENDS))}; got {backend!r}")
    smooth_v = given.get("smooth_v")
    options: dict[str, Any] = dict(
        attn_mask=given["attn_mask"], dropout_p=dropout_p, is_causal=bool(is_causal),
        scale=scale, tensor_layout=given["tensor_layout"], return_lse=given["return_lse"],
        smooth_k=given["smooth_k"], qk_quant=spec.qk_quant, pv_quant=spec.pv_quant)
    if smooth_v is not None:
        options["smooth_v"] = smooth_v
    return options


def _call(function: str, arguments: dict[str, Any]) -> Any:
    """``function``'s call, ``arguments`` its parameters by name (the wrapper's ``locals()``)."""
    given = dict(arguments)
    q, k, v = given.pop("q"), given.pop("k"), given.pop("v")
    given["is_causal_given"] = given["is_causal"] is not False
    return _run(function, q, k, v, given)


def _run(function: str, q: Tensor, k: Tensor, v: Tensor, given: dict[str, Any]) -> Any:
    options = _translate(function, given)
    layout = options["tensor_layout"]
    heads = 1 if layout == "HND" else 2
    # The authors' kernels take fewer key/value heads than query heads as they come (GQA).
    gqa = (isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == k.dim() == 4
           and q.shape[heads] != k.shape[heads])
    return _sageattn(q, k, v, enable_gqa=gqa, **options)


# The signatures are the authors' (their positional order and defaults), with ``attn_mask`` and
# ``**kwargs`` (translated above) after them.

def sageattn(q: Tensor, k: Tensor, v: Tensor, tensor_layout: str = "HND",
             is_causal: bool = False, sm_scale: float | None = None, return_lse: bool = False,
             attn_mask: Tensor | None = None, **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """The authors' ``sageattn``: :func:`sageattention2.sageattn` (its routing picks the kernel
    for the GPU; ``qk_quant="auto"``). ``q``, ``k``, ``v``: ``[B, H, N, D]`` (``"HND"``) or
    ``[B, N, H, D]`` (``"NHD"``); returns the output (and the natural-log LSE ``[B, H, N_q]``)."""
    # The authors' sageattn hands its **kwargs to the kernel it picks: smooth_k (ComfyUI passes
    # False), smooth_v and qk_quant_gran are that kernel's keywords.
    arguments = dict(locals(), smooth_k=kwargs.pop("smooth_k", True))
    for name in ("smooth_v", "qk_quant_gran"):
        if name in kwargs:
            arguments[name] = kwargs.pop(name)
    return _call("sageattn", arguments)


def sageattn_qk_int8_pv_fp16_triton(
        q: Tensor, k: Tensor, v: Tensor, tensor_layout: str = "HND",
        quantization_backend: str = "triton", is_causal: bool = False,
        sm_scale: float | None = None, smooth_k: bool = True, return_lse: bool = False,
        attn_mask: Tensor | None = None, **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """INT8 QK, PV in the input dtype (``quantization_backend``: either value, one quantizer)."""
    return _call("sageattn_qk_int8_pv_fp16_triton", locals())


def sageattn_qk_int8_pv_fp16_cuda(
        q: Tensor, k: Tensor, v: Tensor, tensor_layout: str = "HND", is_causal: bool = False,
        qk_quant_gran: str = "per_thread", sm_scale: float | None = None,
        pv_accum_dtype: str = "fp32", smooth_k: bool = True, smooth_v: bool = False,
        return_lse: bool = False, attn_mask: Tensor | None = None,
        **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """INT8 QK, PV in the input dtype with FP32 accumulation (``smooth_v`` has no effect: V is
    not quantized)."""
    return _call("sageattn_qk_int8_pv_fp16_cuda", locals())


def sageattn_qk_int8_pv_fp8_cuda(
        q: Tensor, k: Tensor, v: Tensor, tensor_layout: str = "HND", is_causal: bool = False,
        qk_quant_gran: str = "per_thread", sm_scale: float | None = None,
        pv_accum_dtype: str = "fp32+fp32", smooth_k: bool = True, smooth_v: bool = False,
        return_lse: bool = False, attn_mask: Tensor | None = None,
        **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """INT8 QK, FP8 PV with two-level FP32 accumulation."""
    return _call("sageattn_qk_int8_pv_fp8_cuda", locals())


def sageattn_qk_int8_pv_fp8_cuda_sm90(
        q: Tensor, k: Tensor, v: Tensor, tensor_layout: str = "HND", is_causal: bool = False,
        qk_quant_gran: str = "per_thread", sm_scale: float | None = None,
        pv_accum_dtype: str = "fp32+fp32", smooth_k: bool = True, return_lse: bool = False,
        attn_mask: Tensor | None = None, **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """INT8 QK, FP8 PV (the Hopper kernel on sm_90; elsewhere what sageattn routes there)."""
    return _call("sageattn_qk_int8_pv_fp8_cuda_sm90", locals())


def sageattn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                    max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False,
                    sm_scale: float | None = None, smooth_k: bool = True,
                    **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """The authors' ``sageattn_varlen``: :func:`sageattention2.sageattn_varlen` (``q``:
    ``[total_q, H, D]``, sequence i in ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``)."""
    given = dict(tensor_layout="NHD", is_causal=is_causal, sm_scale=sm_scale, smooth_k=smooth_k,
                 return_lse=kwargs.pop("return_lse", False), attn_mask=None,
                 is_causal_given=is_causal is not False, kwargs=kwargs)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("sageattn_varlen: attn_mask is not supported; the sequences' "
                                  "lengths are the mask (cu_seqlens_q, cu_seqlens_k)")
    kwargs.pop("attn_mask", None)
    options = _translate("sageattn", given)
    if options["dropout_p"]:
        raise NotImplementedError("sageattn_varlen: dropout_p > 0 is not supported")
    return _sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            is_causal=options["is_causal"], scale=options["scale"],
                            smooth_k=options["smooth_k"], return_lse=options["return_lse"])


# ------------------------------------------------------------------------------------------------
# Next to the authors' package: say so, never shadow it silently
# ------------------------------------------------------------------------------------------------

_AUTHORS_FILES = ("core.py", "quant.py", "triton")  # in the authors' package, not in ours


def check_installation(package_dir: str) -> list[str]:
    """What is wrong with the ``sageattention`` package imported from ``package_dir`` (the
    compat package's folder) standing where the authors' package may also be installed: another
    ``sageattention`` on ``sys.path`` that this one hides, the authors' files left in this folder,
    or the installed distribution's metadata being the authors'. Each is one sentence."""
    problems = []
    here = os.path.realpath(package_dir)
    for entry in sys.path:
        other = os.path.realpath(os.path.join(entry or os.getcwd(), "sageattention"))
        if other != here and os.path.isdir(other) and (
                os.path.exists(os.path.join(other, "__init__.py"))
                or any(os.path.exists(os.path.join(other, f)) for f in _AUTHORS_FILES)):
            problems.append(f"another 'sageattention' package at {other} (the authors'?) is "
                            f"hidden by sageattention2's drop-in at {here}")
    left = [f for f in _AUTHORS_FILES if os.path.exists(os.path.join(here, f))]
    if left:
        problems.append(f"files of the authors' sageattention ({', '.join(left)}) are mixed into "
                        f"sageattention2's drop-in at {here}: uninstall both and install one")
    try:
        version = importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is not None and not version.endswith("+sageattention2"):
        problems.append(f"the installed 'sageattention' distribution is version {version}, not "
                        f"sageattention2's drop-in ({COMPAT_VERSION}), yet its module is the "
                        f"drop-in's at {here}")
    return problems


def warn_about_installation(package_dir: str) -> None:
    """Warn once per problem :func:`check_installation` finds (at the import of the drop-in)."""
    for problem in check_installation(package_dir):
        warnings.warn(f"sageattention: {problem}", UserWarning, stacklevel=3)
