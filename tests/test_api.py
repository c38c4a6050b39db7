"""CPU tests of the public API (sageattn, kernel_plan, patch_sdpa, the CLI) and of the op layer.

The op tests (opcheck, torch.compile) need the compiled extension and skip without it; they run
the ops on CPU tensors through the CPU implementations that call the reference.
"""
from __future__ import annotations

import inspect
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import sageattention2
from sageattention2 import SageAttentionFallbackWarning, api, ops, sageattn
from sageattention2 import reference as ref
from sageattention2.integrations import patch_sdpa

REPO = Path(__file__).resolve().parents[1]
ORIGINAL_SDPA = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings() -> Iterator[None]:
    """Every test starts as if no fallback warning had been shown yet."""
    api._warned_reasons.clear()
    yield
    api._warned_reasons.clear()


def qkv(
    b: int | None = 2,
    hq: int = 4,
    hkv: int | None = None,
    nq: int = 9,
    nk: int | None = None,
    d: int = 16,
    dv: int | None = None,
    dtype: torch.dtype = torch.float32,
    layout: str = "HND",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v; ``b=None`` gives 3-D tensors."""
    hkv = hq if hkv is None else hkv
    nk = nq if nk is None else nk
    dv = d if dv is None else dv
    gen = torch.Generator().manual_seed(0)

    def make(h: int, n: int, dim: int) -> torch.Tensor:
        shape = (h, n, dim) if layout == "HND" else (n, h, dim)
        if b is not None:
            shape = (b, *shape)
        return torch.randn(shape, generator=gen).to(dtype)

    return make(hq, nq, d), make(hkv, nk, d), make(hkv, nk, dv)


def hnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(-3, -2) if layout == "NHD" else t


def sdpa_in_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                   **kwargs: Any) -> torch.Tensor:
    return hnd(ORIGINAL_SDPA(hnd(q, layout), hnd(k, layout), hnd(v, layout), **kwargs), layout)


def quiet_sageattn(*args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        return sageattn(*args, **kwargs)


def fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, SageAttentionFallbackWarning)]


def validated(*args: Any, **kwargs: Any) -> api.AttentionCall:
    """api._validate of the call sageattn(*args, **kwargs) (sageattn's defaults and names)."""
    bound = inspect.signature(sageattn).bind(*args, **kwargs)
    bound.apply_defaults()
    return api._validate(**bound.arguments)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

Q, K, V = qkv()
META_V = torch.empty(V.shape, device="meta")


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((Q.tolist(), K, V), {}, TypeError, r"^q must be a torch\.Tensor, got list"),
        ((Q, None, V), {}, TypeError, r"^k must be a torch\.Tensor"),
        ((Q, K, 3.0), {}, TypeError, r"^v must be a torch\.Tensor"),
        ((Q.int(), K.int(), V.int()), {}, TypeError, r"^q must be float16, bfloat16.*torch\.int32"),
        ((Q, K.double(), V), {}, TypeError,
         r"^k has dtype torch\.float64 but q has torch\.float32"),
        ((Q, K, V.half()), {}, TypeError, r"^v has dtype"),
        ((Q, K, META_V), {}, ValueError, r"^v is on meta but q is on cpu"),
        ((Q[0, 0], K[0, 0], V[0, 0]), {}, ValueError, r"^q must be 3-D or 4-D"),
        ((Q[None], K[None], V[None]), {}, ValueError, r"^q must be 3-D or 4-D.*\[B, H, N, D\]"),
        ((Q, K, V), {"tensor_layout": "NHD", "q": Q[0, 0]}, ValueError,
         r"^q must be 3-D or 4-D \(\[B, N, H, D\] or \[N, H, D\]"),
        ((Q, K[0], V), {}, ValueError, r"^k is 3-D but q is 4-D"),
        ((Q, K[:1], V[:1]), {}, ValueError, r"same batch size"),
        ((Q, K, V[:, :2]), {"enable_gqa": True}, ValueError, r"^k and v must have the same number "
                                                             r"of heads"),
        ((Q, K[:, :2], V[:, :2]), {}, ValueError, r"^q has 4 heads but k and v have 2; pass "
                                                  r"enable_gqa=True"),
        ((Q, K[:, :3], V[:, :3]), {"enable_gqa": True}, ValueError,
         r"^enable_gqa=True needs q's number of heads \(4\) to be a multiple"),
        ((Q, K[..., :8], V), {}, ValueError, r"^q and k must have the same head_dim, got 16 and 8"),
        ((Q, K, V[:, :, :5]), {}, ValueError, r"^k and v must have the same sequence length"),
        ((Q, K, V), {"tensor_layout": "BHND"}, ValueError,
         r"^tensor_layout must be one of 'HND', 'NHD'; got 'BHND'"),
        ((Q, K, V), {"tensor_layout": None}, ValueError, r"^tensor_layout must be one of"),
        ((Q, K, V), {"qk_quant": "fp8"}, ValueError,
         r"^qk_quant must be one of 'auto', 'int8', 'int4'; got 'fp8'"),
        ((Q, K, V), {"pv_quant": "e4m3"}, ValueError,
         r"^pv_quant must be one of 'auto', 'fp8', 'none'; got 'e4m3'"),
        ((Q, K, V), {"pv_quant": None}, ValueError, r"^pv_quant must be one of"),
        ((Q, K, V), {"pv_quant": False}, ValueError, r"^pv_quant must be one of .*; got False"),
        ((Q, K, V), {"smooth_q": "token"}, ValueError,
         r"^smooth_q must be True, False, 'auto', 'head' or 'block'; got 'token'"),
        ((Q, K, V), {"smooth_q": 1}, ValueError, r"^smooth_q must be"),
        ((Q, K, V), {"is_causal": True, "attn_mask": torch.ones(9, 9, dtype=torch.bool)},
         ValueError, r"^attn_mask and is_causal=True are mutually exclusive"),
        ((Q, K, V), {"dropout_p": 1.0}, ValueError, r"^dropout_p must be in \[0, 1\), got 1.0"),
        ((Q, K, V), {"dropout_p": -0.1}, ValueError, r"^dropout_p must be in \[0, 1\)"),
        ((Q, K, V), {"dropout_p": math.nan}, ValueError, r"^dropout_p must be in \[0, 1\)"),
        ((Q, K, V), {"dropout_p": "0.1"}, TypeError, r"^dropout_p must be a real number"),
        ((Q, K, V), {"scale": "1"}, TypeError, r"^scale must be a real number"),
        ((Q, K, V), {"scale": math.inf}, ValueError, r"^scale must be finite or None"),
        ((Q, K, V), {"attn_mask": [[True]]}, TypeError, r"^attn_mask must be a torch\.Tensor or "
                                                        r"None"),
        ((Q, K, V), {"attn_mask": torch.ones(9, 9, dtype=torch.int64)}, TypeError,
         r"^attn_mask must be bool, float32 or q's dtype"),
        ((Q, K, V), {"attn_mask": torch.ones(9, 9, device="meta")}, ValueError,
         r"^attn_mask is on meta but q is on cpu"),
        ((Q, K, V), {"attn_mask": torch.ones(9, 8, dtype=torch.bool)}, ValueError,
         r"^attn_mask of shape \(9, 8\) does not broadcast to the attention shape \(2, 4, 9, 9\)"),
        ((Q, K, V), {"attn_mask": torch.ones(3, 4, 9, 9, dtype=torch.bool)}, ValueError,
         r"^attn_mask of shape"),
        ((Q[0], K[0], V[0]), {"attn_mask": torch.ones(1, 4, 9, 9, dtype=torch.bool)}, ValueError,
         r"^attn_mask of shape \(1, 4, 9, 9\) does not broadcast to the attention shape "
         r"\(4, 9, 9\)"),
        ((Q, K, V), {"is_causal": 1}, TypeError, r"^is_causal must be a bool, got int"),
        ((Q, K, V), {"enable_gqa": "yes"}, TypeError, r"^enable_gqa must be a bool"),
        ((Q, K, V), {"smooth_k": None}, TypeError, r"^smooth_k must be a bool"),
        ((Q, K, V), {"smooth_v": 0}, TypeError, r"^smooth_v must be a bool"),
        ((Q, K, V), {"return_lse": "no"}, TypeError, r"^return_lse must be a bool"),
        ((Q, K, V), {"strict": 1.0}, TypeError, r"^strict must be a bool"),
    ],
)
def test_invalid_arguments(args: tuple[Any, ...], kwargs: dict[str, Any],
                           error: type[Exception], match: str) -> None:
    kwargs = dict(kwargs)
    if "q" in kwargs:  # replace q positionally
        args = (kwargs.pop("q"), *args[1:])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(error, match=match):
            sageattn(*args, **kwargs)
    assert not fallback_warnings(record)  # validation happens before any fallback


def test_smooth_q_qk_quant_and_pv_quant_resolution() -> None:
    q, k, v = qkv()
    assert validated(q, k, v).qk_quant == "int8"
    assert validated(q, k, v, qk_quant="int4", smooth_q=True).qk_quant == "int4"
    # "auto" stays for the kernel to decide (none on the Hopper kernel, "head" on the warp-level).
    assert [validated(q, k, v, smooth_q=m).smooth_q for m in ("auto", True, False, "head",
                                                               "block")] == [
        "auto", "head", "none", "head", "block"]
    # pv_quant "auto" stays too: FP8 or the input dtype depends on the GPU (_kernel_for).
    assert [validated(q, k, v, pv_quant=m).pv_quant for m in ("auto", "fp8", "none")] == [
        "auto", "fp8", "none"]
    assert validated(q, k, v).pv_quant == "auto"


def test_canonical_views_do_not_copy() -> None:
    q, k, v = qkv(layout="NHD")
    call = validated(q, k, v, tensor_layout="NHD")
    assert call.q.shape == (2, 4, 9, 16)
    assert call.q.data_ptr() == q.data_ptr() and call.q._base is q
    call3 = validated(q[0], k[0], v[0], tensor_layout="NHD")
    assert call3.q.shape == (1, 4, 9, 16) and call3.q.data_ptr() == q.data_ptr()


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


def test_positional_arguments_follow_sdpa() -> None:
    q, k, v = qkv(hkv=2, nq=5, nk=7)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) > 0.5
    expected = ORIGINAL_SDPA(q, k, v, mask, 0.0, False, scale=0.5, enable_gqa=True)
    # SDPA's first six parameters are positional; sageattn also takes scale and enable_gqa so.
    assert torch.equal(quiet_sageattn(q, k, v, mask, 0.0, False, 0.5, True), expected)


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


