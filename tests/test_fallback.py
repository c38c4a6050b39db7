"""The exact fallback: a call the quantized kernels cannot serve runs SDPA with the same
arguments (same result, bit for bit, also for features only the fallback serves), its exact LSE,
and the fallback warning (once per reason) or strict's error."""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import pytest
import torch

from helpers import ORIGINAL_SDPA, fallback_warnings, hnd, qkv, quiet_sageattn, sdpa_in_layout
from sageattention2 import sageattn

# ------------------------------------------------------------------------------------------------
# The exact fallback equals SDPA
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("batch", [2, None], ids=["4d", "3d"])
def test_fallback_equals_sdpa(dtype: torch.dtype, layout: str, batch: int | None) -> None:
    q, k, v = qkv(b=batch, dtype=dtype, layout=layout)
    out = quiet_sageattn(q, k, v, tensor_layout=layout)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(out, sdpa_in_layout(q, k, v, layout))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize(
    "case",
    [
        dict(shape=dict(hkv=2), kwargs=dict(enable_gqa=True)),
        dict(shape=dict(hkv=1, b=None), kwargs=dict(enable_gqa=True)),
        dict(shape=dict(nq=5, nk=13), kwargs=dict(is_causal=True)),
        dict(shape=dict(nq=13, nk=5), kwargs=dict(is_causal=True)),
        dict(shape=dict(hkv=2, nq=7, nk=11), kwargs=dict(is_causal=True, enable_gqa=True)),
        dict(shape=dict(nq=5, nk=7), kwargs=dict(scale=0.3)),
        dict(shape=dict(dv=24), kwargs={}),
        dict(shape=dict(d=12), kwargs={}),
        dict(shape=dict(nq=5, nk=7), mask=((5, 7), torch.bool)),
        dict(shape=dict(nq=5, nk=7), mask=((2, 1, 5, 7), "q")),
        dict(shape=dict(nq=5, nk=7, dtype=torch.bfloat16), mask=((4, 5, 7), torch.float32)),
        dict(shape=dict(nq=5, nk=7, b=None), mask=((4, 1, 7), torch.bool)),
    ],
    ids=["gqa", "gqa-3d", "causal-nq<nk", "causal-nq>nk", "causal-gqa", "scale", "dv!=d",
         "head_dim-12", "bool-mask", "float-mask", "f32-mask-bf16", "mask-3d"],
)
def test_fallback_features_equal_sdpa(layout: str, case: dict[str, Any]) -> None:
    q, k, v = qkv(layout=layout, **case["shape"])
    kwargs = dict(case.get("kwargs", {}))
    if "mask" in case:
        shape, mask_dtype = case["mask"]
        gen = torch.Generator().manual_seed(1)
        if mask_dtype is torch.bool:
            mask = torch.rand(shape, generator=gen) > 0.3
        else:
            mask = torch.randn(shape, generator=gen)
            mask = mask.to(q.dtype if mask_dtype == "q" else mask_dtype)
        kwargs["attn_mask"] = mask
    out = quiet_sageattn(q, k, v, tensor_layout=layout, **kwargs)
    assert torch.equal(out, sdpa_in_layout(q, k, v, layout, **kwargs))


def test_float32_mask_beside_float64_inputs() -> None:
    """sageattn takes a float32 mask for float64 inputs; the fallback's result is float64
    attention with that mask (PyTorch's CPU kernel alone gets the pair wrong on AVX2 hosts)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 13, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(2, 3, 13, 13, generator=gen)
    want = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + mask.double(), -1) @ v
    for _ in range(2):  # (validated, then through the call cache)
        torch.testing.assert_close(quiet_sageattn(q, k, v, attn_mask=mask), want, rtol=0, atol=1e-12)


def test_positional_arguments_follow_sdpa() -> None:
    q, k, v = qkv(hkv=2, nq=5, nk=7)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) > 0.5
    expected = ORIGINAL_SDPA(q, k, v, mask, 0.0, False, scale=0.5, enable_gqa=True)
    # SDPA's first six parameters are positional; sageattn also takes scale and enable_gqa so.
    assert torch.equal(quiet_sageattn(q, k, v, mask, 0.0, False, 0.5, True), expected)


def test_parameters_are_sdpas() -> None:
    """sageattn's first parameters are SDPA's, read from SDPA's own schema (aten's, which
    F.scaled_dot_product_attention binds), so that a new or renamed SDPA parameter fails here:
    the same names in the same order with the same defaults; SDPA's keyword-only ones
    (``scale``, ``enable_gqa``) are keyword-or-positional in sageattn, which accepts every call
    SDPA does."""
    schema = torch.ops.aten.scaled_dot_product_attention.default._schema
    params = list(inspect.signature(sageattn).parameters.values())
    assert len(params) > len(schema.arguments)
    for arg, param in zip(schema.arguments, params):
        assert param.name == arg.name
        assert param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        if arg.default_value is None and not arg.type.kind() == "OptionalType":
            assert param.default is inspect.Parameter.empty, arg.name  # required
        else:
            assert param.default == arg.default_value, arg.name
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(schema.arguments):])


@pytest.mark.parametrize("style", ["positional", "keywords", "mixed"])
def test_every_sdpa_calling_convention(style: str) -> None:
    """A call of F.scaled_dot_product_attention in any of its forms (diffusers' dispatcher names
    every argument) gives SDPA's result, on sageattn and on the patched F."""
    from sageattention2.integrations import patch_sdpa

    q, k, v = qkv(hkv=2, nq=5, nk=7)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) > 0.5
    names = dict(query=q, key=k, value=v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=0.5,
                 enable_gqa=True)
    expected = ORIGINAL_SDPA(**names)
    args, kwargs = {
        "positional": ((q, k, v, mask, 0.0, False), dict(scale=0.5, enable_gqa=True)),
        "keywords": ((), names),
        "mixed": ((q,), dict(value=v, key=k, attn_mask=mask, enable_gqa=True, scale=0.5)),
    }[style]
    assert torch.equal(quiet_sageattn(*args, **kwargs), expected)
    with warnings.catch_warnings(), patch_sdpa():
        warnings.simplefilter("ignore")
        assert torch.equal(torch.nn.functional.scaled_dot_product_attention(*args, **kwargs), expected)


