"""What the host learned from reading a small GPU tensor (a mask's key ranges, ``cu_seqlens``'
boundaries), kept while that tensor is alive and unmodified, so that a model passing the same
tensor to every layer pays one synchronisation, not one per layer.

"Unmodified" is the tensor's version counter, which every in-place write bumps. Inference
tensors (made under ``torch.inference_mode``) have none, so nothing read from them is kept:
they are read again on every call (correct, at one synchronisation per call).
"""
from __future__ import annotations

import weakref
from typing import Any, Hashable

from torch import Tensor

__all__ = ["MISSING", "TensorMemo"]

MISSING = object()  # what get returns for a value not kept


class TensorMemo:
    """Values keyed by (tensor, key): found only for the same live tensor at the same version."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple[int, Hashable], tuple[weakref.ref[Tensor], int, Any]] = {}

    def get(self, tensor: Tensor, key: Hashable = None) -> Any:
        entry = self._entries.get((id(tensor), key))
        if entry is None or entry[0]() is not tensor or tensor.is_inference() \
                or entry[1] != tensor._version:
            return MISSING
        return entry[2]

    def put(self, tensor: Tensor, value: Any, key: Hashable = None) -> None:
        if tensor.is_inference():
            return  # no version counter: an in-place write could not be seen
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[(id(tensor), key)] = (weakref.ref(tensor), tensor._version, value)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
