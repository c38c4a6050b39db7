"""The compiled extension: its two preprocessing ops, the two attention ops, and each kernel's
path of sageattn as one op (``sageattn_wgmma``, ``sageattn_mma``: statistics, quantize_kv and the
attention op).

``sageattention2._C`` registers the ops of ``docs/DESIGN.md#ops`` (namespace ``sageattention2``)
with their CUDA implementations. This module

* loads the extension (``HAS_EXTENSION``; ``EXTENSION_ERROR`` says why it is missing),
* wraps the ops in typed functions returning named tuples,
* registers, for each preprocessing op, a CPU implementation calling the pure-PyTorch reference
  (``sageattention2.reference``), so ``torch.library.opcheck`` runs on machines without a GPU
  (the attention ops have CUDA and Meta implementations only; ``has_op`` says whether the loaded
  build registers one; the CPU implementations of ``sageattn_wgmma`` and ``sageattn_mma`` are
  their chains of ops, :func:`sageattn_wgmma_chain` and :func:`sageattn_mma_chain`).
  Output shapes for FakeTensor / ``torch.compile`` come from the extension's own Meta kernels
  (``csrc/torch/preprocess_shapes.cpp``, ``attention_shapes.cpp``, SymInt-aware, so dynamic sequence lengths trace once): the
  one place that knows the shapes,
* reads ``_C.build_info()`` (which kernels were compiled for which GPU architectures).

Everything is registered only when the extension loaded: without it the ops do not exist.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._key_ranges import item_ranges

def _python_sources(folder: Path) -> dict[str, bytes]:
    return {path.name: hashlib.sha256(path.read_bytes()).digest()
            for path in sorted(folder.glob("*.py"))}


def _installed_extension() -> tuple[Path | None, str]:
    """Where this package is a source folder without a compiled extension (a checkout: run from
    its root, Python finds the sources before the installed package), the extension of the
    installed ``sageattention2`` distribution when its Python sources are this folder's; else
    None and the one sentence that says what to do."""
    here = Path(__file__).resolve().parent
    # Every sageattention2 on sys.path: the checkout's root, first there, holds the metadata
    # (sageattention2.egg-info, no extension listed) that `pip install .` leaves in the tree.
    distributions = list(importlib.metadata.distributions(name="sageattention2"))
    if not distributions:
        return None, "not installed: pip install --no-build-isolation ."
    built = [(distribution, f) for distribution in distributions for f in distribution.files or ()
             if f.name.startswith("_C.") and f.suffix in (".so", ".pyd")
             and f.parent.name == "sageattention2"]
    if not built:
        return None, "the installed sageattention2 has no compiled extension (built without CUDA?)"
    extension = Path(str(built[0][0].locate_file(built[0][1]))).resolve()
    if extension.parent == here or not extension.exists():
        return None, f"{extension} is missing"
    if _python_sources(extension.parent) != _python_sources(here):
        return None, (f"this is the source folder {here}, which has no build, and the installed "
                      f"copy at {extension.parent} has other Python sources: reinstall "
                      f"(pip install --no-build-isolation .) or run from another directory")
    return extension, ""


def _load_extension() -> tuple[Any, str | None]:
    """The extension module and None, or None and why it is missing."""
    name = f"{__package__}._C"
    try:
        return importlib.import_module(name), None
    except ModuleNotFoundError as error:  # no build here: perhaps the installed copy's
        if error.name != name:
            return None, f"{type(error).__name__}: {error}"
        missing = f"{type(error).__name__}: {error}"
    except (ImportError, OSError) as error:  # a build against another torch/CUDA
        return None, f"{type(error).__name__}: {error}"
    extension, why = _installed_extension()
    if extension is None:
        return None, f"{missing} ({why})"
    spec = importlib.util.spec_from_file_location(name, extension)
    if spec is None or spec.loader is None:
        return None, f"{missing} (cannot load {extension})"
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (ImportError, OSError) as error:
        return None, f"{type(error).__name__}: {error} (loading {extension})"
    sys.modules[name] = module
    return module, None


_C, EXTENSION_ERROR = _load_extension()
HAS_EXTENSION = _C is not None

__all__ = [
    "EXTENSION_ERROR",
    "HAS_EXTENSION",
    "OP_NAMES",
    "QK_DTYPES",
    "BuildInfo",
    "QuantizedKV",
    "SmoothingStats",
    "MMA_BLOCK_K",
    "MMA_BLOCK_Q",
    "MMA_FAMILY",
    "MMA_FP8_FAMILY",
    "MMA_HEAD_DIMS",
    "MMA_WARPS",
    "PREPROCESS_FAMILY",
    "WGMMA_BLOCK_K",
    "WGMMA_FAMILY",
    "WGMMA_HEAD_DIMS",
    "WGMMA_INPUT_PV_HEAD_DIMS",
    "arch_runs_on",
    "attention_mma",
    "attention_wgmma",
    "build_info",
    "copy_many_",
    "family_runs_on",
    "has_op",
    "kernel_family",
    "kernels_for_capability",
    "merge_attention_parts",
    "quantize_kv",
    "readable_in_place",
    "sageattn_mma",
    "sageattn_mma_varlen",
    "sageattn_wgmma",
    "sageattn_wgmma_varlen",
    "signal_flags_",
    "smoothing_stats",
    "wait_flags_",
]

NAMESPACE = "sageattention2"
# The attention kernels work in base 2: sm_scale * LOG2E (one double product, rounded once where
# a kernel takes it) is what sageattn folds into the Q scales and the Delta-S of Q smoothing.
LOG2E = math.log2(math.e)
OP_NAMES = ("smoothing_stats", "quantize_kv")
QK_DTYPES = ("int8", "int4")
# Tile geometry of the warp-level attention kernel (csrc/mma/params.h: kMmaBlockQ, kMmaWarps,
# kMmaBlockK): it quantizes Q itself in the groups of reference.quantize_q_reference(
# block_q=MMA_BLOCK_Q, warps=MMA_WARPS) and takes quantize_kv(block_k=MMA_BLOCK_K): the
# per-thread groups each thread dequantizes with.
# tests/test_ops_compile.py checks that these match the C++ constants.
MMA_BLOCK_Q = 128
MMA_WARPS = 8
MMA_BLOCK_K = 128
# How its INT8 QK + fp16/bf16 PV variant runs (kMmaInputPvWarps, kMmaInputPvTileK,
# kMmaLazyRescaleLog2): warps of MMA_BLOCK_Q / MMA_INPUT_PV_WARPS rows, the online softmax over
# tiles of MMA_INPUT_PV_TILE_K keys, the running max moved only past 2^MMA_LAZY_RESCALE_LOG2
# (reference.sage_attention_reference's softmax_block, lazy_rescale and rescale_rows).
MMA_INPUT_PV_WARPS = 4
MMA_INPUT_PV_TILE_K = 64
MMA_LAZY_RESCALE_LOG2 = 8
MMA_HEAD_DIMS = (64, 128)
# The Hopper kernel (csrc/hopper/params.h: kWgmmaBlockK): K from quantize_kv(block_k=128); its
# work items are blocks of kWgmmaBlockQ queries.
WGMMA_BLOCK_K = 128
WGMMA_BLOCK_Q = 128
# head_dim 256 with FP8 PV only (csrc/hopper/geometry.cuh); the accurate tier (16-bit PV) at 64
# and 128.
WGMMA_HEAD_DIMS = (64, 128, 256)
WGMMA_INPUT_PV_HEAD_DIMS = (64, 128)
# Kernel families of build_info().kernels (csrc/torch/module.cpp says what each holds): the
# preprocessing kernels and attention_mma's INT8 QK + fp16/bf16 PV variant (every arch of the
# build), its FP8 PV variants, INT8 or INT4 QK (archs >= sm_89: FP8 mma.sync), and the Hopper
# kernel (sm_90a).
PREPROCESS_FAMILY = "preprocess"
MMA_FAMILY = "attention_mma"
MMA_FP8_FAMILY = "attention_mma_fp8"
WGMMA_FAMILY = "attention_wgmma"
# copy_many_'s pairs per launch (csrc/parallel/copy_many.h: kCopyManyMaxPairs).
COPY_MANY_MAX_PAIRS = 32
# merge_attention_parts' parts per launch (csrc/parallel/merge_parts.h: kMergeMaxParts).
MERGE_MAX_PARTS = 8
# Absent outputs are empty float32 tensors of shape [0] (docs/DESIGN.md#ops).


class SmoothingStats(NamedTuple):
    q_mean: Tensor  # [B, Hq, D] f32, or [0]
    k_mean: Tensor  # [B, Hkv, D] f32, or [0]
    v_mean: Tensor  # [B, Hkv, Dv] f32 (smooth_v only), or [0]
    v_scale: Tensor  # [B, Hkv, Dv] f32, or [0]


class QuantizedKV(NamedTuple):
    k_quant: Tensor  # [B, Hkv, Nk_pad, D] int8 (int4: D/2 packed)
    k_scale: Tensor  # [B, Hkv, Nk_pad/block_k, 4] f32
    v_fp8: Tensor  # [B, Hkv, Dv, Nk_pad] float8_e4m3fn, or [0]
    delta_s: Tensor  # [B, Hq, Nk_pad] f32, or [0]
    v_tile_scale: Tensor  # [B, Hkv, Nk_pad/block_k] f32 (V without v_scale), or [0]


def _require_extension() -> None:
    if not HAS_EXTENSION:
        raise RuntimeError(f"the sageattention2._C extension is not available ({EXTENSION_ERROR})")


def has_op(name: str) -> bool:
    """Whether the loaded extension registers ``torch.ops.sageattention2.<name>`` (looked up at
    call time, so ops added by a newer build are seen without reloading this module)."""
    return HAS_EXTENSION and (name in _OP_HANDLES or hasattr(getattr(torch.ops, NAMESPACE), name))


def _require_op(name: str) -> None:
    _require_extension()
    if not has_op(name):
        raise RuntimeError(
            f"the sageattention2._C extension has no {name} op (built from older sources?)"
        )


_OP_HANDLES: dict[str, Any] = {}
# Every op the extension has is looked up now, at import: the dict then never changes, so a
# torch.compile'd caller (dynamo guards on it) is not recompiled when an op is first used.
if HAS_EXTENSION:
    for _name in (*OP_NAMES, "attention_mma", "attention_wgmma", "sageattn_wgmma", "sageattn_wgmma_varlen",
                  "sageattn_mma", "sageattn_mma_varlen", "copy_many_", "signal_flags_", "wait_flags_",
                  "merge_attention_parts"):
        if hasattr(getattr(torch.ops, NAMESPACE), _name):
            _OP_HANDLES[_name] = getattr(getattr(torch.ops, NAMESPACE), _name).default


def _op(name: str) -> Any:
    """``torch.ops.sageattention2.<name>.default``, looked up once: through ``torch.ops`` the
    lookup costs microseconds of every call (a sageattn call is host-bound at short sequences,
    docs/DECISIONS.md#d19). Only found ops are kept, so one a newer build adds is still seen."""
    handle = _OP_HANDLES.get(name) if HAS_EXTENSION else None
    if handle is None:
        _require_op(name)
        handle = _OP_HANDLES[name] = getattr(getattr(torch.ops, NAMESPACE), name).default
    return handle


# --------------------------------------------------------------------------------------------
# Typed wrappers (argument order and names of the op schemas in docs/DESIGN.md#ops)
# --------------------------------------------------------------------------------------------


def smoothing_stats(
    q: Tensor | None, k: Tensor | None, v: Tensor | None, smooth_v: bool
) -> SmoothingStats:
    """Per-head means of Q and K, and V's mean (if ``smooth_v``) and per-channel FP8 scale."""
    return SmoothingStats(*_op("smoothing_stats")(q, k, v, smooth_v))


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
    """Quantize K (INT8/INT4), V (FP8, transposed and permuted) and compute Delta-S. V is
    quantized per channel with ``v_scale`` (smoothing_stats', the warp-level kernels), or,
    without it, with one scale per ``block_k``-key tile, returned as ``v_tile_scale`` (the
    Hopper kernel's V: no pass over V before this one)."""
    return QuantizedKV(
        *_op("quantize_kv")(
            k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk_dtype, delta_s_multiplier
        )
    )


def attention_mma(
    q: Tensor,
    q_mean: Tensor | None,
    k_codes: Tensor,
    k_scale: Tensor,
    delta_s: Tensor | None,
    v: Tensor,
    v_scale: Tensor | None,
    v_mean: Tensor | None,
    k_mean: Tensor | None,
    qk_dtype: str,
    kv_len: int,
    sm_scale: float,
    is_causal: bool,
    out_nhd: bool,
    return_lse: bool,
) -> tuple[Tensor, Tensor]:
    """Warp-level attention (``mma.sync``, docs/DESIGN.md#attention-mma) on the caller's ``q`` and
    the outputs of quantize_kv(block_k=MMA_BLOCK_K, qk_dtype, delta_s_multiplier=sm_scale*log2(e)).

    ``q`` is fp16/bf16 ``[B, Hq, q_len, D]``, any view whose last dimension is contiguous: the
    kernel quantizes it itself, in the groups and with the arithmetic of
    reference.quantize_q_reference(block_q=MMA_BLOCK_Q, warps=MMA_WARPS, qk_dtype,
    scale_multiplier=sm_scale*log2(e)), minus ``q_mean [B, Hq, D]`` when given (Q smoothed per
    head: ``delta_s`` must then be quantize_kv's Delta-S of that mean, and is None otherwise).
    ``qk_dtype`` is "int8" or "int4" (packed K codes, last dimension D/2). PV runs either

    * in the input dtype: ``v`` is the caller's ``[B, Hkv, kv_len, D]`` view in q's dtype,
      ``v_scale`` and ``v_mean`` are None (INT8 QK only; every arch), or
    * in FP8: ``v`` is quantize_kv's ``v_fp8`` ``[B, Hkv, D, Nk_pad]`` float8_e4m3fn with its
      per-channel ``v_scale [B, Hkv, D]`` and, for smooth V, ``v_mean [B, Hkv, D]`` (added back
      in the epilogue) (sm_89+ builds, family MMA_FP8_FAMILY).

    ``k_mean [B, Hkv, D]`` (K's smoothing vector, or None): the LSE then includes the row
    constant ``sm_scale * q_i . k_mean`` that K smoothing drops. ``kv_len`` is the true key
    count (the codes are padded). Returns ``(out [B, Hq, q_len, D]`` in q's dtype, NHD memory
    when ``out_nhd``; ``lse [B, Hq, q_len]`` float32 natural log of the true scaled scores, or
    ``[0]`` unless ``return_lse``). Empty optional tensors (absent outputs of the preprocessing
    ops) are passed as absent.
    """
    op = _op("attention_mma")
    q_mean, delta_s, v_scale, v_mean, k_mean = (
        None if t is not None and t.numel() == 0 else t
        for t in (q_mean, delta_s, v_scale, v_mean, k_mean))
    out, lse = op(
        q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean, qk_dtype, kv_len,
        sm_scale, is_causal, out_nhd, return_lse,
    )
    return out, lse


def attention_wgmma(
    q: Tensor,
    k_codes: Tensor,
    k_scale: Tensor,
    v: Tensor,
    v_tile_scale: Tensor | None,
    v_mean: Tensor | None,
    k_mean: Tensor | None,
    kv_len: int,
    sm_scale: float,
    is_causal: bool,
    out_nhd: bool,
    return_lse: bool,
) -> tuple[Tensor, Tensor]:
    """Hopper attention (sm_90a, docs/DESIGN.md#attention-wgmma): ``q`` the caller's fp16/bf16
    ``[B, Hq, Nq, D]`` view (quantized inside the kernel), K from
    quantize_kv(block_k=WGMMA_BLOCK_K, "int8"). The FP8 PV tier: ``v`` its float8_e4m3fn codes
    (quantize_kv with v and without ``v_scale``) with their per-tile ``v_tile_scale`` and, for
    smooth V, ``v_mean``. The accurate tier: ``v`` the caller's ``[B, Hkv, Nk, D]`` in q's dtype
    (last dimension contiguous, other strides multiples of 8 elements, 16-byte aligned), with
    ``v_tile_scale`` and ``v_mean`` None (or empty). Returns ``(out [B, Hq, Nq, D]`` in q's dtype,
    NHD memory when ``out_nhd``; ``lse [B, Hq, Nq]`` float32 natural log of the true scaled scores,
    including the row constant of K smoothing when ``k_mean`` is given, or ``[0]``)."""
    v_tile_scale, v_mean = (None if t is not None and t.numel() == 0 else t for t in (v_tile_scale, v_mean))
    out, lse = _op("attention_wgmma")(
        q, k_codes, k_scale, v, v_tile_scale, v_mean, k_mean, kv_len, sm_scale, is_causal, out_nhd,
        return_lse,
    )
    return out, lse


def sageattn_wgmma(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pv_dtype: str,
    smooth_k: bool,
    smooth_v: bool,
    sample_stride: int,
    sm_scale: float,
    is_causal: bool,
    out_nhd: bool,
    return_lse: bool,
    key_ranges: Tensor | None = None,
    key_mask: Tensor | None = None,
    sample_tokens: int = 0,
) -> tuple[Tensor, Tensor]:
    """The Hopper path of sageattn in one op (docs/DESIGN.md#composite-ops):
    :func:`sageattn_wgmma_chain`, run by the extension in C++, so that its intermediates are never
    returned to Python. ``q``, ``k``, ``v`` are the caller's fp16/bf16 ``[B, H, N, D]`` views (last
    dimension contiguous, other strides multiples of 8). ``pv_dtype``: "fp8" (P~ and V in E4M3)
    or "input" (the accurate tier: P and V in q's dtype; ``smooth_v`` then does nothing).
    ``key_ranges``: int32 ``[B, 3]`` on q's device, or None: batch item b attends keys
    ``key_ranges[b, 0]`` to ``key_ranges[b, 1]`` (exclusive; at least one) alone, with K's and
    V's groups over them and their means over every ``key_ranges[b, 2]``-th of them (then
    ``sample_stride`` 1): a key-padding mask in one launch; not with ``is_causal``. Or
    ``key_mask`` (``[1 or B, 1, 1 or Nq, Nk]``, bool or additive): the key ranges read from it on
    the GPU, each item's sample stride ``ceil(count / sample_tokens) | 1``; an item whose mask is
    not a key-padding mask gets NaN rows.
    Returns attention_wgmma's ``(out, lse)``."""
    out, lse = _op("sageattn_wgmma")(
        q, k, v, pv_dtype, smooth_k, smooth_v, sample_stride, sm_scale, is_causal, out_nhd, return_lse,
        key_ranges, key_mask, sample_tokens
    )
    return out, lse


def key_ranges_of_mask(key_mask: Tensor, batch: int, sample_tokens: int) -> tuple[Tensor, Tensor]:
    """What ``sageattn_wgmma`` reads from a ``key_mask`` (its CPU implementation, in Python): int32
    ``[batch, 3]`` (first key, end key, sample stride) and int32 ``[batch]`` valid (0 where the
    item's mask is not a key-padding mask with one non-empty range; its range is then every key)."""
    n_k = key_mask.shape[-1]
    starts, counts, ok = (t.cpu() for t in item_ranges(key_mask.expand(batch, 1, key_mask.shape[2], n_k)[:, 0]))
    first = torch.where(ok, starts.long(), 0)
    end = torch.where(ok, starts.long() + counts, n_k)
    stride = torch.div(end - first + sample_tokens - 1, sample_tokens, rounding_mode="floor") | 1
    return torch.stack([first, end, stride], 1).to(torch.int32), ok.to(torch.int32)


def sageattn_wgmma_chain(q: Tensor, k: Tensor, v: Tensor, pv_dtype: str, smooth_k: bool,
                         smooth_v: bool, sample_stride: int, *attention: Any) -> tuple[Tensor, Tensor]:
    """What sageattn_wgmma computes, op by op (its CPU implementation, and what the GPU tests
    compare its C++ chain with bit for bit): one smoothing_stats pass over every
    ``sample_stride``-th token (K's mean with ``smooth_k``, V's with ``smooth_v``), one
    quantize_kv pass (per-thread INT8 K, FP8 V with one scale per tile, transposed in the
    PV-MMA order; with ``pv_dtype`` "input", K only, V as it is), then attention_wgmma, which
    quantizes Q itself and returns the complete LSE (it adds the row constant of K smoothing).
    ``attention`` is the rest of sageattn_wgmma's arguments, ``(sm_scale, is_causal, out_nhd,
    return_lse[, key_ranges, key_mask, sample_tokens])``: attention_wgmma takes the first four as
    they are; with ``key_ranges`` (or those of ``key_mask``: :func:`key_ranges_of_mask`) each
    batch item runs this chain on its own range of keys (what the one launch computes)."""
    if pv_dtype not in ("fp8", "input"):
        raise RuntimeError(f"pv_dtype must be 'fp8' or 'input', got '{pv_dtype}'")
    key_ranges, key_mask, sample_tokens = (*attention[4:], None, None, 0)[:3]
    attention = attention[:4]
    valid = None
    if key_mask is not None:
        key_ranges, valid = key_ranges_of_mask(key_mask, q.shape[0], sample_tokens)
    if key_ranges is not None:
        parts = [sageattn_wgmma_chain(q[b:b + 1], k[b:b + 1, :, first:end], v[b:b + 1, :, first:end],
                                      pv_dtype, smooth_k, smooth_v, stride, *attention)
                 for b, (first, end, stride) in enumerate(key_ranges.tolist())]
        out, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        if valid is not None:
            for b in (valid == 0).nonzero().flatten().tolist():
                out[b] = math.nan
                if lse.numel():
                    lse[b] = math.nan
        return out, lse
    fp8 = pv_dtype == "fp8"
    smooth_v = smooth_v and fp8
    k_mean = v_mean = None
    if smooth_k or smooth_v:
        sample = slice(None, None, sample_stride)
        stats = smoothing_stats(None, k[:, :, sample] if smooth_k else None,
                                v[:, :, sample] if smooth_v else None, smooth_v)
        k_mean = stats.k_mean if smooth_k else None
        v_mean = stats.v_mean if smooth_v else None
    kv = quantize_kv(k, v if fp8 else None, k_mean, v_mean, None, None, WGMMA_BLOCK_K, "int8", 1.0)
    return attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8 if fp8 else v,
                           kv.v_tile_scale if fp8 else None, v_mean, k_mean, k.shape[2], *attention)


