"""Using :func:`sageattn` inside code written against PyTorch's SDPA: :func:`patch_sdpa` (here),
diffusers' attention backend and processors (:mod:`sageattention2.integrations.diffusers`) and
transformers' attention implementation (:mod:`sageattention2.integrations.transformers`); each
library is imported only by its module."""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn.functional as F

from ..api import sageattn

__all__ = ["patch_sdpa"]

# Keyword-only options of sageattn that keep SDPA's calling convention and return type.
_PATCHABLE = frozenset(
    name
    for name, param in inspect.signature(sageattn).parameters.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY
) - {"tensor_layout", "return_lse"}


def _check_options(options: dict[str, Any], function: str) -> None:
    """The options an integration passes to every sageattn call: those that keep SDPA's calling
    convention and return type (:data:`_PATCHABLE`)."""
    unknown = sorted(set(options) - _PATCHABLE)
    if unknown:
        raise TypeError(f"{function} got unsupported keyword(s) {', '.join(unknown)}; allowed: "
                        f"{', '.join(sorted(_PATCHABLE))}")


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
    _check_options(sageattn_kwargs, "patch_sdpa")
    replacement = functools.partial(sageattn, **sageattn_kwargs)
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = replacement
    try:
        yield replacement
    finally:
        F.scaled_dot_product_attention = previous