def test_explain_on_cpu() -> None:
    """explain says what sageattn runs without running it, validates as sageattn does, and an
    empty call runs nothing."""
    import sageattention2

    q, k, v = qkv()
    explanation = sageattention2.explain(q, k, v, is_causal=True)
    assert not explanation.quantized and explanation.kernel == "exact SDPA"
    assert explanation.reason == "the quantized kernels need CUDA tensors, got cpu"
    assert sageattention2.explain(q[:, :, :0], k, v) == (False, "nothing (empty)", None, None, None)
    with pytest.raises(ValueError, match="dropout_p"):
        sageattention2.explain(q, k, v, dropout_p=1.5)
    with pytest.raises(TypeError):
        sageattention2.explain(q, k, v, bogus=1)


def test_dropout_matches_sdpa() -> None:
    q, k, v = qkv()
    torch.manual_seed(3)
    out = quiet_sageattn(q, k, v, dropout_p=0.25)
    torch.manual_seed(3)
    assert torch.equal(out, ORIGINAL_SDPA(q, k, v, dropout_p=0.25))


def test_fallback_supports_autograd() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(nq=5))
    quiet_sageattn(q, k, v, is_causal=True).sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ORIGINAL_SDPA(q, k, v, is_causal=True).sum().backward()
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


# ------------------------------------------------------------------------------------------------
# return_lse
# ------------------------------------------------------------------------------------------------


def lse_float64(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                is_causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log-sum-exp of the scaled, masked scores; q [B, Hq, Nq, D], k [B, Hkv, Nk, D]."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.double() @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~allowed, -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize(
    "shape,kwargs",
    [
        (dict(), dict()),
        (dict(hkv=2, nq=6, nk=10, dtype=torch.bfloat16), dict(enable_gqa=True, is_causal=True)),
        (dict(nq=10, nk=6), dict(is_causal=True, scale=0.7)),
        (dict(b=None, nq=6, nk=10), dict()),
        (dict(nq=4, nk=6), dict(mask=True)),
    ],
    ids=["plain", "gqa-causal-bf16", "causal-nq>nk", "3d", "mask-with-empty-row"],
)
def test_return_lse(layout: str, shape: dict[str, Any], kwargs: dict[str, Any]) -> None:
    q, k, v = qkv(layout=layout, **shape)
    kwargs = dict(kwargs)
    mask = None
    if kwargs.pop("mask", False):
        mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(4)) > 0.5
        mask[1] = False  # a query that sees no key
        kwargs["attn_mask"] = mask
    out, lse = quiet_sageattn(q, k, v, tensor_layout=layout, return_lse=True, **kwargs)
    assert torch.equal(out, quiet_sageattn(q, k, v, tensor_layout=layout, **kwargs))
    q4, k4 = (hnd(t, layout) for t in (q, k))
    if shape.get("b", 2) is None:
        q4, k4 = q4[None], k4[None]
    expected = lse_float64(q4, k4, kwargs.get("scale"), kwargs.get("is_causal", False), mask)
    if shape.get("b", 2) is None:
        expected = expected[0]
    assert lse.dtype == torch.float32 and lse.shape == expected.shape
    torch.testing.assert_close(lse, expected.float(), rtol=1e-6, atol=1e-6)
    if mask is not None:
        assert torch.isneginf(lse[:, :, 1]).all() and not hnd(out, layout)[:, :, 1].any()


# ------------------------------------------------------------------------------------------------
# Fallback warning, strict
# ------------------------------------------------------------------------------------------------


def test_fallback_warns_once_per_reason() -> None:
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            sageattn(q, k, v)
        sageattn(q.double(), k.double(), v.double(), is_causal=True)  # same first reason: cpu
        messages = fallback_warnings(record)
        assert len(messages) == 1
        assert "need CUDA tensors, got cpu" in messages[0] and "strict=True" in messages[0]
        assert record[0].filename == __file__  # points at the caller
        meta = [torch.empty(t.shape, device="meta") for t in (q, k, v)]
        sageattn(*meta)
        sageattn(*meta)
        messages = fallback_warnings(record)
    assert len(messages) == 2
    assert messages[1].endswith("got meta. This warning is shown once per reason; pass "
                                "strict=True to raise.")


def test_strict_raises_with_reason() -> None:
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(NotImplementedError, match=r"strict=True.*need CUDA tensors, got cpu$"):
            sageattn(q, k, v, strict=True)
    assert not fallback_warnings(record)