@pytest.mark.parametrize(
    ("dtype", "shape", "kwargs", "reason"),
    [
        (torch.float32, {}, {}, "float16 or bfloat16 inputs, got torch.float32"),
        (torch.float64, {}, {}, "got torch.float64"),
        (torch.float16, {}, {"dropout_p": 0.1}, "no dropout (dropout_p > 0)"),
        (torch.bfloat16, {}, {"attn_mask": torch.ones(9, 9, dtype=torch.bool)}, "no attn_mask"),
        (torch.float16, {"d": 12}, {},
         "the attention kernels are built for head_dim 64 and 128 (other multiples of 8 below "
         "128 are zero-padded to the next), got 12"),
        (torch.float16, {"d": 136}, {}, "built for head_dim 64 and 128 (other multiples of 8 "
                                        "below 128 are zero-padded to the next), got 136"),
        (torch.float16, {"d": 256}, {}, "got 256"),
        (torch.float16, {"d": 264}, {}, "got 264"),
        (torch.float16, {"dv": 32}, {}, "v's head_dim to be q's and k's, got 32 and 16"),
        (torch.float16, {}, {"requires_grad": True}, "require grad"),
        (torch.float16, {}, {}, None),  # head_dim 16: zero-padded to 64
        (torch.float16, {"d": 8}, {}, None),
        (torch.float16, {"d": 64}, {}, None),
        (torch.bfloat16, {"d": 96}, {}, None),
        (torch.float16, {"d": 128}, {}, None),
    ],
)
def test_unsupported_reasons(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                             shape: dict[str, Any], kwargs: dict[str, Any],
                             reason: str | None) -> None:
    """The reasons after the device check, in order (pretending the CPU were a CUDA device)."""
    monkeypatch.setattr(api, "_device_reason", lambda device: None)
    q, k, v = qkv(dtype=dtype, **shape)
    kwargs = dict(kwargs)
    if kwargs.pop("requires_grad", False):
        q.requires_grad_()
    call = validated(q, k, v, **kwargs)
    if reason is not None:
        assert reason in str(api._unsupported_reason(call))
    elif not ops.HAS_EXTENSION:
        assert "extension is not available" in str(api._unsupported_reason(call))
    elif not ops.has_op("attention_mma"):
        assert "attention kernels are not built yet" in str(api._unsupported_reason(call))
    else:
        assert api._unsupported_reason(call) is None
    if kwargs == {} and q.requires_grad:
        with torch.no_grad():  # without grad tracking the quantized path could serve it
            assert "require grad" not in str(api._unsupported_reason(call))


@pytest.mark.parametrize(
    ("head_dim", "kernel_head_dim"),
    [(8, 64), (16, 64), (32, 64), (56, 64), (64, 64), (72, 128), (80, 128), (96, 128),
     (120, 128), (128, 128), (136, None), (256, None), (12, None), (0, None), (100, None)],
)
def test_kernel_head_dim(head_dim: int, kernel_head_dim: int | None) -> None:
    """The head_dim the kernels run: the next built one (64, 128) for a multiple of 8."""
    assert api._kernel_head_dim(head_dim) == kernel_head_dim


def test_build_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    if ops.HAS_EXTENSION:
        assert ops.has_op("smoothing_stats") and not ops.has_op("no_such_op")
        with monkeypatch.context() as m:
            m.setattr(ops, "has_op", lambda name: False)
            m.setattr(ops, "_OP_HANDLES", {})  # the handles ops resolved at import
            assert api._build_reason() == "the attention kernels are not built yet"
            q, k, v = qkv(d=64, dtype=torch.float16)
            with pytest.raises(RuntimeError, match="has no attention_mma op"):
                ops.attention_mma(q, None, k, k, None, v, None, None, None, "int8", 9, 0.125,
                                  False, False, False)
    monkeypatch.setattr(ops, "HAS_EXTENSION", False)
    assert not ops.has_op("smoothing_stats")
    assert api._build_reason() == "the sageattention2._C extension is not available"


# ------------------------------------------------------------------------------------------------
# Which kernel serves a call (_kernel_for) and what falls back, on pretended GPUs and builds
# ------------------------------------------------------------------------------------------------

ALL_ARCHS = ["sm_80", "sm_89", "sm_90a"]
# The kernel families of a default build (csrc/module.cpp): what build_info() reports.
PREPROCESS_KEY = "preprocess (smoothing_stats, quantize_kv)"
MMA_KEY = "attention_mma (INT8 QK, fp16/bf16 PV, mma.sync)"
MMA_FP8_KEY = "attention_mma_fp8 (INT8/INT4 QK, FP8 PV, mma.sync)"
WGMMA_KEY = "attention_wgmma (INT8 QK, FP8 PV, wgmma)"
DEFAULT_BUILD = {PREPROCESS_KEY: ALL_ARCHS, MMA_KEY: ALL_ARCHS, MMA_FP8_KEY: ["sm_89", "sm_90a"],
                 WGMMA_KEY: ["sm_90a"]}
# TORCH_CUDA_ARCH_LIST="8.0": no FP8 code at all; and a build from before the FP8 variants.
SM80_BUILD = {PREPROCESS_KEY: ["sm_80"], MMA_KEY: ["sm_80"], MMA_FP8_KEY: []}
OLD_BUILD = {PREPROCESS_KEY: ALL_ARCHS, MMA_KEY: ALL_ARCHS, WGMMA_KEY: ["sm_90a"]}


def pretend_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                kernels: dict[str, list[str]]) -> None:
    """Make every call look like it runs on a CUDA GPU of ``capability`` with a build whose
    build_info() lists ``kernels`` (and registers both attention ops); the capability-keyed
    caches are bypassed so that each test sees its own build."""
    archs = sorted({a for built in kernels.values() for a in built})
    monkeypatch.setattr(ops, "HAS_EXTENSION", True)
    monkeypatch.setattr(ops, "build_info", lambda: ops.BuildInfo("13.0", archs, dict(kernels)))
    monkeypatch.setattr(ops, "has_op", lambda name: name in (
        "smoothing_stats", "quantize_kv", "attention_mma", "attention_wgmma",
        "sageattn_wgmma", "sageattn_mma"))
    for name in ("_wgmma_runs_on", "_mma_fp8_runs_on", "_arch_reason"):
        monkeypatch.setattr(api, name, getattr(api, name).__wrapped__)
    monkeypatch.setattr(api, "_device_reason", lambda device: None)
    monkeypatch.setattr(api, "_cuda_capability", lambda device: capability)


WGMMA = api.KernelChoice("wgmma", "int8", "fp8")
MMA_INT8_FP8 = api.KernelChoice("mma", "int8", "fp8")
MMA_INT8_INPUT = api.KernelChoice("mma", "int8", "input")
MMA_INT4_FP8 = api.KernelChoice("mma", "int4", "fp8")
INT4_NONE = "INT4 QK runs with FP8 PV only; pv_quant='none' needs qk_quant='int8'"
NO_FP8 = "FP8 PV needs an sm_89+ GPU and a build with attention_mma_fp8 code for it"
BLOCK = "smooths Q per head, not per block"


def routing_cases() -> list[Any]:
    sm90, sm89, sm86, sm80 = (9, 0), (8, 9), (8, 6), (8, 0)
    cases = [
        # sm_90 with the Hopper build: INT8 + FP8 PV without Q smoothing runs on wgmma.
        (sm90, DEFAULT_BUILD, {}, WGMMA),
        (sm90, DEFAULT_BUILD, {"smooth_q": False}, WGMMA),
        (sm90, DEFAULT_BUILD, {"pv_quant": "fp8"}, WGMMA),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int8", "smooth_k": False}, WGMMA),
        (sm90, DEFAULT_BUILD, {"d": 64}, WGMMA),
        (sm90, DEFAULT_BUILD, {"d": 96}, WGMMA),  # padded to 128
        (sm90, DEFAULT_BUILD, {"d": 32, "smooth_v": True}, WGMMA),  # padded to 64
        (sm90, DEFAULT_BUILD, {"pv_quant": "none"}, MMA_INT8_INPUT),
        (sm90, DEFAULT_BUILD, {"pv_quant": "none", "smooth_q": False}, MMA_INT8_INPUT),
        (sm90, DEFAULT_BUILD, {"smooth_q": "head"}, MMA_INT8_INPUT),  # FP8 mma.sync emulated
        (sm90, DEFAULT_BUILD, {"smooth_q": True, "pv_quant": "fp8"}, MMA_INT8_FP8),
        (sm90, DEFAULT_BUILD, {"smooth_q": True, "pv_quant": "none"}, MMA_INT8_INPUT),
        (sm90, DEFAULT_BUILD, {"d": 80, "smooth_q": "head"}, MMA_INT8_INPUT),
        (sm90, DEFAULT_BUILD, {"d": 80, "smooth_q": "head", "pv_quant": "fp8"}, MMA_INT8_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4"}, MMA_INT4_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4", "smooth_q": False}, MMA_INT4_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "fp8", "d": 96}, MMA_INT4_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "none"}, INT4_NONE),
        (sm90, DEFAULT_BUILD, {"smooth_q": "block"}, BLOCK),
        (sm90, DEFAULT_BUILD, {"smooth_q": "block", "qk_quant": "int4"}, BLOCK),
        (sm90, DEFAULT_BUILD, {"d": 256}, "built for head_dim 64 and 128"),
        # sm_90 without the Hopper kernel in the build: the warp-level kernel, FP16 PV unless
        # FP8 is asked for (FP8 mma.sync is emulated on sm_90).
        (sm90, {k: v for k, v in DEFAULT_BUILD.items() if k != WGMMA_KEY}, {}, MMA_INT8_INPUT),
        (sm90, {k: v for k, v in DEFAULT_BUILD.items() if k != WGMMA_KEY}, {"pv_quant": "fp8"},
         MMA_INT8_FP8),
        # A build from before the FP8 variants: FP16/BF16 PV everywhere, INT4 falls back.
        (sm90, OLD_BUILD, {"smooth_q": "head"}, MMA_INT8_INPUT),
        (sm90, OLD_BUILD, {"qk_quant": "int4"}, NO_FP8),
        (sm89, OLD_BUILD, {}, MMA_INT8_INPUT),
        # sm_89 (Ada): FP8 tensor cores, no wgmma.
        (sm89, DEFAULT_BUILD, {}, MMA_INT8_FP8),
        (sm89, DEFAULT_BUILD, {"smooth_q": False}, MMA_INT8_FP8),
        (sm89, DEFAULT_BUILD, {"pv_quant": "fp8"}, MMA_INT8_FP8),
        (sm89, DEFAULT_BUILD, {"pv_quant": "none"}, MMA_INT8_INPUT),
        (sm89, DEFAULT_BUILD, {"qk_quant": "int4"}, MMA_INT4_FP8),
        (sm89, DEFAULT_BUILD, {"qk_quant": "int4", "smooth_q": False, "d": 32}, MMA_INT4_FP8),
        (sm89, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "none"}, INT4_NONE),
        (sm89, DEFAULT_BUILD, {"smooth_q": "block"}, BLOCK),
        # sm_80/86: no FP8 tensor cores: PV in the input dtype; FP8 PV and INT4 fall back.
        (sm80, DEFAULT_BUILD, {}, MMA_INT8_INPUT),
        (sm86, DEFAULT_BUILD, {}, MMA_INT8_INPUT),
        (sm80, DEFAULT_BUILD, {"smooth_q": False}, MMA_INT8_INPUT),
        (sm80, DEFAULT_BUILD, {"pv_quant": "none", "d": 96}, MMA_INT8_INPUT),
        (sm80, DEFAULT_BUILD, {"pv_quant": "fp8"}, NO_FP8),
        (sm86, DEFAULT_BUILD, {"qk_quant": "int4"}, NO_FP8),
        (sm80, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "none"}, INT4_NONE),
        (sm80, DEFAULT_BUILD, {"smooth_q": "block"}, BLOCK),
        (sm80, SM80_BUILD, {}, MMA_INT8_INPUT),
        # The build has no attention code for this GPU at all.
        (sm89, SM80_BUILD | {MMA_KEY: ["sm_90a"]}, {}, "not compiled for sm_89"),
        ((12, 0), DEFAULT_BUILD, {}, "not compiled for sm_120 (built for sm_80, sm_89, sm_90a)"),
    ]
    names = {id(DEFAULT_BUILD): "default", id(SM80_BUILD): "sm80-build", id(OLD_BUILD): "old-build"}
    params = []
    for capability, build, options, want in cases:
        tag = "-".join([f"sm{capability[0]}{capability[1]}", names.get(id(build), "other-build"),
                        *(f"{k}={v}" for k, v in options.items())])
        params.append(pytest.param(capability, build, options, want, id=tag))
    return params


