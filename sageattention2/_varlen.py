""":func:`sageattn_varlen`: attention over packed sequences of different lengths, as
``flash_attn_varlen_func`` takes them (issue 34, item 2).

``q`` is ``[total_q, H_q, D]``, ``k`` and ``v`` are ``[total_k, H_kv, D]``: the sequences one
after another, sequence i's tokens at ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` (and likewise for
the keys). Each sequence is its own attention, its quantization groups and smoothing means over
its own tokens alone. Where :func:`sageattn` would run INT8 QK without Q smoothing on a kernel
(the Hopper kernel's FP8 tier at head_dim up to 256 or its accurate tier up to 128; elsewhere
the warp-level kernel up to 128, FP8 or 16-bit PV as its routes choose), a head_dim the kernel is
not built for zero-padded as :func:`sageattn` pads it, causal attention aligned either way, all
the sequences run in one launch of each kernel (``ops.sageattn_wgmma_varlen``,
``ops.sageattn_mma_varlen``, docs/DESIGN.md#packed-sequences; bottom-right with fewer queries
than keys in two, merged by their LSE as :func:`sageattn` merges one sequence's): each
sequence's output is what that kernel gives the sequence alone (bit for bit, but for the
warp-level kernel's FP8 PV, whose statistics over every key may differ in a mean's last bit).
Otherwise each runs as one :func:`sageattn` call on views of its tokens
(``tensor_layout="NHD"``, no copies of the inputs): bit for bit that call's (the quantized
kernel, or exact SDPA where the crossover says it is faster for that sequence's shape), one
call's host time per sequence.

The boundaries are read on the host once per ``cu_seqlens`` tensor (one synchronisation when
they live on the GPU; models pass the same tensors to every layer; ``_tensor_memo``: inference
tensors are read on every call), so a CUDA graph captures a
call only with tensors read before the capture. Under ``torch.compile`` the
call is one graph op, ``sageattention2::sageattn_varlen``.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Tuple

import torch
from torch import Tensor

from . import _execute, _plan, ops
from ._call import PV_QUANTS, QK_QUANTS, SmoothV, smooth_v_flag
from ._execute import smoothing_sample_stride
from ._tensor_memo import MISSING, TensorMemo
from .api import sageattn

__all__ = ["sageattn_varlen"]

_bounds_cache = TensorMemo()


def _bounds(name: str, cu_seqlens: object, total: int) -> tuple[int, ...]:
    """The checked boundaries of ``cu_seqlens`` (cached per tensor while it is unmodified)."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    bounds = _bounds_cache.get(cu_seqlens)
    if bounds is MISSING:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"{name} must be 1-D with at least 2 entries (B + 1 boundaries), got "
                             f"shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"sageattn_varlen reads {name} on the host, which a CUDA graph "
                               "capture forbids: call it once with the same cu_seqlens tensors "
                               "before capturing (they are read once per tensor)")
        bounds = tuple(int(x) for x in cu_seqlens.tolist())
        _bounds_cache.put(cu_seqlens, bounds)
    if bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must rise from 0 to the number of tokens ({total}) without "
                         f"falling, got {list(bounds) if len(bounds) <= 16 else 'a tensor that does not'}")
    return bounds


