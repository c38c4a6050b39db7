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
cannot serve (a mask, dropout, ...) runs exact SDPA, as :func:`sageattn` documents.

Context parallelism: the backend supports it, so diffusers' own API applies it to any model with
a context-parallel plan (Wan, Flux, HunyuanVideo, QwenImage, ...)::

    transformer.set_attention_backend("sageattention2")     # before or after:
    transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=2))  # or ulysses_degree

Each attention call then runs :func:`sageattention2.parallel.context_parallel_attention` on the
config's ring and Ulysses groups: Ulysses is the one-GPU call on each rank's heads, and the ring
sends each rank's K and V once, quantized as the Hopper kernel reads them where it serves the
call (``register(exchange=...)`` chooses). diffusers' ``ulysses_anything`` and ``ring_anything``
(shards of different lengths, and for Ulysses heads that do not divide among the ranks:
``diffusers-cli run --context-parallel`` sets ``ulysses_anything``) run the same way, the ring's
uneven shards in the input dtype.

Tested with diffusers 0.42.1.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor

from ..api import sageattn
from ..parallel import EXCHANGES, context_parallel_attention
from . import _check_options, patch_sdpa

__all__ = ["BACKEND", "SageAttnProcessor", "apply", "register", "remove"]

BACKEND = "sageattention2"
_MEMBER_NAME = "SAGEATTENTION2"
_options: dict[str, Any] = {}
_exchange = ["auto"]  # how K and V travel in the ring under context parallelism (register)


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
        result = _context_parallel(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa, return_lse, _parallel_config)
    else:
        if (attn_mask is not None and attn_mask.dim() == 2 and query.dim() == 4
                and attn_mask.shape == (query.shape[0], key.shape[1])):
            attn_mask = attn_mask[:, None, None, :]  # a key mask [B, N_kv], as the native backend
        result = sageattn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                          tensor_layout="NHD", return_lse=return_lse, **_options)
    if not return_lse:
        return result
    out, lse = result
    return out, lse.transpose(-1, -2)  # [B, H, N] -> [B, N, H], the dispatcher's form


def _context_parallel(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                      dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                      return_lse: bool, parallel_config: Any) -> Tensor | tuple[Tensor, Tensor]:
    """The backend under diffusers' context parallelism: the config's ring and Ulysses groups
    (the LSE in sageattn's ``[B, H, N]``, as the caller turns it)."""
    config = parallel_config.context_parallel_config
    ring = config._ring_mesh.get_group() if config.ring_degree > 1 else None
    ulysses = config._ulysses_mesh.get_group() if config.ulysses_degree > 1 else None
    return context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, ring_group=ring,
        ulysses_group=ulysses, tensor_layout="NHD", return_lse=return_lse, exchange=_exchange[0],
        **_options)


def register(*, exchange: str = "auto", **sageattn_kwargs: Any) -> str:
    """Register the ``"sageattention2"`` backend in diffusers' attention dispatcher (again: only
    the options change). ``sageattn_kwargs``: options of every call through the backend
    (qk_quant, pv_quant, smooth_k, smooth_q, smooth_v, strict). ``exchange``: how K and V travel
    in the ring under context parallelism ("auto", "quantized", "input":
    :func:`sageattention2.parallel.context_parallel_attention`). Returns the backend's name."""
    _check_options(sageattn_kwargs, "register")
    if exchange not in EXCHANGES:
        raise ValueError(f"register: exchange must be one of {', '.join(map(repr, EXCHANGES))}; "
                         f"got {exchange!r}")
    from diffusers.models import attention_dispatch as dispatch

    member = _backend_member(dispatch.AttentionBackendName)
    _options.clear()
    _options.update(sageattn_kwargs)
    _exchange[0] = exchange
    dispatch._AttentionBackendRegistry.register(
        member, constraints=[dispatch._check_device, dispatch._check_shape],
        supports_context_parallel=True)(_sageattention2_backend)
    return BACKEND


class SageAttnProcessor:
    """A diffusers attention processor whose ``F.scaled_dot_product_attention`` calls run
    :func:`sageattn`: the model's own processor, run with SDPA replaced for the duration of its
    call (:func:`apply`). Attributes, read and written, are the wrapped processor's; ``inner``
    is the processor."""

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

    def __setattr__(self, name: str, value: Any) -> None:
        # What code sets on a model's processor (IP-Adapter's scale, ...) is the wrapped one's.
        setattr(self.__dict__["inner"], name, value)


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
