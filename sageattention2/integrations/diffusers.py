"""sageattn in diffusers, chosen as diffusers users choose attention.

Models on diffusers' attention dispatcher (Flux, Wan, HunyuanVideo, QwenImage, LTX, ...) pick a
backend by name; :func:`register` adds ``"sageattention2"`` to the dispatcher (no file of
diffusers is edited), after which diffusers' own API selects it::

    from sageattention2.integrations import diffusers as sage_diffusers

    sage_diffusers.register()
    transformer.set_attention_backend("sageattention2")     # this model
    with attention_backend("sageattention2"): ...            # or a block of code

Models whose attention still runs through processors calling
``F.scaled_dot_product_attention`` (the UNets, SD3, CogVideoX) are switched per model:
:func:`apply` wraps that model's processors so that their SDPA calls run :func:`sageattn` (no
other model, and no other code, sees a change), and :func:`remove` restores them.

The backend takes the dispatcher's ``[B, N, H, D]`` tensors in place (``tensor_layout="NHD"``:
no copies), honours ``attn_mask`` (a ``[B, N_kv]`` key mask as diffusers' native backend reads
it, or any mask SDPA takes), ``is_causal``, ``scale`` and ``enable_gqa``, and returns the
natural-log LSE as ``[B, N, H]`` when the dispatcher asks for it. What the quantized kernels
cannot serve (a mask, dropout, ...) runs exact SDPA, as :func:`sageattn` documents. Context
parallelism (``_parallel_config``) is not supported: the backend says so, and diffusers refuses
to select it on a model that has it enabled.

Tested with diffusers 0.42.1.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor

from ..api import sageattn
from . import _check_options, patch_sdpa

__all__ = ["BACKEND", "SageAttnProcessor", "apply", "register", "remove"]

BACKEND = "sageattention2"
_MEMBER_NAME = "SAGEATTENTION2"
_options: dict[str, Any] = {}


def _backend_member(names: Any) -> Any:
    """``names(BACKEND)``, the dispatcher's ``AttentionBackendName`` member of our backend, added
    to the enum when it is not there yet (the dispatcher keys its registry by members, and
    ``set_attention_backend`` checks names against the enum)."""
    member = names._value2member_map_.get(BACKEND)
    if member is None:
        member = str.__new__(names, BACKEND)
        member._name_, member._value_ = _MEMBER_NAME, BACKEND
        names._value2member_map_[BACKEND] = member
        names._member_map_[_MEMBER_NAME] = member
        names._member_names_.append(_MEMBER_NAME)
    return member


def _sageattention2_backend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The dispatcher's backend function: its arguments by name, tensors ``[B, N, H, D]``."""
    if _parallel_config is not None:
        raise NotImplementedError("the sageattention2 attention backend does not support "
                                  "context parallelism; use diffusers' native backend for it")
    if (attn_mask is not None and attn_mask.dim() == 2 and query.dim() == 4
            and attn_mask.shape == (query.shape[0], key.shape[1])):
        attn_mask = attn_mask[:, None, None, :]  # a key mask [B, N_kv], as the native backend
    result = sageattn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      tensor_layout="NHD", return_lse=return_lse, **_options)
    if not return_lse:
        return result
    out, lse = result
    return out, lse.transpose(-1, -2)  # [B, H, N] -> [B, N, H], the dispatcher's form


def register(**sageattn_kwargs: Any) -> str:
    """Register the ``"sageattention2"`` backend in diffusers' attention dispatcher (again: only
    the options change). ``sageattn_kwargs``: options of every call through the backend
    (qk_quant, pv_quant, smooth_k, smooth_q, smooth_v, strict). Returns the backend's name."""
    _check_options(sageattn_kwargs, "register")
    from diffusers.models import attention_dispatch as dispatch

    member = _backend_member(dispatch.AttentionBackendName)
    _options.clear()
    _options.update(sageattn_kwargs)
    dispatch._AttentionBackendRegistry.register(
        member, constraints=[dispatch._check_device, dispatch._check_shape],
        supports_context_parallel=False)(_sageattention2_backend)
    return BACKEND


class SageAttnProcessor:
    """A diffusers attention processor whose ``F.scaled_dot_product_attention`` calls run
    :func:`sageattn`: the model's own processor, run with SDPA replaced for the duration of its
    call (:func:`apply`). Attributes are the wrapped processor's; ``inner`` is the processor."""

    def __init__(self, inner: Any, **sageattn_kwargs: Any) -> None:
        self.__dict__["inner"] = inner
        self.__dict__["options"] = sageattn_kwargs

        @functools.wraps(inner.__call__)  # the attention module reads the call's parameters
        def call(*args: Any, **kwargs: Any) -> Any:
            with patch_sdpa(**sageattn_kwargs):
                return inner(*args, **kwargs)

        self.__dict__["__call__"] = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["__call__"](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


def _processor_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if hasattr(m, "set_processor") and getattr(m, "processor", None) is not None]


def apply(model: torch.nn.Module, **sageattn_kwargs: Any) -> int:
    """Make ``model``'s attention processors run :func:`sageattn` where they call SDPA (each
    wrapped in a :class:`SageAttnProcessor`; already wrapped ones get the new options).
    Returns how many processors were wrapped."""
    _check_options(sageattn_kwargs, "apply")
    modules = _processor_modules(model)
    for module in modules:
        processor = module.processor
        inner = processor.inner if isinstance(processor, SageAttnProcessor) else processor
        if not callable(inner) or not inspect.signature(inner.__call__).parameters:
            continue
        module.set_processor(SageAttnProcessor(inner, **sageattn_kwargs))
    return sum(isinstance(m.processor, SageAttnProcessor) for m in modules)


def remove(model: torch.nn.Module) -> int:
    """Undo :func:`apply`: give ``model``'s attention modules their processors back. Returns
    how many were restored."""
    restored = 0
    for module in _processor_modules(model):
        if isinstance(module.processor, SageAttnProcessor):
            module.set_processor(module.processor.inner)
            restored += 1
    return restored
