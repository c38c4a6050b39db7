"""sageattn in transformers, chosen as transformers users choose attention.

:func:`register` adds an attention function and its mask function under one name,
``"sageattn2"``, to transformers' ``AttentionInterface`` and ``AttentionMaskInterface``, after
which transformers' own API selects it::

    from sageattention2.integrations import transformers as sage_transformers

    sage_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sageattn2")
    model.set_attn_implementation("sageattn2")                # or on a loaded model

(The name avoids "flash" and "sdpa", which transformers treats specially.) The attention
function takes transformers' ``[B, H, N, D]`` tensors with K and V not expanded for
grouped-query attention (``enable_gqa``: the kernels read each KV head once), and returns
``[B, N, H, D]``. The mask function is transformers' SDPA mask: no mask for a plain causal
decoder (the kernel's causal path), a boolean ``[B, 1, N_q, N_kv]`` mask for padding, which
sageattn serves with exact SDPA (K and V then expanded, as transformers' SDPA path does: SDPA's
GQA with a mask has no fused kernel). ``output_attentions=True`` gets no weights and a warning,
as with transformers' "sdpa"; a ``softcap`` is refused, and a ``position_bias`` (T5-style)
runs transformers' own SDPA function.

Tested with transformers 5.17 and 5.24.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from ..api import sageattn
from . import _check_options

__all__ = ["NAME", "attention_forward", "register"]

NAME = "sageattn2"
_options: dict[str, Any] = {}
_warned_output_attentions = False


def _repeat_heads(t: Tensor, groups: int) -> Tensor:
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention function for the ``"sageattn2"`` implementation."""
    global _warned_output_attentions
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='sageattn2' does not support softcap; use 'eager' "
                         "or 'flex_attention' for models that need it")
    if kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if kwargs.get("output_attentions") and not _warned_output_attentions:
        _warned_output_attentions = True
        warnings.warn("attn_implementation='sageattn2' returns no attention weights "
                      "(output_attentions=True); use 'eager' for them", stacklevel=2)
    n_q, n_kv = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    if attention_mask is not None and groups > 1:  # exact SDPA with a mask: no fused GQA
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and n_q > 1 and attention_mask is None
    if causal and n_kv > n_q:  # as transformers' SDPA path: top-left causal over the first N_q
        key, value = key[:, :, :n_q], value[:, :, :n_q]
    out = sageattn(query, key, value, attention_mask, dropout, causal, scaling,
                   key.shape[1] != query.shape[1], **_options)
    return out.transpose(1, 2).contiguous(), None


def register(**sageattn_kwargs: Any) -> str:
    """Register the ``"sageattn2"`` attention and mask functions with transformers (again: only
    the options change). ``sageattn_kwargs``: options of every call (qk_quant, pv_quant,
    smooth_k, smooth_q, smooth_v, strict). Returns the name."""
    _check_options(sageattn_kwargs, "register")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _options.clear()
    _options.update(sageattn_kwargs)
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