def _check_inputs(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, [total tokens, heads, head_dim] (packed "
                             f"sequences), got shape {tuple(t.shape)}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same tokens and heads, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[1] % max(k.shape[1], 1) != 0 or k.shape[1] == 0:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's and v's "
                         f"({k.shape[1]})")


def sageattn_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    qk_quant: str = "auto",
    pv_quant: str = "auto",
    smooth_k: bool = True,
    smooth_q: bool | str = "auto",
    smooth_v: SmoothV = "auto",
    return_lse: bool = False,
    strict: bool = False,
    causal_alignment: str = "top_left",
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed sequences of different lengths (``flash_attn_varlen_func``'s
    arguments): sequence i's queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]`` attend to its keys
    and values ``k[cu_seqlens_k[i]:cu_seqlens_k[i + 1]]``, ``v[...]``.

    Args:
        q: ``[total_q, H_q, D]``; k, v: ``[total_k, H_kv, D]`` with H_q a multiple of H_kv
            (grouped-query attention needs no flag here).
        cu_seqlens_q, cu_seqlens_k: int32 or int64 ``[B + 1]``: 0, then the running totals of the
            sequences' lengths (on any device).
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (as flash-attn takes them);
            checked against the boundaries.
        is_causal: per sequence, aligned to the top-left as SDPA (query j sees keys up to j),
            or with ``causal_alignment="bottom_right"`` as flash-attn (:func:`sageattn`).
        scale, qk_quant, pv_quant, smooth_k, smooth_q, smooth_v, strict: as :func:`sageattn`.
        return_lse: also return the float32 natural-log LSE, ``[H_q, total_q]``.

    Returns:
        ``[total_q, H_q, D_v]`` in q's dtype (and the LSE). A sequence with queries and no keys
        gets zeros (LSE -inf), as :func:`sageattn` gives; the tokens of no sequence do not
        exist (the boundaries cover every token).
    """
    _check_inputs(q, k, v)
    if qk_quant not in QK_QUANTS or pv_quant not in PV_QUANTS:
        raise ValueError(f"qk_quant must be one of {QK_QUANTS} and pv_quant one of {PV_QUANTS}; "
                         f"got {qk_quant!r}, {pv_quant!r}")
    if torch.compiler.is_compiling():  # the boundaries are data: the op's eager call checks them
        out, lse = torch.ops.sageattention2.sageattn_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
            qk_quant, pv_quant, smooth_k, str(smooth_q), smooth_v_flag(smooth_v, v.shape[-1]),
            return_lse, strict, causal_alignment)
        return (out, lse) if return_lse else out
    bounds_q = _bounds("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    bounds_k = _bounds("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {len(bounds_q) - 1} and {len(bounds_k) - 1}")
    for name, bounds, given in (("max_seqlen_q", bounds_q, max_seqlen_q),
                                ("max_seqlen_k", bounds_k, max_seqlen_k)):
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        if isinstance(given, bool) or not isinstance(given, int) or given < longest:
            raise ValueError(f"{name} must be an int at least the longest sequence ({longest}), "
                             f"got {given!r}")
    launch = _one_launch(q, k, v, qk_quant, pv_quant, smooth_q)
    if launch is not None:
        d, head_dim = q.shape[-1], launch.head_dim
        bottom_right = is_causal and causal_alignment == "bottom_right" and bounds_q != bounds_k
        run = functools.partial(
            _run_packed, *(_execute.kernel_input(t, head_dim) for t in (q, k, v)),
            sm_scale=1.0 / math.sqrt(d) if scale is None else scale,  # the true head_dim's, as sageattn
            smooth_k=smooth_k, smooth_v=smooth_v_flag(smooth_v, d), launch=launch)
        if bottom_right:
            out, lse = _run_bottom_right(run, bounds_q, bounds_k, return_lse)
        else:
            out, lse = run(_spans(bounds_q, bounds_k), is_causal, return_lse)
        if head_dim != d:
            out = out[..., :d].contiguous()
        return (out, lse) if return_lse else out
    return _run(q, k, v, bounds_q, bounds_k, dict(
        is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        tensor_layout="NHD", qk_quant=qk_quant, pv_quant=pv_quant, smooth_k=smooth_k,
        smooth_q=smooth_q, smooth_v=smooth_v, return_lse=return_lse, strict=strict,
        causal_alignment=causal_alignment))


class _Launch(NamedTuple):
    """How the sequences run in one launch of each kernel."""

    kernel: str    # "wgmma" (ops.sageattn_wgmma_varlen) or "mma" (ops.sageattn_mma_varlen)
    head_dim: int  # the kernel's: the call's, or the next it is built for (zero-padded)
    pv: str        # "fp8" or "input"


def _one_launch(q: Tensor, k: Tensor, v: Tensor, qk_quant: str, pv_quant: str,
                smooth_q: bool | str) -> _Launch | None:
    """How the sequences run in one launch of each kernel, or None where each runs as its own
    :func:`sageattn` call, following :func:`sageattn`'s routes (``_plan.ROUTES``) for INT8 QK
    without Q smoothing: on the Hopper kernel its FP8 tier (head_dim up to 256) or its accurate
    tier (``pv_quant="none"``, up to 128, V through a zero-padded copy); elsewhere the
    warp-level kernel (up to 128) with FP8 PV where that is native or asked for, else 16-bit
    PV. A head_dim the kernel is not built for is zero-padded to the next it is, as
    :func:`sageattn` pads it (``_plan.kernel_head_dim``)."""
    d = q.shape[-1]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return None  # the packed launch has no backward: each sequence's sageattn call routes it
    if not (qk_quant in ("auto", "int8") and smooth_q in ("auto", False)
            and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
            and v.dtype == q.dtype and k.shape[-1] == d and v.shape[-1] == d and q.is_cuda):
        return None
    target = _plan.target_of(q.device)
    if target.wgmma:
        pv = "input" if pv_quant == "none" else "fp8"
        head_dim = _plan.kernel_head_dim(
            d, ops.WGMMA_INPUT_PV_HEAD_DIMS if pv == "input" else ops.WGMMA_HEAD_DIMS)
        if head_dim is None or not ops.has_op("sageattn_wgmma_varlen"):
            return None
        return _Launch("wgmma", head_dim, pv)
    fp8 = pv_quant == "fp8" or (pv_quant == "auto" and target.native_fp8 and target.mma_fp8)
    head_dim = _plan.kernel_head_dim(d, ops.MMA_HEAD_DIMS)
    if (head_dim is None or _plan.device_reason(q.device) is not None or (fp8 and not target.mma_fp8)
            or not ops.has_op("sageattn_mma_varlen")):
        return None
    return _Launch("mma", head_dim, "fp8" if fp8 else "input")


Span = Tuple[int, int, int, int]  # a sequence's packed rows: queries q0:q1, keys k0:k1


def _spans(bounds_q: tuple[int, ...], bounds_k: tuple[int, ...]) -> tuple[Span, ...]:
    return tuple(zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]))


@functools.lru_cache(maxsize=64)
def _packed_tables(spans: tuple[Span, ...], every_key: bool = False
                   ) -> tuple[tuple[Tensor, Tensor] | None, int, tuple[tuple[int, int], ...]]:
    """The kernel's items and Q blocks of the spans with queries and keys (``ops.packed_items``,
    on the CPU; None if there is none), their code rows, and the query rows of the spans with
    queries and no keys. Each span's smoothing sample: ``smoothing_sample_stride``, or with
    ``every_key`` every key (the warp-level kernel's FP8 PV, as ``sageattn_mma_chain``). Cached
    per spans: a model passes the same boundaries to every layer."""
    runs = [s for s in spans if s[1] > s[0] and s[3] > s[2]]
    keyless = tuple((q0, q1) for q0, q1, k0, k1 in spans if q1 > q0 and k1 == k0)
    if not runs:
        return None, 0, keyless
    items, blocks, code_rows = ops.packed_items(
        runs, (lambda _: 1) if every_key else smoothing_sample_stride)
    return (items, blocks), code_rows, keyless


@functools.lru_cache(maxsize=64)
def _packed_items(spans: tuple[Span, ...], device: torch.device, every_key: bool = False
                  ) -> tuple[tuple[Tensor, Tensor] | None, int, tuple[tuple[int, int], ...]]:
    """:func:`_packed_tables` with the tables on ``device``."""
    tables, code_rows, keyless = _packed_tables(spans, every_key)
    if tables is None:
        return None, 0, keyless
    return (tables[0].to(device), tables[1].to(device)), code_rows, keyless


@functools.lru_cache(maxsize=64)
def _packed_v_rows(spans: tuple[Span, ...], total_k: int, device: torch.device) -> Tensor:
    """The accurate tier's ``v_rows`` (``ops.packed_v_rows``, on ``device``) for these spans,
    made from the CPU tables (no read-back of the device's), cached as :func:`_packed_items`."""
    tables, code_rows, _ = _packed_tables(spans)
    assert tables is not None
    return ops.packed_v_rows(tables[0], total_k, code_rows).to(device)


def _run_packed(q: Tensor, k: Tensor, v: Tensor, spans: tuple[Span, ...], is_causal: bool,
                return_lse: bool, *, sm_scale: float, smooth_k: bool, smooth_v: bool,
                launch: _Launch) -> tuple[Tensor, Tensor]:
    """The spans' attention in one launch of each kernel (``is_causal``: each span's diagonal
    top-left), into ``[total_q, H, D]`` and (``return_lse``) ``[H, total_q]``: a span with queries
    and no keys gets zeros (LSE -inf), as :func:`sageattn` gives it; the rows of no span are not
    written."""
    every_key = launch.kernel == "mma" and launch.pv == "fp8"
    tables, code_rows, keyless = _packed_items(spans, q.device, every_key)
    if tables is None:
        out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
        lse = q.new_full((q.shape[1], q.shape[0]) if return_lse else (0,), -math.inf,
                         dtype=torch.float32)
        return out, lse
    max_keys = max(k1 - k0 for _, _, k0, k1 in spans)
    if launch.kernel == "mma":
        out, lse = ops.sageattn_mma_varlen(q, k, v, *tables, max_keys, code_rows, launch.pv,
                                           smooth_k, smooth_v, sm_scale, is_causal, return_lse)
    else:
        v_rows = _packed_v_rows(spans, k.shape[0], q.device) if launch.pv == "input" else None
        out, lse = ops.sageattn_wgmma_varlen(q, k, v, *tables, max_keys, code_rows, smooth_k,
                                             smooth_v, sm_scale, is_causal, return_lse, v_rows)
    for q0, q1 in keyless:
        out[q0:q1] = 0
        if return_lse:
            lse[:, q0:q1] = -math.inf
    return out, lse


class _BottomRight(NamedTuple):
    """FlashAttention's causal rule over packed sequences as :func:`sageattn` runs it for one
    (``_execute._bottom_right``): the last min(n_q, n_k) queries of each sequence over its last
    as many keys, top-left causal; with n_q < n_k also its queries over its first n_k - n_q keys
    without a mask, the two merged by their LSE; with n_q > n_k the first n_q - n_k queries see
    no key."""

    causal: tuple[Span, ...]
    unmasked: tuple[Span, ...]
    merged_rows: tuple[tuple[int, int], ...]  # the query rows of the unmasked spans
    blind_rows: tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=64)
def _bottom_right_parts(bounds_q: tuple[int, ...], bounds_k: tuple[int, ...]) -> _BottomRight:
    causal, unmasked, blind = [], [], []
    for q0, q1, k0, k1 in _spans(bounds_q, bounds_k):
        seen = min(q1 - q0, k1 - k0)
        causal.append((q1 - seen, q1, k1 - seen, k1))
        if k1 - k0 > q1 - q0 > 0:
            unmasked.append((q0, q1, k0, k1 - seen))
        if q1 - seen > q0:
            blind.append((q0, q1 - seen))
    return _BottomRight(tuple(causal), tuple(unmasked), tuple((s[0], s[1]) for s in unmasked),
                        tuple(blind))


@functools.lru_cache(maxsize=64)
def _row_index(rows: tuple[tuple[int, int], ...], device: torch.device) -> Tensor:
    return torch.cat([torch.arange(a, b) for a, b in rows]).to(device)


def _run_bottom_right(run: Callable[[tuple[Span, ...], bool, bool], tuple[Tensor, Tensor]],
                      bounds_q: tuple[int, ...], bounds_k: tuple[int, ...],
                      return_lse: bool) -> tuple[Tensor, Tensor]:
    """:class:`_BottomRight`'s parts, each in one launch of each kernel (``run``:
    :func:`_run_packed` with the call's tensors and options): each sequence's rows bit for bit
    what :func:`sageattn` computes for it alone with the same kernel."""
    parts = _bottom_right_parts(bounds_q, bounds_k)
    merge = bool(parts.unmasked)
    out, lse = run(parts.causal, True, return_lse or merge)
    if merge:
        out_a, lse_a = run(parts.unmasked, False, True)
        rows = _row_index(parts.merged_rows, out.device)
        # ([rows, H, D] as [1, H, rows, D] in NHD memory, the LSEs [1, H, rows])
        merged, merged_lse = _execute.merge_parts(
            [o.index_select(0, rows)[None].transpose(1, 2) for o in (out_a, out)],
            [t.index_select(1, rows)[None] for t in (lse_a, lse)], True)
        out.index_copy_(0, rows, merged.transpose(1, 2)[0])
        lse.index_copy_(1, rows, merged_lse[0])
    if parts.blind_rows:
        rows = _row_index(parts.blind_rows, out.device)
        out.index_fill_(0, rows, 0)
        if return_lse or merge:
            lse.index_fill_(1, rows, -math.inf)
    return out, (lse if return_lse else lse.new_empty(0))


def _run(q: Tensor, k: Tensor, v: Tensor, bounds_q: tuple[int, ...], bounds_k: tuple[int, ...],
         options: dict[str, Any]) -> Tensor | tuple[Tensor, Tensor]:
    """One sageattn call per sequence, on views, its output copied into the packed result."""
    return_lse = options["return_lse"]
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32) if return_lse else None
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        if q1 == q0:
            continue
        result = sageattn(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **options)
        if return_lse:
            part, part_lse = result
            assert lse is not None
            lse[:, q0:q1] = part_lse[0]
        else:
            part = result
        out[q0:q1] = part[0]
    return (out, lse) if return_lse else out  # type: ignore[return-value]


