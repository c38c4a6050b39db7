"""The compiled extension and its three preprocessing ops.

``sageattention2._C`` registers the ops of ``docs/DESIGN.md`` (namespace ``sageattention2``) with
their CUDA implementations. This module

* loads the extension (``HAS_EXTENSION``; ``EXTENSION_ERROR`` says why it is missing),
* wraps the ops in typed functions returning named tuples,
* registers, for each op, a CPU implementation calling the pure-PyTorch reference
  (``sageattention2.reference``), so ``torch.library.opcheck`` runs on machines without a GPU.
  Output shapes for FakeTensor / ``torch.compile`` come from the extension's own Meta kernels
  (``csrc/preprocess_shapes.cpp``, SymInt-aware, so dynamic sequence lengths trace once): the
  one place that knows the shapes,
* reads ``_C.build_info()`` (which kernels were compiled for which GPU architectures).

Everything is registered only when the extension loaded: without it the ops do not exist.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

try:
    _C: Any = importlib.import_module(f"{__package__}._C")
except (ImportError, OSError) as _error:  # missing build, or a build against another torch/CUDA
    _C = None
    HAS_EXTENSION = False
    EXTENSION_ERROR: str | None = f"{type(_error).__name__}: {_error}"
else:
    HAS_EXTENSION = True
    EXTENSION_ERROR = None

__all__ = [
    "EXTENSION_ERROR",
    "HAS_EXTENSION",
    "OP_NAMES",
    "QK_DTYPES",
    "BuildInfo",
    "QuantizedKV",
    "QuantizedQ",
    "SmoothingStats",
    "arch_runs_on",
    "build_info",
    "kernels_for_capability",
    "quantize_kv",
    "quantize_q",
    "smoothing_stats",
]

NAMESPACE = "sageattention2"
OP_NAMES = ("smoothing_stats", "quantize_q", "quantize_kv")
QK_DTYPES = ("int8", "int4")
# Absent outputs are empty float32 tensors of shape [0] (DESIGN.md).


class SmoothingStats(NamedTuple):
    q_mean: Tensor  # [B, Hq, D] f32, or [0]
    k_mean: Tensor  # [B, Hkv, D] f32, or [0]
    v_mean: Tensor  # [B, Hkv, Dv] f32 (smooth_v only), or [0]
    v_scale: Tensor  # [B, Hkv, Dv] f32, or [0]


class QuantizedQ(NamedTuple):
    q_quant: Tensor  # [B, Hq, Nq_pad, D] int8 (int4: D/2 packed)
    q_scale: Tensor  # [B, Hq, Nq_pad/block_q, warps*8] f32
    q_block_mean: Tensor  # [B, Hq, Nq_pad/block_q, D] f32 ("block" smoothing), or [0]


class QuantizedKV(NamedTuple):
    k_quant: Tensor  # [B, Hkv, Nk_pad, D] int8 (int4: D/2 packed)
    k_scale: Tensor  # [B, Hkv, Nk_pad/block_k, 4] f32
    v_fp8: Tensor  # [B, Hkv, Dv, Nk_pad] float8_e4m3fn, or [0]
    delta_s: Tensor  # [B, Hq, Nk_pad] f32, or [0]


def _require_extension() -> None:
    if not HAS_EXTENSION:
        raise RuntimeError(f"the sageattention2._C extension is not available ({EXTENSION_ERROR})")


# --------------------------------------------------------------------------------------------
# Typed wrappers (argument order and names of the op schemas in DESIGN.md)
# --------------------------------------------------------------------------------------------


def smoothing_stats(
    q: Tensor | None, k: Tensor | None, v: Tensor | None, smooth_v: bool
) -> SmoothingStats:
    """Per-head means of Q and K, and V's mean (if ``smooth_v``) and per-channel FP8 scale."""
    _require_extension()
    return SmoothingStats(*torch.ops.sageattention2.smoothing_stats.default(q, k, v, smooth_v))


