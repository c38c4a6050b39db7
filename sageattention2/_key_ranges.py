"""Key-padding masks on the quantized kernels (issue 34, item 1).

A mask that only removes keys, the same for every head and query of a batch item, and leaves each
item one contiguous range of keys (right padding: a prefix; left padding: a suffix;
HunyuanVideo's joint attention, the dispatcher's ``[B, N_kv]`` key masks) is the attention of
each item's queries over that range of its keys alone. :func:`key_ranges` finds the ranges, and
the call then runs the kernel on K and V narrowed to them (views, no copies; one kernel call per
run of batch items that share a range): exactly the masked attention, with K's quantization
groups and smoothing mean over the item's own keys only, never the padding.

Masks of shape ``[..., 1, 1, N_kv]`` (after broadcasting from the left: no head or query
dimension) are examined, and ``[..., 1, N_q, N_kv]`` ones (what transformers materializes for a
padded encoder), which qualify when every query's row is the same; a mask of any other shape
costs nothing. Examining one reads it once on the GPU and waits for the result (one
synchronisation), and the answer is kept for that mask tensor while it is alive and unmodified
(models pass the same mask to every layer; ``_tensor_memo``). An inference tensor (no version
counter) is examined the first time it is seen; the answer is kept for it unverified
(:func:`remembered_unverified`), and the Hopper kernel's calls then read its key ranges again
on the GPU, with no synchronisation (NaN for the items of a mask modified in place into one that
is not a key-padding mask: docs/DECISIONS.md#d43); the other kernels' calls examine it again.
``_execute`` weighs the kernel against SDPA's masked call (``_crossover.masked_sdpa_factor``)
and does not examine masks where exact SDPA is faster anyway (``qk_quant="auto"``).
During a CUDA graph capture a mask not examined before is not examined (the call is captured as
exact SDPA).
Bool masks (True: attend) and additive masks whose values are 0 (attend) or -inf / the dtype's
lowest value (masked) qualify; an item left with no key does not (SDPA gives it NaN).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._tensor_memo import MISSING, TensorMemo

__all__ = ["KeyRanges", "clear_cache", "could_be_key_mask", "item_ranges", "key_ranges", "remembered_unverified",
           "runs"]

KeyRanges = tuple[tuple[int, int], ...]  # (first key, end) per batch item

_examined = TensorMemo()
_seen_inference = TensorMemo(identity=True)


# Per-query masks above this many elements are not examined (the comparison of their rows
# would allocate as much again): exact SDPA.
MAX_QUERY_MASK_ELEMENTS = 1 << 28


def could_be_key_mask(shape: tuple[int, ...], batch: int, n_k: int, n_q: int = 1) -> bool:
    """Whether a mask of this shape is examined: ``[..., 1, 1, N_kv]`` or ``[..., 1, N_q,
    N_kv]`` after broadcasting from the left to 4-D, with one row or one per batch item (decided
    once per kind of call)."""
    if len(shape) > 4 or n_k == 0:
        return False
    b, h, rows, keys = (1,) * (4 - len(shape)) + tuple(shape)
    return (h == 1 and rows in (1, n_q) and keys == n_k and b in (1, batch)
            and b * rows * keys <= max(MAX_QUERY_MASK_ELEMENTS, b * keys))


def item_ranges(per_query: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per item of a ``[b, n_rows, n_k]`` bool or additive mask: its first kept key (0 when
    none), its count of kept keys, and whether it is a key-padding mask the kernels run (every
    row the same as the first; additive, each value 0 or masked; the kept keys one contiguous,
    non-empty range). On the mask's device, without a synchronisation. What :func:`key_ranges`
    decides on, and what the kernels' own mask reader computes (``ops.key_ranges_of_mask``)."""
    b, n_rows, n_k = per_query.shape
    rows = per_query[:, 0]
    same_rows = (per_query == per_query[:, :1]).reshape(b, -1).all(-1) if n_rows > 1 else \
        torch.ones(b, dtype=torch.bool, device=rows.device)
    if rows.dtype == torch.bool:
        keep, values_ok = rows, same_rows
    else:
        keep = rows == 0
        masked = (rows == -math.inf) | (rows == torch.finfo(rows.dtype).min)
        values_ok = (keep | masked).all(-1) & same_rows
    counts = keep.sum(-1)
    starts = keep.to(torch.int32).argmax(-1)  # the first kept key (0 when none)
    index = torch.arange(n_k, device=rows.device)
    expected = (index >= starts[:, None]) & (index < (starts + counts)[:, None])
    return starts, counts, values_ok & (expected == keep).all(-1) & (counts > 0)


def _examine(mask: Tensor, batch: int, n_k: int, n_q: int) -> KeyRanges | None:
    if not could_be_key_mask(mask.shape, batch, n_k, n_q) or mask.device.type == "meta":
        return None
    b, _, n_rows, _ = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    starts, counts, ok = item_ranges(mask.reshape(b, n_rows, n_k))
    found = torch.stack([starts.long(), counts.long(), ok.long()]).tolist()  # the one synchronisation
    if not all(found[2]):
        return None
    ranges = tuple((s, s + c) for s, c in zip(found[0], found[1]))
    return ranges * batch if len(ranges) == 1 else ranges


def key_ranges(mask: Tensor, batch: int, n_k: int, n_q: int = 1) -> KeyRanges | None:
    """Each batch item's range of keys if ``mask`` (broadcasting to ``[batch, H, n_q, n_k]``) is
    a key-padding mask of the kind the kernels run (see the module), else None."""
    if not could_be_key_mask(mask.shape, batch, n_k, n_q):
        return None  # (costs a shape check: no synchronisation, nothing remembered)
    ranges = _examined.get(mask, (batch, n_k, n_q))
    if ranges is not MISSING:
        return ranges
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # reading the mask would end a CUDA graph capture: exact SDPA, not remembered
    ranges = _examine(mask, batch, n_k, n_q)
    _examined.put(mask, ranges, (batch, n_k, n_q))
    if mask.is_inference():
        _seen_inference.put(mask, ranges, (batch, n_k, n_q))
    return ranges


def remembered_unverified(mask: Tensor, batch: int, n_k: int, n_q: int = 1) -> Any:
    """What :func:`key_ranges` found for this inference tensor before (MISSING if it was not
    examined): unverified, as it may have been written in place since."""
    return _seen_inference.get(mask, (batch, n_k, n_q)) if mask.is_inference() else MISSING


def runs(ranges: KeyRanges) -> list[tuple[int, int, int, int]]:
    """Consecutive batch items that share a range: (first item, end item, first key, end key)."""
    found: list[tuple[int, int, int, int]] = []
    for b, (start, end) in enumerate(ranges):
        if found and found[-1][1] == b and found[-1][2:] == (start, end):
            found[-1] = (found[-1][0], b + 1, start, end)
        else:
            found.append((b, b + 1, start, end))
    return found


def clear_cache() -> None:
    _examined.clear()
    _seen_inference.clear()