def _smooth_q_from_op(value: str) -> bool | str:
    return {"True": True, "False": False}.get(value, value)


@torch.library.custom_op(
    "sageattention2::sageattn_varlen", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
           "int max_seqlen_q, int max_seqlen_k, bool is_causal, float? scale, str qk_quant, "
           "str pv_quant, bool smooth_k, str smooth_q, bool smooth_v, bool return_lse, "
           "bool strict, str causal_alignment) -> (Tensor, Tensor)")
def _sageattn_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                        cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        is_causal: bool, scale: float | None, qk_quant: str, pv_quant: str,
                        smooth_k: bool, smooth_q: str, smooth_v: bool, return_lse: bool,
                        strict: bool, causal_alignment: str) -> tuple[Tensor, Tensor]:
    """sageattn_varlen as one opaque op of a torch.compile graph: the eager call."""
    result = sageattn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             is_causal=is_causal, scale=scale, qk_quant=qk_quant,
                             pv_quant=pv_quant, smooth_k=smooth_k,
                             smooth_q=_smooth_q_from_op(smooth_q), smooth_v=smooth_v,
                             return_lse=return_lse, strict=strict,
                             causal_alignment=causal_alignment)
    if return_lse:
        return result[0], result[1]
    assert isinstance(result, Tensor)
    return result, q.new_empty(0, dtype=torch.float32)


@_sageattn_varlen_op.register_fake
def _sageattn_varlen_fake(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          is_causal: bool, scale: float | None, qk_quant: str, pv_quant: str,
                          smooth_k: bool, smooth_q: str, smooth_v: bool, return_lse: bool,
                          strict: bool, causal_alignment: str) -> tuple[Tensor, Tensor]:
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)
