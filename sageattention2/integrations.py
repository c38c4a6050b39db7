"""Helpers to use :func:`sageattn` inside code written against PyTorch's SDPA."""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn.functional as F

from .api import sageattn

__all__ = ["patch_sdpa"]

# Keyword-only options of sageattn that keep SDPA's calling convention and return type.
_PATCHABLE = frozenset(
    name
    for name, param in inspect.signature(sageattn).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
) - {"tensor_layout", "return_lse"}


@contextlib.contextmanager
def patch_sdpa(**sageattn_kwargs: Any) -> Iterator[Callable[..., Any]]:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` with
    ``functools.partial(sageattn, **sageattn_kwargs)`` for the duration of the ``with`` block,
    restoring the previous function on exit (also on an exception). Yields the replacement.

    Only code that looks the function up as ``F.scaled_dot_product_attention`` /
    ``torch.nn.functional.scaled_dot_product_attention`` at call time is affected, not a
    reference taken earlier (``from torch.nn.functional import scaled_dot_product_attention``).
    Allowed keywords: qk_quant, pv_quant, smooth_k, smooth_q, smooth_v, strict (tensor_layout and
    return_lse would change SDPA's calling convention or return type).
    """
    unknown = sorted(set(sageattn_kwargs) - _PATCHABLE)
    if unknown:
        raise TypeError(
            f"patch_sdpa got unsupported keyword(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(_PATCHABLE))}"
        )
    replacement = functools.partial(sageattn, **sageattn_kwargs)
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = replacement
    try:
        yield replacement
    finally:
        F.scaled_dot_product_attention = previous