@pytest.mark.parametrize(("capability", "build", "options", "want"), routing_cases())
def test_kernel_routing(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                        build: dict[str, list[str]], options: dict[str, Any],
                        want: api.KernelChoice | str) -> None:
    """Which kernel and precisions serve a float16 call on a GPU of ``capability`` with a build
    of ``build``'s kernel families, or why it falls back: wgmma for INT8 + FP8 PV without Q
    smoothing on sm_90; else the warp-level kernel, with FP8 PV where asked for, for INT4, or
    for pv_quant="auto" where the build's FP8 code runs (sm_89+); PV in the input dtype else."""
    pretend_gpu(monkeypatch, capability, build)
    options = dict(options)
    q, k, v = qkv(d=options.pop("d", 128), dtype=torch.float16)
    call = validated(q, k, v, **options)
    reason = api._unsupported_reason(call)
    if isinstance(want, str):
        assert reason is not None and want in reason, reason
        return
    assert reason is None, reason
    assert api._kernel_for(call) == want


def test_fp8_reason_names_the_gpu_and_build(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpu(monkeypatch, (8, 6), DEFAULT_BUILD)
    q, k, v = qkv(d=64, dtype=torch.float16)
    reason = api._unsupported_reason(validated(q, k, v, qk_quant="int4"))
    assert reason == (f"{NO_FP8} (qk_quant='int4' (INT4 QK runs with FP8 PV only)); this GPU is "
                      "sm_86, attention_mma_fp8 is built for sm_89, sm_90a")
    reason = api._unsupported_reason(validated(q, k, v, pv_quant="fp8"))
    assert reason is not None and "(pv_quant='fp8'); this GPU is sm_86" in reason


@pytest.mark.parametrize(
    ("capability", "build", "starts", "contains"),
    [
        ((9, 0), DEFAULT_BUILD, f"quantized SageAttention2: {api.WGMMA_PLAN}, head_dim 64 and 128",
         [f"the {api.MMA_PLAN} for smooth_q='head'/True", "INT8 QK + FP8 PV",
          "INT4 QK + FP8 PV with qk_quant='int4'", f"{MMA_FP8_KEY} [sm_90a]"]),
        ((8, 9), DEFAULT_BUILD, f"quantized SageAttention2: {api.MMA_PLAN}: INT8 QK + FP8 PV",
         ["INT4 QK + FP8 PV with qk_quant='int4'", "zero-padded",
          f"kernels for sm_89: {PREPROCESS_KEY} [sm_80, sm_89], {MMA_KEY} [sm_80, sm_89], "
          f"{MMA_FP8_KEY} [sm_89]"]),
        ((8, 0), DEFAULT_BUILD,
         f"quantized SageAttention2: {api.MMA_PLAN}: INT8 QK + FP16/BF16 PV (FP8 PV and INT4 QK "
         "need sm_89+)", [f"kernels for sm_80: {PREPROCESS_KEY} [sm_80], {MMA_KEY} [sm_80]"]),
        ((12, 0), DEFAULT_BUILD, "exact SDPA fallback (the attention kernel is not compiled for "
                                 "sm_120", ["no kernels compiled for sm_120"]),
    ],
    ids=["sm90", "sm89", "sm80", "sm120"],
)
def test_kernel_plan_on_pretended_gpus(monkeypatch: pytest.MonkeyPatch,
                                       capability: tuple[int, int], build: dict[str, list[str]],
                                       starts: str, contains: list[str]) -> None:
    pretend_gpu(monkeypatch, capability, build)
    plan = sageattention2.kernel_plan("cuda:0")
    assert plan.startswith(starts), plan
    for text in contains:
        assert text in plan, (text, plan)
    if capability < (8, 9):
        assert "INT4 QK + FP8 PV" not in plan and "INT8 QK + FP8 PV" not in plan


def test_mma_geometry_matches_csrc() -> None:
    """ops.MMA_* (the quantization geometry sageattn feeds attention_mma, and how its FP16-PV
    variant runs it, which the GPU tests emulate) are the kernel's."""
    path = REPO / "csrc" / "attention_params.h"
    if not path.exists():
        pytest.skip("csrc/attention_params.h not in this checkout")
    text = path.read_text()
    for name, value in (("kMmaBlockQ", ops.MMA_BLOCK_Q), ("kMmaWarps", ops.MMA_WARPS),
                        ("kMmaBlockK", ops.MMA_BLOCK_K), ("kMmaInputPvWarps", ops.MMA_INPUT_PV_WARPS),
                        ("kMmaInputPvTileK", ops.MMA_INPUT_PV_TILE_K),
                        ("kMmaLazyRescaleLog2", ops.MMA_LAZY_RESCALE_LOG2)):
        match = re.search(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
        assert match is not None, f"{name} not found in {path}"
        assert int(match.group(1)) == value, f"{name} = {match.group(1)} but ops has {value}"


def test_wgmma_geometry_matches_csrc() -> None:
    """ops.WGMMA_BLOCK_K (quantize_kv's block for attention_wgmma) is the kernel's, and so is the
    128-query CTA of the kernel (its Q scales are per row, which tests/test_attention_gpu.py
    emulates with q_granularity="token")."""
    path = REPO / "csrc" / "attention_params.h"
    if not path.exists():
        pytest.skip("csrc/attention_params.h not in this checkout")
    text = path.read_text()
    for name, value in (("kWgmmaBlockK", ops.WGMMA_BLOCK_K), ("kWgmmaBlockQ", 128)):
        match = re.search(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
        assert match is not None, f"{name} not found in {path}"
        assert int(match.group(1)) == value, f"{name} = {match.group(1)}, expected {value}"


def test_smoothing_sample_stride() -> None:
    """The Hopper path's smoothing means: every token up to SMOOTHING_SAMPLE_TOKENS, then an odd
    stride (coprime with power-of-two periods of the token order) that keeps between a third of
    SMOOTHING_SAMPLE_TOKENS and all of it (csrc/geometry.h reduces up to that many rows per head
    in one launch); the ANCHORS lengths sample 205 (1K), 241 (4K) and 253 (16K) tokens."""
    target = api.SMOOTHING_SAMPLE_TOKENS
    for n in [*range(1, 2 * target), *range(2 * target, 300_000, 97), 2**20]:
        stride = api.smoothing_sample_stride(n)
        samples = -(-n // stride)
        if n <= target:
            assert stride == 1, n
        else:
            assert stride % 2 == 1 and target // 3 <= samples <= target, (n, stride)
    assert [api.smoothing_sample_stride(n) for n in (1024, 4096, 16384)] == [5, 17, 65]


@pytest.mark.parametrize(
    "options",
    [{}, {"smooth_q": False}, {"smooth_q": True}, {"smooth_q": "head"}, {"smooth_q": "block"},
     {"qk_quant": "int4"}, {"qk_quant": "int8", "d": 64}, {"d": 96}, {"pv_quant": "fp8"},
     {"pv_quant": "none"}, {"qk_quant": "int4", "pv_quant": "none"}],
)
def test_kernel_for_cpu_calls_is_mma(monkeypatch: pytest.MonkeyPatch,
                                     options: dict[str, Any]) -> None:
    """CPU tensors never go to the Hopper kernel, "auto" PV is the input dtype there (no FP8
    tensor cores to ask about), and choosing the kernel never touches torch.cuda (nor the
    cached capability) for them."""
    def no_cuda(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("_kernel_for touched torch.cuda for a CPU call")

    for name in ("is_available", "current_device", "get_device_capability", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    for name in ("_capability", "_wgmma_runs_on", "_mma_fp8_runs_on"):
        monkeypatch.setattr(api, name, no_cuda)
    options = dict(options)
    q, k, v = qkv(d=options.pop("d", 128), dtype=torch.float16)
    call = validated(q, k, v, **options)
    qk = options.get("qk_quant", "int8")
    fp8 = options.get("pv_quant") == "fp8" or qk == "int4"
    assert api._kernel_for(call) == api.KernelChoice("mma", qk, "fp8" if fp8 else "input")


def test_host_path_asks_cuda_and_picks_the_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's host work is measured in microseconds at short sequences (RESULTS.md): whether
    CUDA is available is asked once per process, not per call, and sageattn picks the kernel
    once per call (the fallback decision and the run share the pick)."""
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(api, "_capability", lambda index: (9, 0))
    api._cuda_available.cache_clear()
    try:
        for _ in range(3):
            assert api._cuda_capability(torch.device("cuda", 0)) == (9, 0)
        assert len(asked) == 1
    finally:
        api._cuda_available.cache_clear()  # the next caller asks the real torch.cuda again
    picks: list[api.AttentionCall] = []
    real = api._kernel_for
    monkeypatch.setattr(api, "_kernel_for", lambda call: picks.append(call) or real(call))
    q, k, v = qkv(d=64, dtype=torch.float32)  # CPU float32: decided, then the exact fallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.SageAttentionFallbackWarning)
        sageattn(q, k, v)
    assert len(picks) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 4, 9, 64),
        lambda: torch.randn(2, 9, 4, 64).transpose(1, 2),
        lambda: torch.randn(2, 9, 3, 4, 64)[:, :, 1].transpose(1, 2),  # packed qkv
        lambda: torch.randn(2, 4, 64, 9).transpose(2, 3),  # last dim not contiguous
        lambda: torch.randn(2, 4, 9, 68)[..., :64],  # row stride 68: not a multiple of 8
        lambda: torch.randn(2 * 4 * 9 * 64 + 1)[1:].view(2, 4, 9, 64),  # 4-byte misaligned
    ],
    ids=["contiguous", "nhd", "packed", "transposed", "row-stride-68", "misaligned"],
)
def test_kernel_view(make: Any) -> None:
    t = make()
    view = api._kernel_view(t)
    assert torch.equal(view, t)
    readable = (t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])
                and t.data_ptr() % 16 == 0)
    if readable:
        assert view.data_ptr() == t.data_ptr()
    else:
        assert view.is_contiguous() and view.data_ptr() % 16 == 0
        assert all(s % 8 == 0 for s in view.stride()[:-1])


# ------------------------------------------------------------------------------------------------
# The quantized path's wiring on CPU: the preprocessing ops run their reference CPU
# implementations, attention_mma is replaced by a float64 stand-in written from DESIGN.md
# ------------------------------------------------------------------------------------------------

LOG2E = math.log2(math.e)
# attention_mma's argument names (the op schema, DESIGN.md), for recording its calls.
MMA_ARG_NAMES = ("q", "q_mean", "k_codes", "k_scale", "delta_s", "v", "v_scale", "v_mean",
                 "k_mean", "qk_dtype", "kv_len", "sm_scale", "is_causal", "out_nhd", "return_lse")


def attention_mma_stand_in(q: torch.Tensor, q_mean: torch.Tensor | None, k_codes: torch.Tensor,
                           k_scale: torch.Tensor, delta_s: torch.Tensor | None, v: torch.Tensor,
                           v_scale: torch.Tensor | None, v_mean: torch.Tensor | None,
                           k_mean: torch.Tensor | None, qk_dtype: str, kv_len: int,
                           sm_scale: float, is_causal: bool, out_nhd: bool,
                           return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's contract (DESIGN.md) in float64: Q (minus q_mean) quantized as
    reference.quantize_q_reference(block_q=MMA_BLOCK_Q, warps=MMA_WARPS,
    scale_multiplier=sm_scale*log2(e)) does, the per-thread groups dequantized (INT8, or INT4 unpacked from
    its nibbles), Delta-S added, exact base-2 softmax, top-left causal mask; V as given
    (fp16/bf16) or dequantized from FP8 (keys un-permuted, code * v_scale, plus v_mean); output
    in q's dtype and the requested memory layout, natural-log LSE of the scores the kernel sees
    plus the row constant sm_scale * q_i . k_mean of K smoothing. P is not rounded (to the input
    dtype or E4M3) as the kernel does."""
    b, hq, q_len, d = q.shape
    hkv, nk_pad = k_codes.shape[1], k_codes.shape[2]
    assert q.dtype in (torch.float16, torch.bfloat16) and q.stride(-1) == 1
    assert all(s % 8 == 0 for s in q.stride()[:-1])
    assert d in ops.MMA_HEAD_DIMS and q_len > 0
    assert k_codes.dtype == torch.int8
    assert k_codes.shape[-1] == (d // 2 if qk_dtype == "int4" else d)
    # Q smoothed per head needs the Delta-S of that mean, and only then.
    assert (q_mean is None) == (delta_s is None)
    if q_mean is not None:
        assert q_mean.dtype == torch.float32 and q_mean.shape == (b, hq, d)
        assert delta_s.dtype == torch.float32 and delta_s.shape == (b, hq, nk_pad)
    if k_mean is not None:
        assert k_mean.dtype == torch.float32 and k_mean.shape == (b, hkv, d)
    q_codes, q_scale, _ = ref.quantize_q_reference(q, q_mean, ops.MMA_BLOCK_Q, ops.MMA_WARPS,
                                                   qk_dtype, False, sm_scale * LOG2E)
    nq_pad = q_codes.shape[2]
    if qk_dtype == "int4":
        q_codes, k_codes = ref.unpack_int4(q_codes), ref.unpack_int4(k_codes)
    else:
        assert qk_dtype == "int8"
    assert q_codes.shape[-1] == k_codes.shape[-1] == d
    assert nq_pad % ops.MMA_BLOCK_Q == 0 and nk_pad % ops.MMA_BLOCK_K == 0
    assert nq_pad - ops.MMA_BLOCK_Q < q_len <= nq_pad
    assert nk_pad - ops.MMA_BLOCK_K < kv_len <= nk_pad
    assert q_scale.shape == (b, hq, nq_pad // ops.MMA_BLOCK_Q, ops.MMA_WARPS * 8)
    if v.dtype == torch.float8_e4m3fn:
        assert v.shape == (b, hkv, d, nk_pad) and v.is_contiguous()
        assert v_scale is not None and v_scale.shape == (b, hkv, d)
        # Stored key s of transposed V is key perm[s] (DESIGN.md "FP8 P and V"): un-permute,
        # transpose back, and scale: code * v_scale (= P~ * 448 * code / 448 * v_scale).
        v_t = torch.empty(v.shape, dtype=torch.float64)
        v_t[..., ref.v_key_permutation(nk_pad)] = v.double()
        values = v_t.transpose(-1, -2)[:, :, :kv_len] * v_scale.double()[:, :, None, :]
        if v_mean is not None:
            assert v_mean.shape == (b, hkv, d)
            values = values + v_mean.double()[:, :, None, :]
    else:
        assert qk_dtype == "int8" and v_scale is None and v_mean is None
        assert v.dtype == q.dtype and v.shape == (b, hkv, kv_len, d) and v.stride(-1) == 1
        values = v.double()
    r = torch.arange(nq_pad)
    qs = q_scale[:, :, r // ops.MMA_BLOCK_Q,
                 ref.q_group_index(ops.MMA_BLOCK_Q, ops.MMA_WARPS)[r % ops.MMA_BLOCK_Q]]
    j = torch.arange(nk_pad)
    k_group = ref.k_group_index(ops.MMA_BLOCK_K)[j % ops.MMA_BLOCK_K]
    ks = k_scale[:, :, j // ops.MMA_BLOCK_K, k_group]
    qd = q_codes.double() * qs.double()[..., None]
    kd = (k_codes.double() * ks.double()[..., None]).repeat_interleave(hq // hkv, dim=1)
    s2 = qd @ kd.transpose(-1, -2)  # log2 units (sm_scale * log2(e) is in the Q scales)
    if delta_s is not None:
        s2 = s2 + delta_s.double()[:, :, None, :]
    s = s2[:, :, :q_len, :kv_len] / LOG2E
    if is_causal:
        s = s.masked_fill(torch.ones(q_len, kv_len, dtype=torch.bool).tril().logical_not(),
                          -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    if k_mean is not None:  # the row constant K smoothing drops (of the raw q)
        k_mean_q = k_mean.double().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, D]
        lse = lse + sm_scale * (q.double() @ k_mean_q[..., None]).squeeze(-1)
    out = torch.softmax(s, dim=-1) @ values.repeat_interleave(hq // hkv, dim=1)
    out = out.to(q.dtype)
    if out_nhd:
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        out = out.contiguous()
    return out, (lse.float() if return_lse else torch.empty(0))


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Route sageattn's CPU fp16/bf16 calls to the quantized path, with the stand-in registered
    as attention_mma's CPU kernel (unless the build has one of its own); yields the list of
    the op's calls, which go through the real ops.attention_mma wrapper and the dispatcher."""
    if not ops.has_op("attention_mma"):
        pytest.skip("this build has no attention_mma op")
    calls: list[dict[str, Any]] = []
    qualname = f"{ops.NAMESPACE}::attention_mma"
    lib = None
    if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"):
        def cpu_kernel(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(dict(zip(MMA_ARG_NAMES, args)))
            return attention_mma_stand_in(*args)

        lib = torch.library.Library(ops.NAMESPACE, "IMPL")
        lib.impl("attention_mma", cpu_kernel, "CPU")
    else:  # record the calls at the wrapper instead
        real = ops.attention_mma

        def recording(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(dict(zip(MMA_ARG_NAMES, args)))
            return real(*args)

        monkeypatch.setattr(ops, "attention_mma", recording)
    monkeypatch.setattr(api, "_device_reason", lambda device: None)
    try:
        yield calls
    finally:
        if lib is not None:
            lib._destroy()


def rel_l1(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want).abs().sum() / want.abs().sum())


def dequantized_v(v4: torch.Tensor, smooth_v: bool) -> torch.Tensor:
    """V as FP8 PV sees it (float64), written from the reference's per-channel quantizer in the
    natural key order (independent of the transposed, permuted op format): E4M3 code times
    v_scale, plus V's mean with smooth_v."""
    v_mean = ref.smoothing_stats_reference(None, None, v4, True)[2] if smooth_v else None
    codes, scale = ref.quantize_v_per_channel(v4, v_mean)
    values = codes.double() * scale.double()[:, :, None, :]
    return values + v_mean.double()[:, :, None, :] if smooth_v else values


def case_arguments(case: dict[str, Any], q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The [B, H, N, D] views (slices of one [B, N, 3, H, D] tensor when ``case["packed"]``) and
    sageattn's q, k, v arguments for a wiring case: in ``case["layout"]``, 3-D when
    ``case["b"]`` is None."""
    if case.get("packed"):
        packed = torch.stack([t.transpose(1, 2) for t in (q4, k4, v4)], dim=2)  # [B,N,3,H,D]
        q4, k4, v4 = (packed[:, :, i].transpose(1, 2) for i in range(3))
    layout = case.get("layout", "HND")
    args = [t if layout == "HND" else t.transpose(1, 2) for t in (q4, k4, v4)]
    if case.get("b", 2) is None:
        args = [t[0] for t in args]
    return q4, k4, v4, args


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(layout="NHD", dtype=torch.bfloat16),
        dict(b=None),
        dict(b=None, layout="NHD"),
        dict(hkv=1, gqa=True, causal=True),
        dict(hkv=2, gqa=True, nq=7, nk=150, causal=True, layout="NHD"),
        dict(nq=150, nk=7, causal=True),
        dict(d=128, smooth_q=False),
        dict(smooth_k=False),
        dict(smooth_q=False, smooth_k=False, scale=0.3),
        dict(packed=True, layout="NHD"),
        dict(pv="fp8"),
        dict(pv="fp8", layout="NHD", dtype=torch.bfloat16, causal=True, smooth_v=True),
        dict(pv="fp8", hkv=2, gqa=True, nq=7, nk=150, smooth_q=False, smooth_v=True),
        dict(pv="fp8", b=None, smooth_k=False, d=128),
        dict(pv="fp8", packed=True, layout="NHD", smooth_v=True),
        dict(qk="int4"),
        dict(qk="int4", layout="NHD", dtype=torch.bfloat16, causal=True, smooth_v=True, d=128),
        dict(qk="int4", hkv=1, gqa=True, nq=150, nk=7, causal=True, smooth_q=False),
        dict(d=96, layout="NHD"),
        dict(d=32, pv="fp8", smooth_v=True),
        dict(d=80, qk="int4", b=None, layout="NHD", causal=True),
        dict(smooth_q="head", hkv=2, gqa=True, layout="NHD"),
        dict(smooth_q=True, pv="fp8", causal=True, smooth_v=True, d=128),
        dict(smooth_q="head", smooth_k=False, b=None, dtype=torch.bfloat16),
        dict(qk="int4", smooth_q="head", packed=True, layout="NHD"),
        dict(nq=20, nk=1100, causal=True, hkv=2, gqa=True),
        dict(nq=20, nk=1100, smooth_q="head", layout="NHD", d=96),
        dict(pv="fp8", nq=20, nk=1100, smooth_v=True),
    ],
    ids=["hnd", "nhd-bf16", "3d", "3d-nhd", "mqa-causal", "gqa-causal-nq<nk", "causal-nq>nk",
         "d128-no-smooth-q", "no-smooth-k", "no-smoothing-scale", "packed-nhd",
         "fp8", "fp8-nhd-bf16-causal-smooth-v", "fp8-gqa-no-smooth-q-smooth-v",
         "fp8-3d-no-smooth-k-d128", "fp8-packed-smooth-v", "int4", "int4-nhd-bf16-causal-smooth-v",
         "int4-mqa-causal-nq>nk-no-smooth-q", "d96-nhd", "d32-fp8-smooth-v", "d80-int4-3d-nhd",
         "smooth-q-head-gqa-nhd", "smooth-q-true-fp8-causal-smooth-v-d128",
         "smooth-q-head-no-smooth-k-3d-bf16", "int4-smooth-q-head-packed-nhd",
         "sampled-k-mean-gqa-causal", "sampled-k-mean-smooth-q-d96-nhd",
         "fp8-all-token-means-smooth-v"],
)
def test_quantized_path_wiring(stand_in: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """What sageattn gives attention_mma (its CPU stand-in) for each variant, and that the
    result is the emulation of the same quantization: the caller's q (read in place, or
    zero-padded to the kernel's head_dim) with its per-head mean only when Q is smoothed
    ("head"/True, or "auto" with INT4 QK) and then Delta-S; INT8 or INT4 K codes, K's mean
    (over api.smoothing_sample_stride's token sample, or all tokens with FP8 PV) only with
    smooth_k; V in the input dtype (read in place) or FP8 with its scale and (smooth_v) mean,
    the true kv length, the softmax scale of the true head_dim, the layout, and the LSE with the
    row constant of K smoothing (added by the op)."""
    layout = case.get("layout", "HND")
    dtype = case.get("dtype", torch.float16)
    causal, gqa = case.get("causal", False), case.get("gqa", False)
    smooth_q, smooth_k = case.get("smooth_q", "auto"), case.get("smooth_k", True)
    smooth_v, qk = case.get("smooth_v", False), case.get("qk", "int8")
    # On CPU "auto" is the input dtype (no FP8 tensor cores to ask about); INT4 implies FP8.
    fp8 = case.get("pv") == "fp8" or qk == "int4"
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv = case.get("b", 2), 4, case.get("hkv", 4)
    nq, nk, d = case.get("nq", 70), case.get("nk", case.get("nq", 70)), case.get("d", 64)
    d_kernel = 64 if d <= 64 else 128

    def make(h: int, n: int, bias: float) -> torch.Tensor:  # [B, H, N, D], offsets per channel
        x = torch.randn(b or 1, h, n, d, generator=gen) + bias * torch.randn(b or 1, h, 1, d,
                                                                             generator=gen)
        return x.to(dtype)

    q4, k4, v4 = make(hq, nq, 2.0), make(hkv, nk, 4.0), make(hkv, nk, 1.0)
    q4, k4, v4, args = case_arguments(case, q4, k4, v4)
    kwargs = dict(is_causal=causal, enable_gqa=gqa, tensor_layout=layout, smooth_q=smooth_q,
                  smooth_k=smooth_k, smooth_v=smooth_v, scale=case.get("scale"), qk_quant=qk,
                  pv_quant=case.get("pv", "auto"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out, lse = sageattn(*args, return_lse=True, strict=True, **kwargs)
        out_only = sageattn(*args, **kwargs)
    assert not fallback_warnings(record)
    assert len(stand_in) == 2
    call = stand_in[0]
    assert call["qk_dtype"] == qk and call["kv_len"] == nk and call["is_causal"] is causal
    assert call["out_nhd"] is (layout == "NHD") and call["return_lse"] is True
    assert stand_in[1]["return_lse"] is False
    sm_scale = d ** -0.5 if case.get("scale") is None else case["scale"]
    assert call["sm_scale"] == pytest.approx(sm_scale, rel=1e-12)
    # The caller's q (q_len = nq, q's dtype), not quantized: the kernel quantizes it.
    assert call["q"].dtype == dtype and call["q"].shape == (b or 1, hq, nq, d_kernel)
    if d == d_kernel:
        assert call["q"].data_ptr() == q4.data_ptr()  # read in place, never copied
        assert torch.equal(call["q"], q4)
    else:  # zero-padded
        assert torch.equal(call["q"][..., :d], q4) and not call["q"][..., d:].any()
    # Q is smoothed (per head, with Delta-S) as asked, and with "auto" for INT4 QK only.
    smoothed_q = smooth_q in (True, "head") or (smooth_q == "auto" and qk == "int4")
    assert (call["delta_s"] is not None) is smoothed_q
    assert (call["q_mean"] is not None) is smoothed_q
    q_kernel, k_kernel, v_kernel = (torch.nn.functional.pad(t, (0, d_kernel - d))
                                    for t in (q4, k4, v4))
    if smoothed_q:  # over all of Q's tokens
        torch.testing.assert_close(call["q_mean"],
                                   ref.smoothing_stats_reference(q_kernel, None, None, False)[0])
    k_pad = -(-nk // ops.MMA_BLOCK_K) * ops.MMA_BLOCK_K
    assert call["k_codes"].dtype == torch.int8
    assert call["k_codes"].shape == (b or 1, hkv, k_pad,
                                     d_kernel // 2 if qk == "int4" else d_kernel)
    assert call["k_scale"].shape == (b or 1, hkv, k_pad // ops.MMA_BLOCK_K, 4)
    # K's mean over every api.smoothing_sample_stride(nk)-th token with PV in the input dtype,
    # over all tokens with FP8 PV (whose V statistics read all of them in the same pass).
    stride = api.smoothing_sample_stride(nk) if not fp8 else 1
    assert api.smoothing_sample_stride(nk) == (5 if nk == 1100 else 1)
    assert (call["k_mean"] is not None) is smooth_k
    if smooth_k:
        torch.testing.assert_close(
            call["k_mean"],
            ref.smoothing_stats_reference(None, k_kernel[:, :, ::stride], None, False)[1])
    if fp8:
        assert call["v"].dtype == torch.float8_e4m3fn
        assert call["v"].shape == (b or 1, hkv, d_kernel, k_pad)
        stats = ref.smoothing_stats_reference(None, None, v_kernel, smooth_v)
        torch.testing.assert_close(call["v_scale"], stats[3], rtol=0, atol=0)
        if smooth_v:
            torch.testing.assert_close(call["v_mean"], stats[2], rtol=0, atol=0)
        else:
            assert call["v_mean"] is None
    else:
        assert call["v_scale"] is None and call["v_mean"] is None
        if d == d_kernel:
            assert call["v"].data_ptr() == v4.data_ptr()  # v is read in place, never copied

    assert out.shape == (*args[0].shape[:-1], d) and out.dtype == dtype
    assert torch.equal(out, out_only)
    if b is not None:  # the output is contiguous in the caller's layout
        assert out.is_contiguous()
    want, want_lse = ref.exact_attention(q4, k4, v4, is_causal=causal, scale=case.get("scale"),
                                         enable_gqa=gqa, return_lse=True)
    out4 = out if b is not None else out[None]
    out4 = out4 if layout == "HND" else out4.transpose(1, 2)
    lse4 = lse if b is not None else lse[None]
    assert lse4.dtype == torch.float32 and lse4.shape == want_lse.shape
    if smooth_k and qk == "int8":  # unsmoothed K with offsets of 4 quantizes coarsely: what
        # smoothing is for; INT4 is coarser still (compared with its emulation below). Q's
        # offsets of 2 unsmoothed (INT8 "auto") leave a coarser LSE (~0.05 here vs ~0.03).
        assert rel_l1(out4, want) < 0.03
        torch.testing.assert_close(lse4.double(), want_lse, rtol=0,
                                   atol=0.04 if smoothed_q else 0.065)
    # Against the emulation of the same quantization with exact PV on V as the kernel sees it
    # (what the stand-in does): the same output up to its final rounding, and the same LSE,
    # whose row constant sm_scale * q . k_mean (dropped by K smoothing) the op adds back (k's
    # offsets of 4 make it large, so forgetting it fails by far), with K's mean over the same
    # token sample. FP8 V is dequantized here from the natural key order, so a wrong V
    # permutation, scale or mean fails too.
    emu, emu_lse = ref.sage_attention_reference(
        q4, k4, dequantized_v(v4, smooth_v) if fp8 else v4, is_causal=causal,
        scale=case.get("scale"), qk_dtype=qk, granularity="thread",
        block_q=ops.MMA_BLOCK_Q, warps=ops.MMA_WARPS, block_k=ops.MMA_BLOCK_K,
        smooth_k=smooth_k, smooth_q=None if not smoothed_q else "head", smooth_v=False,
        mean_stride=api.smoothing_sample_stride(nk) if not fp8 else 1,
        pv_dtype="fp32", two_level=False, fp22=False, return_lse=True)
    assert rel_l1(out4, emu.double()) < 2e-3
    torch.testing.assert_close(lse4, emu_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize(
    ("d", "options"),
    [(96, {}), (32, {"pv_quant": "fp8", "smooth_v": True}), (96, {"qk_quant": "int4"}),
     (8, {"smooth_q": False, "is_causal": True}), (120, {"pv_quant": "fp8"})],
    ids=["d96", "d32-fp8-smooth-v", "d96-int4", "d8-causal", "d120-fp8"],
)
def test_head_dim_padding(stand_in: list[dict[str, Any]], layout: str, d: int,
                          options: dict[str, Any]) -> None:
    """A head_dim the kernels are not built for runs zero-padded to the next built one: exactly
    what sageattn computes on inputs padded by hand with the softmax scale of the true head_dim,
    cut back to d channels, contiguous in the caller's layout (as SDPA's output is); the padded
    output channels are zero."""
    gen = torch.Generator().manual_seed(d)
    d_kernel = 64 if d <= 64 else 128
    q4, k4, v4 = ((torch.randn(2, 4, 70, d, generator=gen)
                   + bias * torch.randn(2, 4, 1, d, generator=gen)).half()
                  for bias in (1.0, 3.0, 1.0))
    args = [t if layout == "HND" else t.transpose(1, 2).contiguous() for t in (q4, k4, v4)]
    out, lse = sageattn(*args, tensor_layout=layout, return_lse=True, strict=True, **options)
    codes_dim = d_kernel // 2 if options.get("qk_quant") == "int4" else d_kernel
    assert stand_in[0]["q"].shape[-1] == d_kernel
    assert stand_in[0]["k_codes"].shape[-1] == codes_dim
    assert out.shape == args[0].shape and out.dtype == torch.float16 and out.is_contiguous()
    padded = [torch.nn.functional.pad(t, (0, d_kernel - d)) for t in args]
    out_p, lse_p = sageattn(*padded, tensor_layout=layout, scale=d ** -0.5, return_lse=True,
                            strict=True, **options)
    assert torch.equal(out, out_p[..., :d]) and torch.equal(lse, lse_p)
    assert not out_p[..., d:].any()
    if options.get("qk_quant") != "int4":  # the 8-bit error level vs exact attention
        want = ref.exact_attention(q4, k4, v4, is_causal=options.get("is_causal", False))
        assert rel_l1(out if layout == "HND" else out.transpose(1, 2), want) < 0.03


def test_quantized_path_fallbacks(stand_in: list[dict[str, Any]]) -> None:
    q, k, v = qkv(d=64, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sageattn(q, k, v, qk_quant="int4", pv_quant="none")
        sageattn(q, k, v, smooth_q="block")
        sageattn(q, k, v, qk_quant="int4")
        sageattn(q, k, v)
    messages = fallback_warnings(record)
    assert len(messages) == 2
    assert messages[0].startswith("sageattn is computing exact F.scaled_dot_product_attention "
                                  "instead of quantized attention: INT4 QK runs with FP8 PV only")
    assert "per block" in messages[1]
    assert [call["qk_dtype"] for call in stand_in] == ["int4", "int8"]


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(layout="NHD", dtype=torch.bfloat16, causal=True, scale=0.3),
        dict(b=None, smooth_k=False, smooth_v=True),
        dict(hkv=1, gqa=True, nq=7, nk=150, d=64, smooth_q=False),
        dict(packed=True, layout="NHD", smooth_v=True),
        dict(d=96, layout="NHD", smooth_v=True),
        dict(d=40, b=None, causal=True),
        dict(nk=1100, nq=20, smooth_v=True),
    ],
    ids=["hnd", "nhd-bf16-causal-scale", "3d-no-smooth-k-smooth-v", "mqa-d64", "packed-nhd",
         "d96-nhd-smooth-v", "d40-3d-causal", "sampled-means"],
)
def test_wgmma_path_wiring(monkeypatch: pytest.MonkeyPatch, case: dict[str, Any]) -> None:
    """The arguments attention_wgmma gets when sageattn runs the Hopper path (where _kernel_for
    picks it: one sageattn_wgmma op, whose CPU implementation is its chain of ops), from the real
    preprocessing ops (their CPU reference implementations): q read in place, K/V quantized for
    block_k=WGMMA_BLOCK_K, K's mean only with smooth_k, V's only with smooth_v (both over the
    strided token sample of api.smoothing_sample_stride), the kv length,
    softmax scale, mask, output layout and LSE flag; and what the op returns is what sageattn
    returns, in the caller's layout (a head_dim the kernel is not built for zero-padded to the
    next built one, with the softmax scale of the true head_dim, the output cut back)."""
    if not ops.HAS_EXTENSION:
        pytest.skip("the preprocessing ops need the compiled extension")
    layout = case.get("layout", "HND")
    dtype = case.get("dtype", torch.float16)
    b, hq, hkv = case.get("b", 2), 4, case.get("hkv", 4)
    nq, nk, d = case.get("nq", 70), case.get("nk", 70), case.get("d", 128)
    d_kernel = 64 if d <= 64 else 128
    smooth_k, smooth_v = case.get("smooth_k", True), case.get("smooth_v", False)
    gen = torch.Generator().manual_seed(3)
    q4, k4, v4 = (torch.randn(b or 1, h, n, d, generator=gen).to(dtype)
                  for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    q4, k4, v4, args = case_arguments(case, q4, k4, v4)

    calls: list[dict[str, Any]] = []
    names = ("q", "k_codes", "k_scale", "v_fp8", "v_tile_scale", "v_mean", "k_mean", "kv_len",
             "sm_scale", "is_causal", "out_nhd", "return_lse")

    def stand_in(*op_args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        call = dict(zip(names, op_args))
        calls.append(call)
        q = call["q"]
        memory = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if call["out_nhd"] else q.shape
        out = torch.arange(q.numel(), dtype=torch.float32).view(memory).to(q.dtype)
        out = out.transpose(1, 2) if call["out_nhd"] else out
        lse = torch.arange(q[..., 0].numel(), dtype=torch.float32).view(q.shape[:3]) \
            if call["return_lse"] else torch.empty(0)
        return out, lse

    monkeypatch.setattr(api, "_device_reason", lambda device: None)
    monkeypatch.setattr(api, "_build_reason", lambda device=None: None)
    monkeypatch.setattr(api, "_kernel_for", lambda call: api.KernelChoice("wgmma", "int8", "fp8"))
    monkeypatch.setattr(ops, "attention_wgmma", stand_in)
    monkeypatch.setattr(ops, "attention_mma", None)  # must not run
    kwargs = dict(is_causal=case.get("causal", False), enable_gqa=case.get("gqa", False),
                  tensor_layout=layout, scale=case.get("scale"), smooth_k=smooth_k,
                  smooth_q=case.get("smooth_q", "auto"), smooth_v=smooth_v, strict=True)
    out, lse = sageattn(*args, return_lse=True, **kwargs)
    out_only = sageattn(*args, **kwargs)
    assert len(calls) == 2
    call = calls[0]
    assert call["q"].shape == (b or 1, hq, nq, d_kernel)
    if d == d_kernel:
        assert call["q"].data_ptr() == q4.data_ptr()
        assert torch.equal(call["q"], q4)  # the caller's q, not quantized nor copied
    else:  # zero-padded
        assert torch.equal(call["q"][..., :d], q4) and not call["q"][..., d:].any()
    k_pad = -(-nk // ops.WGMMA_BLOCK_K) * ops.WGMMA_BLOCK_K
    assert call["k_codes"].shape == (b or 1, hkv, k_pad, d_kernel)
    assert call["k_codes"].dtype == torch.int8
    assert call["k_scale"].shape == (b or 1, hkv, k_pad // ops.WGMMA_BLOCK_K, 4)
    assert call["v_fp8"].shape == (b or 1, hkv, d_kernel, k_pad)
    assert call["v_fp8"].dtype == torch.float8_e4m3fn
    k_kernel, v_kernel = (torch.nn.functional.pad(t, (0, d_kernel - d)) for t in (k4, v4))
    # The means are over every api.smoothing_sample_stride(nk)-th token (all up to 256 keys).
    stride = api.smoothing_sample_stride(nk)
    assert stride == (5 if nk == 1100 else 1)
    want_stats = ref.smoothing_stats_reference(None, k_kernel[:, :, ::stride],
                                               v_kernel[:, :, ::stride], smooth_v)
    # V with one FP8 scale per tile (quantize_kv without v_scale), of V minus its mean.
    _, want_tile_scale = ref.quantize_v_per_tile(v_kernel, want_stats[2] if smooth_v else None,
                                                 ops.WGMMA_BLOCK_K)
    assert call["v_tile_scale"].shape == (b or 1, hkv, k_pad // ops.WGMMA_BLOCK_K)
    torch.testing.assert_close(call["v_tile_scale"].cpu(), want_tile_scale)
    if smooth_k:
        torch.testing.assert_close(call["k_mean"], want_stats[1])
    else:
        assert call["k_mean"] is None
    if smooth_v:
        torch.testing.assert_close(call["v_mean"], want_stats[2])
    else:
        assert call["v_mean"] is None
    assert call["kv_len"] == nk and call["is_causal"] is kwargs["is_causal"]
    sm_scale = d ** -0.5 if case.get("scale") is None else case["scale"]
    assert call["sm_scale"] == pytest.approx(sm_scale, rel=1e-12)
    assert call["out_nhd"] is (layout == "NHD") and call["return_lse"] is True
    assert calls[1]["return_lse"] is False

    want_out, want_lse = stand_in(*[calls[0][n] for n in names])
    calls.pop()
    out4 = out if b is not None else out[None]
    out4 = out4 if layout == "HND" else out4.transpose(1, 2)
    assert torch.equal(out4, want_out[..., :d]) and torch.equal(out, out_only)
    assert torch.equal(lse if b is not None else lse[None], want_lse)
    if b is not None:  # the output is contiguous in the caller's layout
        assert out.is_contiguous()


def test_attention_mma_meta_shapes() -> None:
    """attention_mma's Meta implementation (what torch.compile traces): shapes, dtypes (q's) and
    the NHD memory of out_nhd for each variant (INT8 QK with fp16/bf16 V; INT8 and packed INT4
    QK with FP8 V; Q smoothed or not, K's mean or not), q read through any strides; calls
    outside the built variants raise."""
    if not ops.has_op("attention_mma"):
        pytest.skip("this build has no attention_mma")
    b, hq, hkv, nq, nk, d = 2, 8, 2, 200, 70, 128
    k_pad = ops.MMA_BLOCK_K
    meta = dict(device="meta")
    q = torch.empty(b, hq, nq, d, dtype=torch.bfloat16, **meta)
    q_nhd = torch.empty(b, nq, hq, d, dtype=torch.float16, **meta).transpose(1, 2)
    q_mean = torch.empty(b, hq, d, **meta)
    k_codes = torch.empty(b, hkv, k_pad, d, dtype=torch.int8, **meta)
    k_scale = torch.empty(b, hkv, k_pad // ops.MMA_BLOCK_K, 4, **meta)
    k_mean = torch.empty(b, hkv, d, **meta)
    delta_s = torch.empty(b, hq, k_pad, **meta)
    v = torch.empty(b, nk, hkv, d, dtype=torch.bfloat16, **meta).transpose(1, 2)
    k4 = k_codes[..., : d // 2].contiguous()  # packed INT4 codes
    v_fp8 = torch.empty(b, hkv, d, k_pad, dtype=torch.float8_e4m3fn, **meta)
    v_scale = torch.empty(b, hkv, d, **meta)
    v_mean = torch.empty(b, hkv, d, **meta)
    variants = [
        (q, q_mean, k_codes, k_scale, delta_s, v, None, None, k_mean, "int8"),
        (q, None, k_codes, k_scale, None, v, None, None, None, "int8"),
        (q_nhd, q_mean, k_codes, k_scale, delta_s, v_fp8, v_scale, v_mean, k_mean, "int8"),
        (q_nhd, None, k4, k_scale, None, v_fp8, v_scale, None, None, "int4"),
        (q, q_mean, k4, k_scale, delta_s, v_fp8, v_scale, v_mean, k_mean, "int4"),
    ]
    for args in variants:
        for out_nhd in (False, True):
            out, lse = ops.attention_mma(*args, nk, 0.1, True, out_nhd, True)
            assert out.shape == (b, hq, nq, d) and out.dtype == args[0].dtype
            assert out.device.type == "meta"
            memory = out.transpose(1, 2) if out_nhd else out
            assert memory.is_contiguous()
            assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
        out, lse = ops.attention_mma(*args, nk, 0.1, False, False, False)
        assert out.shape == (b, hq, nq, d) and lse.shape == (0,)
    # kv_len anywhere in the last padded tile of the FP8 V; any q_len (q is not padded)
    for q_len in (1, 129):
        out, _ = ops.attention_mma(q_nhd[:, :, :q_len], None, k4, k_scale, None, v_fp8, v_scale,
                                   None, None, "int4", 1, 0.1, False, False, False)
        assert out.shape == (b, hq, q_len, d) and out.dtype == torch.float16

    def call(**changes: Any) -> None:
        args = dict(q=q_nhd, q_mean=q_mean, k_codes=k_codes, k_scale=k_scale, delta_s=delta_s,
                    v=v_fp8, v_scale=v_scale, v_mean=None, k_mean=k_mean, qk_dtype="int8",
                    kv_len=nk, sm_scale=0.1, is_causal=False, out_nhd=False, return_lse=True)
        args.update(changes)
        ops.attention_mma(**args)

    call()  # the baseline is valid: each change below alone makes it invalid
    call(q=q.half())  # so is the HND q
    bad = {
        # INT4 QK is built with FP8 PV only.
        "int4-fp16-v": dict(k_codes=k4, qk_dtype="int4", v=v, v_scale=None, q=q),
        # INT8 codes called INT4 (the last dimension is D, not D/2), and the reverse.
        "int4-unpacked": dict(qk_dtype="int4"),
        "int8-packed": dict(k_codes=k4),
        "bogus-qk-dtype": dict(qk_dtype="fp8"),
        # q: fp16/bf16 [B, Hq, q_len, 64 or 128], last dimension contiguous, 16-byte rows.
        "q-float32": dict(q=torch.empty(b, hq, nq, d, **meta)),
        "q-int8-codes": dict(q=torch.empty(b, hq, 256, d, dtype=torch.int8, **meta)),
        "q-3d": dict(q=q[0].half()),
        "q-last-dim-strided": dict(q=torch.empty(b, hq, d, nq, dtype=torch.float16,
                                                 **meta).transpose(2, 3)),
        "q-row-stride": dict(q=torch.empty(b, hq, nq, d + 4, dtype=torch.float16,
                                           **meta)[..., :d]),
        "q-head-dim-96": dict(q=torch.empty(b, hq, nq, 96, dtype=torch.float16, **meta)),
        "q-no-tokens": dict(q=q_nhd[:, :, :0]),
        "q-batch": dict(q=torch.empty(b + 1, hq, nq, d, dtype=torch.float16, **meta),
                        q_mean=None, delta_s=None),
        "q-heads-not-gqa": dict(q=torch.empty(b, 3, nq, d, dtype=torch.float16, **meta),
                                q_mean=None, delta_s=None),
        # q_mean and its Delta-S go together, with their shapes.
        "q-mean-without-delta-s": dict(delta_s=None),
        "delta-s-without-q-mean": dict(q_mean=None),
        "q-mean-shape": dict(q_mean=torch.empty(b, hkv, d, **meta)),
        "q-mean-dtype": dict(q_mean=torch.empty(b, hq, d, dtype=torch.float16, **meta)),
        "delta-s-shape": dict(delta_s=torch.empty(b, hq, 2 * k_pad, **meta)),
        "k-mean-shape": dict(k_mean=torch.empty(b, hq, d, **meta)),
        "k-mean-dtype": dict(k_mean=torch.empty(b, hkv, d, dtype=torch.float16, **meta)),
        "k-scale-shape": dict(k_scale=torch.empty(b, hkv, 1, 8, **meta)),
        # FP8 V needs its scale; fp16 V takes neither scale nor mean, and q's dtype.
        "fp8-v-no-scale": dict(v_scale=None),
        "fp16-v-with-scale": dict(v=v, q=q),
        "fp16-v-with-mean": dict(v=v, v_scale=None, v_mean=v_mean, q=q),
        "fp16-v-not-q-dtype": dict(v=v, v_scale=None),  # bf16 v, fp16 q
        # kv_len must be the true key count: v's length for fp16 V, within the padding for FP8.
        "fp16-v-kv-len": dict(v=v, v_scale=None, q=q, kv_len=nk + 1),
        "fp8-v-kv-len-past-pad": dict(kv_len=k_pad + 1),
        "fp8-v-kv-len-zero": dict(kv_len=0),
        "fp8-v-length": dict(v=torch.empty(b, hkv, d, 2 * k_pad, dtype=torch.float8_e4m3fn,
                                           **meta)),  # not k_codes' padded length
        "fp8-v-not-transposed": dict(v=torch.empty(b, hkv, k_pad, 64, dtype=torch.float8_e4m3fn,
                                                   **meta)),
        "v-scale-shape": dict(v_scale=torch.empty(b, hkv, d // 2, **meta)),
        "v-mean-shape": dict(v_mean=torch.empty(b, hq, d, **meta)),
    }
    for name, changes in bad.items():
        with pytest.raises(RuntimeError):
            call(**changes)
            pytest.fail(f"{name}: no error")
    with pytest.raises(RuntimeError, match="q_mean and delta_s go together"):
        call(delta_s=None)
    with pytest.raises(RuntimeError, match="q must be contiguous in its last dimension"):
        call(q=torch.empty(b, hq, d, nq, dtype=torch.float16, **meta).transpose(2, 3))
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        call(q=torch.empty(b, hq, nq, 96, dtype=torch.float16, **meta))


def test_attention_wgmma_meta_shapes() -> None:
    """attention_wgmma's Meta implementation (what torch.compile traces): shapes, dtypes, the NHD
    memory of out_nhd, q read through any strides; bad inputs raise naming the argument."""
    if not ops.has_op("attention_wgmma"):
        pytest.skip("this build has no attention_wgmma")
    b, hq, hkv, nq, kv_len, d = 2, 8, 2, 200, 200, 128
    k_pad = 2 * ops.WGMMA_BLOCK_K
    meta = dict(device="meta")
    q = torch.empty(b, hq, nq, d, dtype=torch.float16, **meta)
    q_nhd = torch.empty(b, nq, hq, d, dtype=torch.float16, **meta).transpose(1, 2)
    k_codes = torch.empty(b, hkv, k_pad, d, dtype=torch.int8, **meta)
    k_scale = torch.empty(b, hkv, k_pad // ops.WGMMA_BLOCK_K, 4, **meta)
    v_fp8 = torch.empty(b, hkv, d, k_pad, dtype=torch.float8_e4m3fn, **meta)
    v_tile_scale = torch.empty(b, hkv, k_pad // ops.WGMMA_BLOCK_K, **meta)
    mean = torch.empty(b, hkv, d, **meta)
    for q_in in (q, q_nhd):
        for out_nhd in (False, True):
            out, lse = ops.attention_wgmma(q_in, k_codes, k_scale, v_fp8, v_tile_scale, mean, mean,
                                           kv_len, 0.1, True, out_nhd, True)
            assert out.shape == (b, hq, nq, d) and out.dtype == torch.float16
            assert out.device.type == "meta"
            memory = out.transpose(1, 2) if out_nhd else out
            assert memory.is_contiguous()
            assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    out, lse = ops.attention_wgmma(q.bfloat16(), k_codes, k_scale, v_fp8, v_tile_scale, None, None,
                                   k_pad - ops.WGMMA_BLOCK_K + 1, 0.1, False, False, False)
    assert out.dtype == torch.bfloat16 and lse.shape == (0,)

    def call(**changes: Any) -> None:
        args = dict(q=q, k_codes=k_codes, k_scale=k_scale, v_fp8=v_fp8, v_tile_scale=v_tile_scale,
                    v_mean=None, k_mean=None, kv_len=kv_len, sm_scale=0.1, is_causal=False,
                    out_nhd=False, return_lse=True)
        args.update(changes)
        ops.attention_wgmma(**args)

    for kv_bad in (k_pad - ops.WGMMA_BLOCK_K, k_pad + 1, 0):  # k_codes is not kv_len padded
        with pytest.raises(RuntimeError, match="kv_len"):
            call(kv_len=kv_bad)
    with pytest.raises(RuntimeError, match="v_fp8 must have shape"):
        call(v_fp8=torch.empty(b, hkv, d, k_pad - ops.WGMMA_BLOCK_K, dtype=torch.float8_e4m3fn,
                               **meta))
    with pytest.raises(RuntimeError, match="v_fp8 must have shape"):
        call(v_fp8=torch.empty(b, hkv, k_pad, d, dtype=torch.float8_e4m3fn, **meta))
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        call(q=torch.empty(b, hq, nq, 96, dtype=torch.float16, **meta),
             k_codes=torch.empty(b, hkv, k_pad, 96, dtype=torch.int8, **meta))
    with pytest.raises(RuntimeError, match="q must be contiguous in its last dimension"):
        call(q=torch.empty(b, hq, d, nq, dtype=torch.float16, **meta).transpose(2, 3))
    with pytest.raises(RuntimeError, match="v_tile_scale"):  # a per-channel scale: the wrong kind
        call(v_tile_scale=torch.empty(b, hkv, d, **meta))


def test_sageattn_wgmma_meta_shapes() -> None:
    """sageattn_wgmma's Meta implementation (what torch.compile traces) runs the Meta chain of its
    three ops: shapes and dtypes of out and lse, the NHD memory of out_nhd; bad inputs raise
    naming the argument."""
    if not ops.has_op("sageattn_wgmma"):
        pytest.skip("this build has no sageattn_wgmma")
    b, hq, hkv, nq, nk, d = 2, 8, 2, 200, 333, 64
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = (torch.empty(b, h, n, d, **meta) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    for smooth_k, smooth_v, out_nhd, lse in ((True, False, False, True), (False, True, True, False),
                                             (False, False, False, True), (True, True, True, True)):
        out, lse_out = ops.sageattn_wgmma(q, k.transpose(1, 2).contiguous().transpose(1, 2), v,
                                          smooth_k, smooth_v, 3, 0.1, True, out_nhd, lse)
        assert out.shape == (b, hq, nq, d) and out.dtype == torch.bfloat16
        assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
        assert lse_out.shape == ((b, hq, nq) if lse else (0,)) and lse_out.dtype == torch.float32

    def call(**changes: Any) -> None:
        args = dict(q=q, k=k, v=v, smooth_k=True, smooth_v=True, sample_stride=1, sm_scale=0.1,
                    is_causal=False, out_nhd=False, return_lse=True)
        args.update(changes)
        ops.sageattn_wgmma(**args)

    with pytest.raises(RuntimeError, match="sample_stride must be >= 1"):
        call(sample_stride=0)
    with pytest.raises(RuntimeError, match="k and v must be 4-D"):
        call(k=k[0])
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        call(q=q.half())
    with pytest.raises(RuntimeError, match="k and v must have the same batch, heads and tokens"):
        call(v=v[:, :, :-1])  # found by the statistics of smooth_v
    with pytest.raises(RuntimeError, match="v must have the shape of k"):
        call(v=v[:, :, :-1], smooth_v=False)  # by quantize_kv
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        call(q=q[:, :3])
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        call(q=q[..., :32], k=k[..., :32], v=v[..., :32])


def test_sageattn_mma_meta_shapes() -> None:
    """sageattn_mma's Meta implementation runs the Meta chain of its three ops for every variant
    (INT8 or INT4 QK, FP8 or input-dtype PV, Q/K/V smoothing on and off): shapes and dtypes of
    out and lse, the NHD memory of out_nhd; bad inputs raise naming the argument."""
    if not ops.has_op("sageattn_mma"):
        pytest.skip("this build has no sageattn_mma")
    b, hq, hkv, nq, nk, d = 2, 8, 2, 200, 333, 128
    meta = dict(device="meta", dtype=torch.float16)
    q, k, v = (torch.empty(b, h, n, d, **meta) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    for qk, pv, smooth_q, smooth_k, smooth_v, out_nhd, lse in (
            ("int8", "input", False, True, False, False, True),
            ("int8", "input", False, False, False, True, False),
            ("int8", "fp8", True, True, True, True, True),
            ("int4", "fp8", True, False, False, False, True)):
        out, lse_out = ops.sageattn_mma(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, qk, pv,
                                        smooth_q, smooth_k, smooth_v, 3, 0.1, True, out_nhd, lse)
        assert out.shape == (b, hq, nq, d) and out.dtype == torch.float16
        assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
        assert lse_out.shape == ((b, hq, nq) if lse else (0,)) and lse_out.dtype == torch.float32

    def call(**changes: Any) -> None:
        args = dict(q=q, k=k, v=v, qk_dtype="int8", pv_dtype="fp8", smooth_q=True, smooth_k=True,
                    smooth_v=True, sample_stride=1, sm_scale=0.1, is_causal=False, out_nhd=False,
                    return_lse=True)
        args.update(changes)
        ops.sageattn_mma(**args)

    with pytest.raises(RuntimeError, match="pv_dtype must be 'fp8' or 'input'"):
        call(pv_dtype="fp16")
    with pytest.raises(RuntimeError, match="qk_dtype must be"):
        call(qk_dtype="int2")
    with pytest.raises(RuntimeError, match="runs with FP8 PV only"):
        call(qk_dtype="int4", pv_dtype="input")
    with pytest.raises(RuntimeError, match="sample_stride must be >= 1"):
        call(sample_stride=0)
    with pytest.raises(RuntimeError, match="k and v must be 4-D"):
        call(k=k[0])
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        call(q=q.bfloat16())
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        call(q=q[:, :3], smooth_q=False)
    with pytest.raises(RuntimeError, match="q_mean's heads .* multiple of k's heads"):
        call(q=q[:, :3])  # found by Q's statistics
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        call(q=q[..., :32], k=k[..., :32], v=v[..., :32])


# ------------------------------------------------------------------------------------------------
# Empty tensors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize(
    "shape",
    [dict(b=0), dict(hq=0), dict(nq=0), dict(nk=0), dict(nq=0, nk=0), dict(dv=0),
     dict(b=None, nk=0), dict(hq=4, hkv=2, nk=0)],
    ids=["b0", "h0", "nq0", "nk0", "nq0-nk0", "dv0", "3d-nk0", "gqa-nk0"],
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_inputs(layout: str, shape: dict[str, Any], is_causal: bool) -> None:
    q, k, v = qkv(layout=layout, **shape)
    gqa = q.shape[-3 if layout == "HND" else -2] != k.shape[-3 if layout == "HND" else -2]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out, lse = sageattn(q, k, v, is_causal=is_causal, enable_gqa=gqa, tensor_layout=layout,
                            return_lse=True, strict=True)
    assert not fallback_warnings(record)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert not out.any()  # zeros when there are no keys
    if shape.get("hq") != 0:  # SDPA itself dies of SIGFPE on CPU with zero heads (torch 2.11)
        assert torch.equal(out, sdpa_in_layout(q, k, v, layout, is_causal=is_causal,
                                               enable_gqa=gqa))
    q4 = hnd(q, layout)
    assert lse.shape == q4.shape[:-1] and lse.dtype == torch.float32
    assert torch.isneginf(lse).all()


# ------------------------------------------------------------------------------------------------
# SDPA monkeypatching
# ------------------------------------------------------------------------------------------------


def test_assigning_sageattn_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(hkv=2, nq=5, nk=7)
    expected = ORIGINAL_SDPA(q, k, v, None, 0.0, True, enable_gqa=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sageattn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        # The fallback must reach the real SDPA, not recurse into the patched name.
        out = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, enable_gqa=True)
    assert torch.equal(out, expected)


def test_patch_sdpa_routes_and_restores() -> None:
    q, k, v = qkv()
    with patch_sdpa(qk_quant="int8", smooth_q="block") as patched:
        assert F.scaled_dot_product_attention is patched
        assert torch.nn.functional.scaled_dot_product_attention is patched
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert len(fallback_warnings(record)) == 1  # it went through sageattn
        assert torch.equal(out, ORIGINAL_SDPA(q, k, v, is_causal=True))
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_patch_sdpa_reaches_torch_modules() -> None:
    """nn.MultiheadAttention looks SDPA up in torch.nn.functional at call time."""
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with patch_sdpa(strict=True), pytest.raises(NotImplementedError, match="strict=True"):
        mha(x, x, x, need_weights=False)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    mha(x, x, x, need_weights=False)


def test_patch_sdpa_restores_on_error_and_nests() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with patch_sdpa():
            with patch_sdpa(strict=True) as inner:
                assert F.scaled_dot_product_attention is inner
                raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


@pytest.mark.parametrize("kwargs", [dict(tensor_layout="NHD"), dict(return_lse=True),
                                    dict(bogus=1)])
def test_patch_sdpa_rejects_incompatible_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match=f"unsupported keyword.*{next(iter(kwargs))}"):
        with patch_sdpa(**kwargs):
            pass
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


# ------------------------------------------------------------------------------------------------
# kernel_plan, build info, CLI
# ------------------------------------------------------------------------------------------------


def test_public_api() -> None:
    assert set(sageattention2.__all__) == {
        "SageAttentionFallbackWarning", "__version__", "kernel_plan", "sageattn"}
    assert issubclass(SageAttentionFallbackWarning, UserWarning)
    assert isinstance(sageattention2.__version__, str)


def test_kernel_plan() -> None:
    plan = sageattention2.kernel_plan
    assert plan("cpu") == "exact SDPA fallback (the quantized kernels need CUDA tensors, got cpu)"
    if not torch.cuda.is_available():
        assert plan() == plan("cpu")
        assert plan("cuda") == "exact SDPA fallback (no CUDA GPU is available)"


@pytest.mark.parametrize(
    ("arch", "capability", "runs"),
    [
        ("sm_80", (8, 0), True), ("sm_80", (8, 9), True), ("sm_80", (9, 0), False),
        ("sm_89", (8, 6), False), ("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False),
        ("sm_100f", (10, 3), True), ("sm_100f", (12, 0), False), ("sm_120", (12, 1), True),
        ("compute_80", (9, 0), True), ("compute_90", (8, 9), False), ("compute_90a", (9, 0), True),
        ("bogus", (8, 0), False),
    ],
)
def test_arch_runs_on(arch: str, capability: tuple[int, int], runs: bool) -> None:
    assert ops.arch_runs_on(arch, capability) is runs


def test_build_info_matches_extension() -> None:
    info = ops.build_info()
    if not ops.HAS_EXTENSION:
        assert info is None and ops.EXTENSION_ERROR
        return
    assert info is not None and ops.EXTENSION_ERROR is None
    assert info.cuda_version and info.archs
    assert all(set(archs) <= set(info.archs) for archs in info.kernels.values())
    for capability in [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)]:
        usable = ops.kernels_for_capability(capability)
        assert all(ops.arch_runs_on(a, capability) for archs in usable.values() for a in archs)


def test_cli_info() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = subprocess.run([sys.executable, "-m", "sageattention2", "info"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert f"sageattention2 {sageattention2.__version__}" in text
    assert f"torch {torch.__version__}" in text
    assert "extension: " in text and "GPU: " in text
    assert "sageattn plan: exact SDPA fallback" in text
    if not torch.cuda.is_available():
        assert "GPU: no CUDA GPU" in text


# ------------------------------------------------------------------------------------------------
# The op layer (needs the compiled extension; CPU implementations call the reference)
# ------------------------------------------------------------------------------------------------

needs_extension = pytest.mark.skipif(
    not ops.HAS_EXTENSION, reason=f"sageattention2._C not available: {ops.EXTENSION_ERROR}")


def op_inputs(dtype: torch.dtype = torch.float16, nq: int = 100, nk: int = 70,
              d: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, nq, d, generator=gen).to(dtype)
    k = (torch.randn(2, 2, nk, d, generator=gen) + 0.5).to(dtype)
    v = torch.randn(2, 2, nk, d, generator=gen).to(dtype)
    return q, k, v


def op_cases() -> list[Any]:
    q, k, v = op_inputs()
    q_bf16, k_bf16, _ = op_inputs(torch.bfloat16)
    qn, kn = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q_bf16, k_bf16))  # NHD views
    f32 = lambda *s: torch.randn(*s, generator=torch.Generator().manual_seed(6))  # noqa: E731
    q_mean, k_mean, v_scale = f32(2, 4, 64), f32(2, 2, 64), f32(2, 2, 64).abs() / 448
    cases = [
        ("smoothing_stats", (q, k, v, True)),
        ("smoothing_stats", (None, k, v, False)),
        ("smoothing_stats", (qn, None, None, False)),
        ("quantize_kv", (k, v, k_mean, f32(2, 2, 64), v_scale, q_mean, 64, "int8", 1.4)),
        ("quantize_kv", (k, None, None, None, None, None, 128, "int4", 1.0)),
        ("quantize_kv", (kn, kn, None, None, None, None, 64, "int4", 1.0)),
        ("quantize_kv", (k, v, None, None, v_scale, None, 32, "int8", 1.0)),
        ("quantize_kv", (k, v, k_mean, f32(2, 2, 64), None, None, 128, "int8", 1.0)),  # V per tile
    ]
    return [pytest.param(name, args, id=f"{name}-{i}") for i, (name, args) in enumerate(cases)]


OP_CASES = op_cases()


@needs_extension
@pytest.mark.parametrize(("name", "args"), OP_CASES)
def test_opcheck(name: str, args: tuple[Any, ...]) -> None:
    torch.library.opcheck(getattr(torch.ops.sageattention2, name).default, args)


@needs_extension
def test_torch_compile_dynamic_lengths_trace_once() -> None:
    """The Meta kernels keep batch, heads and tokens symbolic: new sequence lengths reuse the
    compiled graph instead of recompiling (diffusion models change resolution, LLMs length)."""
    from torch._dynamo.utils import counters

    def preprocess(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        stats = ops.smoothing_stats(q, k, v, True)
        kv = ops.quantize_kv(k, v, stats.k_mean, stats.v_mean, stats.v_scale, stats.q_mean, 64, "int4", 0.1)
        return stats.q_mean.sum() + kv.k_quant.float().sum() + kv.delta_s.sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(preprocess, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (200, 333, 1000):
        q = torch.randn(1, 4, n, 64, dtype=torch.float16)
        k = torch.randn(1, 2, n, 64, dtype=torch.float16)
        torch.testing.assert_close(compiled(q, k, k), preprocess(q, k, k))
    assert counters["stats"]["unique_graphs"] == 1


@needs_extension
def test_torch_compile_fullgraph() -> None:
    def preprocess(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stats = ops.smoothing_stats(q, k, v, True)
        kv = ops.quantize_kv(k, v, stats.k_mean, stats.v_mean, stats.v_scale, stats.q_mean, 64,
                             "int4", 0.125 * math.log2(math.e))
        return (*stats, *kv)

    q, k, v = op_inputs()
    compiled = torch.compile(preprocess, fullgraph=True, backend="aot_eager")
    got, expected = compiled(q, k, v), preprocess(q, k, v)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(is_causal=True, return_lse=True),
     dict(tensor_layout="NHD", smooth_q=True, scale=0.3, return_lse=True),
     dict(smooth_q=False, enable_gqa=True), dict(attn_mask="bool")],
    ids=["default", "causal-lse", "nhd-smooth-q-scale", "3d-gqa", "mask"],
)
def test_sageattn_under_torch_compile(kwargs: dict[str, Any]) -> None:
    """torch.compile(fullgraph=True) traces sageattn as one graph op (no graph break) whose
    fake implementation gives eager's shapes, and runs eager's call: the same result, bit for
    bit (here the CPU fallback; tests/test_attention_gpu.py does the kernels)."""
    kwargs = dict(kwargs)
    three_d = kwargs.get("enable_gqa", False)
    q, k, v = qkv(b=None if three_d else 2, hq=4, hkv=2 if three_d else 4, nq=37, nk=29, d=16,
                  layout=kwargs.get("tensor_layout", "HND"))
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(37, 29, generator=torch.Generator().manual_seed(1)) > 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        want = sageattn(q, k, v, **kwargs)
        got = torch.compile(lambda q, k, v: sageattn(q, k, v, **kwargs), fullgraph=True,
                            backend="aot_eager")(q, k, v)
    for g, w in zip(*((got, want) if kwargs.get("return_lse") else ((got,), (want,)))):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        assert torch.equal(g, w)


def test_sageattn_under_torch_compile_validates_and_differentiates() -> None:
    """Under torch.compile bad arguments raise while tracing with eager mode's message, and inputs
    that require grad take the exact fallback traced in the graph (a gradient flows); the graph
    op passes torch.library.opcheck."""
    q, k, v = qkv(b=2, hq=4, hkv=4, nq=37, nk=29, d=16)
    for bad, message in ((dict(tensor_layout="XYZ"), "tensor_layout must be one of"),
                         (dict(smooth_q="none"), "smooth_q must be True, False"),
                         (dict(dropout_p=2.0), r"dropout_p must be in \[0, 1\)")):
        compiled = torch.compile(lambda q, k, v, bad=bad: sageattn(q, k, v, **bad),
                                 fullgraph=True, backend="eager")
        with pytest.raises(Exception, match=message):
            compiled(q, k, v)
    q_grad = q.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        out = torch.compile(lambda q, k, v: sageattn(q, k, v, is_causal=True), fullgraph=True,
                            backend="aot_eager")(q_grad, k, v)
        out.square().sum().backward()
        want = F.scaled_dot_product_attention(q.clone().requires_grad_(), k, v, is_causal=True)
        assert torch.allclose(out, want, atol=1e-6, rtol=0)
        assert q_grad.grad is not None and q_grad.grad.abs().sum() > 0
        for args in ((q, k, v, None, 0.0, True, None, False, "HND", "auto", "auto", True, "auto",
                      False, True, False),
                     (q[0], k[0], v[0], None, 0.0, False, 0.3, False, "HND", "int8", "none", False,
                      ":false", True, False, False)):
            torch.library.opcheck(torch.ops.sageattention2.sageattn.default, args)


def test_ops_without_extension_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "HAS_EXTENSION", False)
    monkeypatch.setattr(ops, "EXTENSION_ERROR", "ImportError: test")
    with pytest.raises(RuntimeError, match="extension is not available.*ImportError: test"):
        ops.smoothing_stats(None, torch.zeros(1, 1, 8, 8), None, False)


@needs_extension
def test_extension_uses_the_shared_libstdcxx() -> None:
    """A private static libstdc++ in the extension (some g++ wrappers only find libstdc++.a)
    crashed the process on the first integer formatted into an error message; setup.py links
    the shared one torch runs with."""
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("no ldd on this machine")
    out = subprocess.run([ldd, ops._C.__file__], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in out


@needs_extension
def test_op_errors_format_numbers() -> None:
    bad = torch.empty(1, 2, 64, 100, dtype=torch.float16, device="meta")
    with pytest.raises(RuntimeError, match=r"head_dim\) must be a multiple of 8 in \[8, 256\], got 100"):
        ops.quantize_kv(bad, None, None, None, None, None, 128, "int8", 1.0)