def sageattn_wgmma_varlen(q: Tensor, k: Tensor, v: Tensor, items: Tensor, blocks: Tensor,
                          max_seqlen_k: int, code_rows: int, smooth_k: bool, smooth_v: bool,
                          sm_scale: float, is_causal: bool, return_lse: bool,
                          v_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The Hopper path over packed sequences in one op (docs/DESIGN.md#packed-sequences):
    :func:`sageattn_wgmma_varlen_chain` in one launch per kernel. ``q`` ``[total_q, Hq, D]``,
    ``k``, ``v`` ``[total_k, Hkv, D]`` (D 64, 128 or 256); from :func:`packed_items`, on q's device:
    ``items`` int32 ``[2, S, 3]``, each sequence's key range (first, end, sample stride) and its
    first and end query and first code row, and ``blocks`` int32 ``[n, 2]``, every sequence's
    blocks of 128 queries. FP8 PV, or with ``v_rows`` (:func:`packed_v_rows`) the accurate tier
    (16-bit PV, D 64 or 128; ``smooth_v`` does nothing); ``is_causal``: each sequence top-left
    aligned, as :func:`sageattn_wgmma`. Returns ``out`` ``[total_q, Hq, D]`` and ``lse`` ``[Hq,
    total_q]`` (empty without ``return_lse``)."""
    out, lse = _op("sageattn_wgmma_varlen")(q, k, v, items, blocks, max_seqlen_k, code_rows,
                                            smooth_k, smooth_v, sm_scale, is_causal, return_lse, v_rows)
    return out, lse


def round_up(n: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is >= ``n`` (reference.py keeps its own: the
    reference imports nothing of the implementation)."""
    return -(-n // multiple) * multiple


def packed_items(spans: Sequence[tuple[int, int, int, int]],
                 sample_stride: Callable[[int], int]) -> tuple[Tensor, Tensor, int]:
    """``sageattn_wgmma_varlen``'s ``items`` (int32 ``[2, S, 3]``), ``blocks`` (int32 ``[n, 2]``:
    each block of 128 queries of each sequence, as (sequence, block)), on the CPU, and
    ``code_rows``, for sequences whose queries and keys are the packed rows ``(q0, q1, k0, k1)``
    of each span (at least one query and one key each), each sequence's smoothing sample stride
    ``sample_stride(keys)``: its codes start at the sum of the earlier sequences' keys rounded
    up to 128."""
    ranges, rows, blocks, code_row = [], [], [], 0
    for s, (q0, q1, k0, k1) in enumerate(spans):
        ranges.append((k0, k1, sample_stride(k1 - k0)))
        rows.append((q0, q1, code_row))
        blocks.extend((s, b) for b in range(round_up(q1 - q0, WGMMA_BLOCK_Q) // WGMMA_BLOCK_Q))
        code_row += round_up(k1 - k0, WGMMA_BLOCK_K)
    return (torch.tensor([ranges, rows], dtype=torch.int32),
            torch.tensor(blocks, dtype=torch.int32).reshape(-1, 2), code_row)


def packed_v_rows(items: Tensor, total_k: int, code_rows: int) -> Tensor:
    """``sageattn_wgmma_varlen``'s ``v_rows`` for the accurate tier (int64, on ``items``' device):
    each key's row in the zero-padded copy of V the kernel reads, the sequence's code row plus
    the key's place in it, and ``code_rows`` (a scratch row past the copy's end, never read) for
    the keys of no sequence; then the rows of the copy no key fills (each sequence's last tile's
    pad), which the op zeroes."""
    rows = torch.full((total_k,), code_rows, dtype=torch.int64)
    filled = torch.zeros(code_rows, dtype=torch.bool)
    for (k0, k1, _), (_, _, code_row) in zip(*items.tolist()):
        rows[k0:k1] = torch.arange(code_row, code_row + k1 - k0)
        filled[code_row:code_row + k1 - k0] = True
    return torch.cat([rows, (~filled).nonzero().flatten()]).to(items.device)


def sageattn_wgmma_varlen_chain(q: Tensor, k: Tensor, v: Tensor, items: Tensor, blocks: Tensor,
                                max_seqlen_k: int, code_rows: int, smooth_k: bool,
                                smooth_v: bool, sm_scale: float, is_causal: bool,
                                return_lse: bool, v_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """What sageattn_wgmma_varlen computes (its CPU implementation, and what the GPU tests compare
    it with bit for bit): each sequence's :func:`sageattn_wgmma_chain` on its own queries and
    key range (FP8 PV; with ``v_rows`` the accurate tier), its sample stride its own."""
    pv_dtype = "fp8" if v_rows is None else "input"
    return _per_sequence(q, k, v, items, return_lse, lambda qs, ks, vs, stride: sageattn_wgmma_chain(
        qs, ks, vs, pv_dtype, smooth_k, smooth_v, stride, sm_scale, is_causal, True, return_lse))


def _per_sequence(q: Tensor, k: Tensor, v: Tensor, items: Tensor, return_lse: bool,
                  chain: Callable[[Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor]]
                  ) -> tuple[Tensor, Tensor]:
    """The packed ops' references: ``chain(q, k, v, sample_stride)`` (a kernel path's chain with
    ``out_nhd``) on each sequence of ``items`` alone, as ``[1, H, n, D]`` views of its packed rows,
    into ``[total_q, H, D]`` and ``[H, total_q]``."""
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse = (q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32) if return_lse
           else q.new_empty(0, dtype=torch.float32))
    for (k0, k1, stride), (q0, q1, _) in zip(*items.tolist()):
        part, part_lse = chain(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                               v[k0:k1].transpose(0, 1)[None], stride)
        out[q0:q1] = part[0].transpose(0, 1)  # (out_nhd: a [1, H, n, D] view of [n, H, D] rows)
        if return_lse:
            lse[:, q0:q1] = part_lse[0]
    return out, lse


def sageattn_mma(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qk_dtype: str,
    pv_dtype: str,
    smooth_q: bool,
    smooth_k: bool,
    smooth_v: bool,
    sample_stride: int,
    sm_scale: float,
    is_causal: bool,
    out_nhd: bool,
    return_lse: bool,
    int4_guard: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The warp-level path of sageattn in one op (docs/DESIGN.md#composite-ops):
    :func:`sageattn_mma_chain`, run by the extension in C++, each launch a programmatic dependent
    of the one before. ``q``, ``k``, ``v`` are the caller's fp16/bf16 ``[B, H, N, D]`` views (last
    dimension contiguous, other strides multiples of 8); ``pv_dtype`` "fp8" or "input";
    ``int4_guard`` > 0 with INT4 QK: the INT4 guard (:func:`int8_heads`; no programmatic
    launches then). Returns attention_mma's ``(out, lse)``."""
    out, lse = _op("sageattn_mma")(
        q, k, v, qk_dtype, pv_dtype, smooth_q, smooth_k, smooth_v, sample_stride, sm_scale,
        is_causal, out_nhd, return_lse, int4_guard,
    )
    return out, lse


def sageattn_mma_varlen(q: Tensor, k: Tensor, v: Tensor, items: Tensor, blocks: Tensor,
                        max_seqlen_k: int, code_rows: int, pv_dtype: str, smooth_k: bool,
                        smooth_v: bool, sm_scale: float, is_causal: bool,
                        return_lse: bool) -> tuple[Tensor, Tensor]:
    """The warp-level path over packed sequences in one op (docs/DESIGN.md#packed-sequences):
    :func:`sageattn_mma_varlen_chain` in one launch per kernel, INT8 QK without Q smoothing,
    head_dim 64 or 128; ``items`` and ``blocks`` as :func:`sageattn_wgmma_varlen`'s, the items'
    sample strides 1 with ``pv_dtype`` "fp8" (V's per-channel scales need every key, and K's mean
    takes them too, as :func:`sageattn_mma_chain`'s); ``is_causal``: each sequence top-left.
    Returns ``out`` ``[total_q, Hq, D]`` and ``lse`` ``[Hq, total_q]`` (empty without
    ``return_lse``)."""
    out, lse = _op("sageattn_mma_varlen")(q, k, v, items, blocks, max_seqlen_k, code_rows, pv_dtype,
                                          smooth_k, smooth_v, sm_scale, is_causal, return_lse)
    return out, lse


def sageattn_mma_varlen_chain(q: Tensor, k: Tensor, v: Tensor, items: Tensor, blocks: Tensor,
                              max_seqlen_k: int, code_rows: int, pv_dtype: str, smooth_k: bool,
                              smooth_v: bool, sm_scale: float, is_causal: bool,
                              return_lse: bool) -> tuple[Tensor, Tensor]:
    """What sageattn_mma_varlen computes (its CPU implementation, and what the GPU tests compare
    it with): each sequence's :func:`sageattn_mma_chain` (INT8 QK, no Q smoothing) on its own
    queries and key range, its sample stride its own. The one launch's statistics reduce each
    sequence in one CTA, the chain's over as many as fill the GPU: with FP8 PV (means over
    every key) the two can differ in a mean's last bit; with 16-bit PV (a sample short enough
    for one CTA) they agree bit for bit."""
    return _per_sequence(q, k, v, items, return_lse, lambda qs, ks, vs, stride: sageattn_mma_chain(
        qs, ks, vs, "int8", pv_dtype, False, smooth_k, smooth_v, stride, sm_scale, is_causal, True,
        return_lse))


def channel_spread(x: Tensor, mean: Tensor) -> Tensor:
    """``[B, H]``: the largest of a head's per-channel ranges max_n |x_n - mean| over the mean of
    its nonzero ones (zero channels are a head_dim's padding, 40 -> 64, not spread); each range
    divided by 448 as smoothing_stats computes it, and the ratio taken as sageattn_mma does, so
    the figures agree bit for bit. ~1 for evenly spread channels; a few channels k times wider
    than the rest give ~k. From x's extremes per channel, no float32 copy of x: rounding is
    monotonic, so max(high - mean, mean - low) is the float32 max of |x_n - mean| bit for bit."""
    low, high = torch.aminmax(x, dim=2)
    mean = mean.float()
    return _spread_of_ranges(torch.maximum(high.float() - mean, mean - low.float()) / 448.0)


def _spread_of_ranges(ranges: Tensor) -> Tensor:
    return ranges.amax(-1).mul(ranges.gt(0).sum(-1)).div(ranges.sum(-1))


def readable_in_place(t: Tensor) -> bool:
    """Whether the ops read ``t`` as it is, in 16-byte vectors: last dimension contiguous, the
    other strides multiples of 16 bytes (8 elements of the kernels' 16-bit inputs), 16-byte
    aligned."""
    size = t.element_size()
    return (t.stride(-1) == 1 and all(stride * size % 16 == 0 for stride in t.stride()[:-1])
            and t.data_ptr() % 16 == 0)


def moved_as_words(t: Tensor) -> bool:
    """Whether copy_many_ moves ``t`` as it is: CUDA, 1 to 4 dimensions, rows of whole 16-byte
    words, :func:`readable_in_place`. (A slice of such a tensor along any dimension but the last
    is too: what lets a caller check the parents of many slices once.)"""
    return (t.is_cuda and 1 <= t.dim() <= 4 and t.shape[-1] * t.element_size() % 16 == 0
            and readable_in_place(t))


def copy_many_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], *,
               as_words: bool | None = None, by_copy_engine: bool = False) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i (same shapes and dtypes, no overlaps): in one launch
    of the extension's ``copy_many_`` where it moves every tensor as it is (every pair at once:
    context parallelism's local and remote copies side by side), else one ``copy_`` each.
    ``as_words``: what the caller knows of :func:`moved_as_words` for every tensor (None:
    asked here, tensor by tensor: ~70 us of host time for an exchange's 24 tensors, session 48;
    the op itself still checks them, in C++). ``by_copy_engine``: the op's pairs by the copy
    engines instead (2-D copies; no SM, so they run beside a kernel that holds every SM), each
    pair that would take more than 64 of them still by the launch."""
    if as_words is None:
        as_words = all(moved_as_words(t) for t in (*dsts, *srcs))
    if as_words and 0 < len(dsts) <= COPY_MANY_MAX_PAIRS and has_op("copy_many_"):
        _op("copy_many_")(list(dsts), list(srcs), by_copy_engine)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def _flag_value(value: int) -> int:
    """A counter as the int32 a flag holds (counters wrap around; the wait compares modulo 2**32)."""
    return (value + 2**31) % 2**32 - 2**31


def signal_flags_(flags: Sequence[Tensor], value: int) -> None:
    """Every one of ``flags`` (one-element int32 tensors: this rank's or, mapped, a peer's) set to
    ``value`` on the current stream, once its work so far has landed: ``cuStreamWriteValue32``
    after a system-wide fence, no SM (so a signal is not held up by a kernel that holds every
    SM). CPU tensors (the threads tests' ranks): set at once."""
    if flags and flags[0].is_cuda:
        _op("signal_flags_")(list(flags), _flag_value(value))
        return
    for flag in flags:
        flag.fill_(_flag_value(value))


def wait_flags_(flags: Sequence[Tensor], value: int, timeout_s: float = 300.0) -> None:
    """The current stream waits, no SM (``cuStreamWaitValue32``), until every one of ``flags``
    holds ``value`` or a later count (compared modulo 2**32). CPU tensors: this thread waits,
    at most ``timeout_s``."""
    if flags and flags[0].is_cuda:
        _op("wait_flags_")(list(flags), _flag_value(value))
        return
    deadline = time.monotonic() + timeout_s
    for flag in flags:
        while _flag_value(int(flag.item()) - value) < 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"wait_flags_: a flag still holds {int(flag.item())}, waited for {value}")
            time.sleep(1e-4)


def merges_in_one_pass(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> bool:
    """Whether the extension's ``merge_attention_parts`` reads every part as it is: up to
    MERGE_MAX_PARTS CUDA fp16/bf16 outputs with head_dim a multiple of 8, each read in place,
    and float32 LSEs."""
    if not 0 < len(outs) <= MERGE_MAX_PARTS:
        return False
    first = outs[0]
    return (first.is_cuda and first.dim() == 4
            and first.dtype in (torch.float16, torch.bfloat16) and first.shape[-1] % 8 == 0
            and all(readable_in_place(t) for t in outs) and all(t.dtype == torch.float32 for t in lses)
            and has_op("merge_attention_parts"))


def merge_attention_parts(outs: Sequence[Tensor], lses: Sequence[Tensor],
                          out_nhd: bool) -> tuple[Tensor, Tensor]:
    """The extension's ``merge_attention_parts`` (csrc/parallel/merge_parts.cu): the parts'
    outputs ``[B, H, N, D]`` and float32 LSEs ``[B, H, N]``, each over its own keys, merged into
    (out ``[B, H, N, D]`` in their dtype, NHD memory if ``out_nhd``; lse float32) in one pass."""
    _require_op("merge_attention_parts")
    return _op("merge_attention_parts")(list(outs), list(lses), out_nhd)


def head_channel_spread(x: Tensor) -> Tensor:
    """:func:`channel_spread` of ``x`` ``[B, H, N, D]`` about its own mean over all tokens, from
    one smoothing_stats pass where the op reads x in place (its V statistics: each channel's
    mean and max |x - mean| / 448, one read of x; aminmax and a mean read it twice, 0.33 ms
    against ~0.14 for a 16K-token B4 H32 hd128 tensor on the H200), else from those two."""
    if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and x.shape[-1] % 8 == 0
            and x.shape[-1] <= 256 and x.shape[2] > 0 and readable_in_place(x)
            and has_op("smoothing_stats")):
        return _spread_of_ranges(smoothing_stats(None, None, x, True).v_scale)
    return channel_spread(x, x.mean(dim=2, dtype=torch.float32))


def guard_threshold(environment: str, default: float) -> float:
    """A channel-spread guard's threshold (0: off): ``default`` unless the variable
    ``environment`` sets another number >= 1, or "off" (the INT4 guard, D38; the training guard,
    D52)."""
    value = os.environ.get(environment, "").strip().lower()
    if not value:
        return default
    if value in ("off", "0"):
        return 0.0
    try:
        threshold = float(value)
    except ValueError:
        threshold = math.nan
    if not threshold >= 1.0:
        raise ValueError(f"{environment} must be 'off' or a number >= 1, got {value!r}")
    return threshold


def int8_heads(q: Tensor, k: Tensor, q_mean: Tensor, k_mean: Tensor, threshold: float) -> Tensor:
    """The INT4 guard's choice (docs/DECISIONS.md#d38): ``[B, H_kv]`` uint8, 1 for a KV head
    whose K, or any Q head sharing it, has a :func:`channel_spread` above ``threshold``: INT4's
    per-thread groups share one scale over all channels, so the narrow channels of such a head
    get a code or two. Those heads run INT8 QK inside the same call. ``q_mean``, ``k_mean``: the
    per-head means over all tokens (smoothing_stats)."""
    b, h_kv = k.shape[:2]
    q_spread = channel_spread(q, q_mean).view(b, h_kv, -1).amax(-1)
    return (channel_spread(k, k_mean).gt(threshold) | q_spread.gt(threshold)).to(torch.uint8)


def sageattn_mma_chain(q: Tensor, k: Tensor, v: Tensor, qk_dtype: str, pv_dtype: str,
                       smooth_q: bool, smooth_k: bool, smooth_v: bool, sample_stride: int,
                       sm_scale: float, is_causal: bool, out_nhd: bool, return_lse: bool,
                       int4_guard: float = 0.0) -> tuple[Tensor, Tensor]:
    """What sageattn_mma computes, op by op (its CPU implementation, and what the GPU tests
    compare its C++ chain with bit for bit): at most one smoothing_stats pass (Q's per-head mean
    with ``smooth_q``; K's mean with ``smooth_k``, over every ``sample_stride``-th token unless
    FP8 PV's V statistics need all of K's tokens anyway; with FP8 PV, V's per-channel range and,
    with ``smooth_v``, mean), one quantize_kv pass (per-thread INT8/INT4 K, the Delta-S of Q's
    mean, FP8 V transposed in the PV-MMA order), then attention_mma, which quantizes Q itself
    (``sm_scale * log2(e)`` folded into its scales) and returns the complete LSE. With INT4 QK
    and ``int4_guard`` > 0, the heads :func:`int8_heads` picks take the INT8 chain's output
    (the kernels compute every head alone, so this is the composite's result bit for bit)."""
    if pv_dtype not in ("fp8", "input"):
        raise ValueError(f"pv_dtype must be 'fp8' or 'input', got {pv_dtype!r}")
    if int4_guard != 0.0 and int4_guard < 1.0:
        raise ValueError(f"int4_guard must be 0 (off) or >= 1, got {int4_guard}")
    attention = (is_causal, out_nhd, return_lse)
    if int4_guard > 0 and qk_dtype == "int4":
        stats = smoothing_stats(q, k, v, smooth_v)  # over all tokens: the guard's statistic
        guarded = int8_heads(q, k, stats.q_mean, stats.k_mean, int4_guard).bool()
        chains = {qk: sageattn_mma_chain(q, k, v, qk, pv_dtype, smooth_q, smooth_k, smooth_v,
                                         sample_stride, sm_scale, *attention)
                  for qk, needed in (("int4", not guarded.all()), ("int8", guarded.any())) if needed}
        if len(chains) == 1:  # (the chain may ask the host: it is the reference, not the path)
            return next(iter(chains.values()))
        per_q_head = guarded.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [B, Hq]
        out = torch.where(per_q_head[:, :, None, None], chains["int8"][0], chains["int4"][0])
        lse = (torch.where(per_q_head[:, :, None], chains["int8"][1], chains["int4"][1])
               if return_lse else chains["int4"][1])
        return out, lse
    fp8 = pv_dtype == "fp8"
    multiplier = sm_scale * LOG2E
    q_mean = k_mean = v_mean = v_scale = None
    if smooth_q or smooth_k or fp8:
        k_rows = k if fp8 else k[:, :, ::sample_stride]
        stats = smoothing_stats(q if smooth_q else None, k_rows if smooth_k else None,
                                v if fp8 else None, fp8 and smooth_v)
        q_mean = stats.q_mean if smooth_q else None
        k_mean = stats.k_mean if smooth_k else None
        if fp8:
            v_scale = stats.v_scale
            v_mean = stats.v_mean if smooth_v else None
    kv = quantize_kv(k, v if fp8 else None, k_mean, v_mean, v_scale, q_mean, MMA_BLOCK_K, qk_dtype,
                     multiplier)
    return attention_mma(
        q, q_mean, kv.k_quant, kv.k_scale, kv.delta_s if q_mean is not None else None,
        kv.v_fp8 if fp8 else v, v_scale, v_mean, k_mean, qk_dtype, k.shape[2], sm_scale, *attention,
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
    # Each composite runs its chain of ops (sageattn_<kernel>_chain), each looked up in this
    # module at call time (tests stand in for the attention ops, which have no CPU
    # implementation).
    for name in ("sageattn_wgmma", "sageattn_wgmma_varlen", "sageattn_mma", "sageattn_mma_varlen"):
        qualname = f"{NAMESPACE}::{name}"
        if has_op(name) and not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"):
            torch.library.register_kernel(
                qualname, "cpu", lambda *args, _chain=f"{name}_chain": globals()[_chain](*args))


if HAS_EXTENSION:
    _register_python_impls()


# --------------------------------------------------------------------------------------------
# Build information
# --------------------------------------------------------------------------------------------


class BuildInfo(NamedTuple):
    cuda_version: str
    archs: list[str]  # e.g. ["sm_80", "sm_89", "sm_90a"]
    kernels: dict[str, list[str]]  # kernel family (PREPROCESS_FAMILY, MMA_FAMILY, ...) -> its archs
    descriptions: Mapping[str, str] = {}  # kernel family -> what it computes (for ``info``)


def build_info() -> BuildInfo | None:
    """What the extension was built with, or ``None`` when it is not available.

    ``_C.build_info()`` returns ``{"cuda_version": str, "archs": [str], "kernels": [{"family":
    str, "description": str, "archs": [str]}, ...]}``."""
    if _C is None:
        return None
    raw: Mapping[str, Any] = _C.build_info()
    entries = [dict(entry) for entry in raw.get("kernels", [])]
    return BuildInfo(
        cuda_version=str(raw.get("cuda_version", "unknown")),
        archs=[str(a) for a in raw.get("archs", [])],
        kernels={str(e["family"]): [str(a) for a in e.get("archs", [])] for e in entries},
        descriptions={str(e["family"]): str(e.get("description", "")) for e in entries},
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


def kernel_family(key: str) -> str:
    """The family a ``build_info().kernels`` key names. Keys are family names (MMA_FAMILY, ...);
    a key that carries a description after the name, as builds before the structured build info
    wrote them ("attention_mma_fp8 (INT8/INT4 QK, FP8 PV, mma.sync)"), names its first word, so
    that one family's name is never taken for the prefix of another's."""
    return key.split(" ", 1)[0]


def family_runs_on(family: str, capability: tuple[int, int]) -> bool:
    """Whether the extension has code of kernel ``family`` (MMA_FAMILY, ...) for ``capability``."""
    return any(kernel_family(key) == family for key in kernels_for_capability(capability))


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