def quantize_q(
    q: Tensor,
    q_mean: Tensor | None,
    block_q: int,
    warps: int,
    qk_dtype: str,
    smooth_block: bool,
    scale_multiplier: float,
) -> QuantizedQ:
    """Quantize Q per thread group (INT8 or packed INT4), padded to ``block_q`` rows."""
    _require_extension()
    return QuantizedQ(
        *torch.ops.sageattention2.quantize_q.default(
            q, q_mean, block_q, warps, qk_dtype, smooth_block, scale_multiplier
        )
    )


def quantize_kv(
    k: Tensor,
    v: Tensor | None,
    k_mean: Tensor | None,
    v_mean: Tensor | None,
    v_scale: Tensor | None,
    q_mean: Tensor | None,
    block_k: int,
    qk_dtype: str,
    delta_s_multiplier: float,
) -> QuantizedKV:
    """Quantize K (INT8/INT4), V (FP8, transposed and permuted) and compute Delta-S."""
    _require_extension()
    return QuantizedKV(
        *torch.ops.sageattention2.quantize_kv.default(
            k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk_dtype, delta_s_multiplier
        )
    )


# --------------------------------------------------------------------------------------------
# CPU implementations: the pure-PyTorch reference (for opcheck / CI without a GPU)
# --------------------------------------------------------------------------------------------


def _register_python_impls() -> None:
    """Register the reference functions (same signatures as the ops) as CPU implementations,
    unless the extension has CPU kernels of its own."""
    from . import reference

    for name in OP_NAMES:
        qualname = f"{NAMESPACE}::{name}"
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"):
            continue
        impl = getattr(reference, f"{name}_reference")
        torch.library.register_kernel(qualname, "cpu", lambda *args, _impl=impl: tuple(_impl(*args)))


if HAS_EXTENSION:
    _register_python_impls()


# --------------------------------------------------------------------------------------------
# Build information
# --------------------------------------------------------------------------------------------


class BuildInfo(NamedTuple):
    cuda_version: str
    archs: list[str]  # e.g. ["sm_80", "sm_89", "sm_90a"]
    kernels: dict[str, list[str]]  # kernel family -> archs it was compiled for


def build_info() -> BuildInfo | None:
    """What the extension was built with, or ``None`` when it is not available."""
    if _C is None:
        return None
    raw: Mapping[str, Any] = _C.build_info()
    return BuildInfo(
        cuda_version=str(raw.get("cuda_version", "unknown")),
        archs=[str(a) for a in raw.get("archs", [])],
        kernels={str(k): [str(a) for a in v] for k, v in dict(raw.get("kernels", {})).items()},
    )


_ARCH_RE = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether code compiled for ``arch`` ("sm_89", "sm_90a", "compute_80", ...) runs on a GPU
    of compute ``capability`` (major, minor).

    Cubins (``sm_XY``) run on the same major with an equal or higher minor; arch-specific ones
    (``sm_90a``) only on that exact capability; family-specific ones (``sm_100f``) on the same
    major with an equal or higher minor; PTX (``compute_XY``) is JIT-compiled for any equal or
    newer capability.
    """
    match = _ARCH_RE.match(arch)
    if match is None:
        return False
    kind, number, suffix = match.groups()
    built = (int(number) // 10, int(number) % 10)
    if suffix == "a":
        return built == capability
    if kind == "compute":
        return built <= capability
    return built[0] == capability[0] and built[1] <= capability[1]


def kernels_for_capability(capability: tuple[int, int]) -> dict[str, list[str]]:
    """Kernel families of the extension with code that runs on ``capability``, and those archs."""
    info = build_info()
    if info is None:
        return {}
    usable = {
        family: [a for a in archs if arch_runs_on(a, capability)]
        for family, archs in info.kernels.items()
    }
    return {family: archs for family, archs in usable.items() if archs}
