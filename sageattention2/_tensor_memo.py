"""What the host learned from reading a small GPU tensor (a mask's key ranges, ``cu_seqlens``'
boundaries), kept while that tensor is alive and unmodified, so that a model passing the same
tensor to every layer pays one synchronisation, not one per layer.

"Unmodified" is the tensor's version counter, which every in-place write bumps. Inference
tensors (made under ``torch.inference_mode``) have none, so nothing read from them is kept
unless the caller asks for ``identity``: the value is then kept for the same live tensor (same
storage address and shape), unverified, and the caller must check it where it is used (a key
range read again on the GPU: docs/DECISIONS.md#d43).
"""
from __future__ import annotations

import weakref
from typing import Any, Hashable

from torch import Tensor

__all__ = ["MISSING", "TensorMemo"]

MISSING = object()  # what get returns for a value not kept


class TensorMemo:
    """Values keyed by (tensor, key): found only for the same live tensor at the same version."""

    def __init__(self, max_entries: int = 64, identity: bool = False) -> None:
        self.max_entries = max_entries
        self.identity = identity  # inference tensors kept by identity (unverified)
        self._entries: dict[tuple[int, Hashable], tuple[weakref.ref[Tensor], Any, Any]] = {}

    def _stamp(self, tensor: Tensor) -> Any:
        if tensor.is_inference():  # no version counter: what identifies it
            return (tensor.data_ptr(), tuple(tensor.shape)) if self.identity else None
        return tensor._version

    def get(self, tensor: Tensor, key: Hashable = None) -> Any:
        entry = self._entries.get((id(tensor), key))
        stamp = self._stamp(tensor)
        if entry is None or entry[0]() is not tensor or stamp is None or entry[1] != stamp:
            return MISSING
        return entry[2]

    def put(self, tensor: Tensor, value: Any, key: Hashable = None) -> None:
        stamp = self._stamp(tensor)
        if stamp is None:
            return  # an inference tensor: an in-place write could not be seen
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[(id(tensor), key)] = (weakref.ref(tensor), stamp, value)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
