"""GPU tests of the warp-level attention kernel (``attention_mma``, docs/DESIGN.md) and of
``sageattn``'s quantized path.

Three references:
- the emulation of the same algorithm (``reference.sage_attention_reference`` with the kernel's
  geometry: per-thread INT8 groups of quantize_q(block_q=128, warps=ops.MMA_WARPS) and
  quantize_kv(block_k=ops.MMA_BLOCK_K), P and V rounded to the input dtype, FP32 accumulation,
  no two-level buffer, no FP22), run on the GPU in float64: relative L1 <= 1e-3 (the acceptance criterion),
  both outputs rounded to the kernel's output dtype (bf16 rounding alone is ~1.4e-3 rel. L1);
- exact float64 attention (``reference.exact_attention``): the 8-bit error level (randn inputs
  give rel. L1 ~0.01; the bound is 0.03) and the ANCHORS.md accuracy families;
- exact LSE (natural log).

Every op allocates its outputs, so calls are preceded by freeing blocks of 0xFF bytes (NaN in
fp16/bf16/fp32) to the caching allocator: an element the kernel forgot to write is NaN.

The ANCHORS numbers are printed (shown without ``-s``).
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from sageattention2 import SageAttentionFallbackWarning, api, kernel_plan, ops, sageattn
from sageattention2 import reference as ref

pytestmark = pytest.mark.gpu

if not ops.HAS_EXTENSION:
    pytest.skip(f"compiled extension not available: {ops.EXTENSION_ERROR}", allow_module_level=True)
if not ops.has_op("attention_mma"):
    pytest.skip("this build has no attention_mma op", allow_module_level=True)

DEVICE = "cuda"
LOG2E = math.log2(math.e)
EMULATION_L1 = 1e-3  # kernel vs emulation of the same algorithm
EXACT_L1 = 0.03  # kernel vs float64 attention on randn inputs (measured level ~0.01)


@pytest.fixture(autouse=True)
def _kernel_available() -> None:
    dev = torch.device(DEVICE)
    reason = api._device_reason(dev) or api._build_reason(dev)
    if reason is not None:
        pytest.skip(f"the attention kernel cannot run here: {reason}")


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def poison_allocator() -> None:
    """Free 0xFF blocks to both pools of the caching allocator (large: > 1 MB, small: <= 1 MB),
    after returning the other cached blocks, so that the next allocations land on NaN bytes."""
    if torch.device(DEVICE).type != "cuda":
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    large = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE).fill_(0xFF)
    small = [torch.empty(512 << 10, dtype=torch.uint8, device=DEVICE).fill_(0xFF)
             for _ in range(16)]
    del large, small


def make_qkv(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype,
             seed: int, bias: tuple[float, float, float] = (0.0, 0.0, 0.0),
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HND-contiguous q, k, v: randn plus an optional channel offset per tensor (bias * randn
    [B, H, 1, D], like real activations and the ANCHORS bias4 family)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def draw(h: int, n: int, s: float) -> torch.Tensor:
        x = torch.randn(b, h, n, d, device=DEVICE, generator=g)
        if s:
            x += s * torch.randn(b, h, 1, d, device=DEVICE, generator=g)
        return x.to(dtype)

    return draw(hq, nq, bias[0]), draw(hkv, nk, bias[1]), draw(hkv, nk, bias[2])


def in_layout(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, layout: str,
              ) -> tuple[list[torch.Tensor], str, list[torch.Tensor]]:
    """sageattn arguments and tensor_layout for ``layout``, and the [B, H, N, D] views of exactly
    those tensors. "HND"/"NHD": contiguous in that layout; "packed": NHD slices of one
    [B, N, 3, H, D] tensor; "3d-HND"/"3d-NHD": B = 1 dropped; "strided": every other head of a
    larger HND tensor."""
    if layout == "HND":
        return [q4, k4, v4], "HND", [q4, k4, v4]
    if layout == "NHD":
        args = [t.transpose(1, 2).contiguous() for t in (q4, k4, v4)]
        return args, "NHD", [t.transpose(1, 2) for t in args]
    if layout == "packed":
        packed = torch.stack([t.transpose(1, 2) for t in (q4, k4, v4)], dim=2)
        args = [packed[:, :, i] for i in range(3)]
        assert not args[0].is_contiguous()
        return args, "NHD", [t.transpose(1, 2) for t in args]
    if layout.startswith("3d-"):
        args, tl, views = in_layout(q4[:1], k4[:1], v4[:1], layout[3:])
        return [t[0] for t in args], tl, views
    if layout == "strided":
        views = []
        for t in (q4, k4, v4):
            big = torch.zeros(t.shape[0], 2 * t.shape[1], *t.shape[2:], dtype=t.dtype,
                              device=DEVICE)
            big[:, 1::2] = t
            views.append(big[:, 1::2])
        return views, "HND", views
    raise ValueError(layout)


def to_bhnd(out: torch.Tensor, tensor_layout: str, three_d: bool) -> torch.Tensor:
    if three_d:
        out = out[None]
    return out.transpose(1, 2) if tensor_layout == "NHD" else out


def exact(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool,
          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return ref.exact_attention(q4, k4, v4, is_causal=causal, scale=scale,
                               enable_gqa=q4.shape[1] != k4.shape[1], return_lse=True)


def emulate(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool,
            smooth_q: bool = True, smooth_k: bool = True, scale: float | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's algorithm in float64: (out float32, lse with the row constant) ."""
    return ref.sage_attention_reference(
        q4, k4, v4, is_causal=causal, scale=scale, qk_dtype="int8", granularity="thread",
        block_q=ops.MMA_BLOCK_Q, warps=ops.MMA_WARPS, block_k=ops.MMA_BLOCK_K,
        smooth_k=smooth_k, smooth_q="head" if smooth_q else None, smooth_v=False,
        pv_dtype="bf16" if v4.dtype == torch.bfloat16 else "fp16", two_level=False, fp22=False,
        return_lse=True,
    )


def row_constant(q4: torch.Tensor, k_mean: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """sm_scale * q_i . k_mean (float64) [B, Hq, Nq]: what K smoothing drops from the LSE."""
    km = k_mean.double().repeat_interleave(q4.shape[1] // k_mean.shape[1], dim=1)
    return sm_scale * (q4.double() @ km[..., None]).squeeze(-1)


def run_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, *,
           smooth_q: bool = True, smooth_k: bool = True, out_nhd: bool = False,
           return_lse: bool = True, scale: float | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The preprocessing of DESIGN.md written out, then attention_mma on poisoned memory.
    Returns (out, lse, k_mean or None)."""
    sm_scale = q4.shape[-1] ** -0.5 if scale is None else scale
    mult = sm_scale * LOG2E
    q_mean = k_mean = None
    if smooth_q or smooth_k:
        stats = ops.smoothing_stats(q4 if smooth_q else None, k4 if smooth_k else None, None, False)
        q_mean = stats.q_mean if smooth_q else None
        k_mean = stats.k_mean if smooth_k else None
    q_codes, q_scale, _ = ops.quantize_q(q4, q_mean, ops.MMA_BLOCK_Q, ops.MMA_WARPS, "int8",
                                         False, mult)
    k_codes, k_scale, _, delta_s = ops.quantize_kv(k4, None, k_mean, None, None, q_mean,
                                                   ops.MMA_BLOCK_K, "int8", mult)
    poison_allocator()
    out, lse = ops.attention_mma(q_codes, q_scale, k_codes, k_scale,
                                 delta_s if smooth_q else None, v4, q4.shape[2], causal, out_nhd,
                                 return_lse)
    return out, lse, k_mean


def rel_l1(out: torch.Tensor, want: torch.Tensor) -> float:
    return ref.relative_l1(out, want)


def sageattn_no_fallback(*args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = sageattn(*args, **kwargs)
    fallbacks = [str(w.message) for w in record
                 if issubclass(w.category, SageAttentionFallbackWarning)]
    assert not fallbacks, fallbacks
    return result


def assert_finite(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert torch.isfinite(t).all(), f"non-finite values in a {tuple(t.shape)} output"


# ------------------------------------------------------------------------------------------------
# The op against the emulation of the same algorithm (the acceptance criterion)
# ------------------------------------------------------------------------------------------------

OP_SHAPES = [
    # b, hq, hkv, nq, nk, d
    (1, 4, 2, 1000, 1000, 128),  # GQA 2:1
    (2, 2, 2, 300, 700, 64),
    (1, 4, 1, 77, 1, 128),  # MQA, one key
    (1, 2, 2, 4097, 4097, 64),
]
SMOOTHING = [(True, True), (False, True), (True, False)]


@pytest.mark.parametrize("shape", OP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("smoothing", SMOOTHING, ids=["smooth-qk", "smooth-k", "smooth-q"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_op_matches_emulation(shape: tuple[int, ...], smoothing: tuple[bool, bool], causal: bool,
                              dtype: torch.dtype) -> None:
    smooth_q, smooth_k = smoothing
    b, hq, hkv, nq, nk, d = shape
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq + d, bias=(1.0, 4.0, 1.0))
    out_nhd = (nq + causal) % 2 == 1
    out, lse, k_mean = run_op(q4, k4, v4, causal, smooth_q=smooth_q, smooth_k=smooth_k,
                              out_nhd=out_nhd)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype
    assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    assert_finite(out, lse)
    want, want_lse = emulate(q4, k4, v4, causal, smooth_q, smooth_k)
    l1 = rel_l1(out, want.to(dtype))
    assert l1 <= EMULATION_L1, f"rel. L1 vs emulation {l1:.2e}"
    # The op's LSE lacks the row constant sm_scale * q . k_mean (DESIGN.md).
    full_lse = lse.double() + (row_constant(q4, k_mean, d ** -0.5) if smooth_k else 0.0)
    # The emulation takes its own float64 means, so a few codes sit one step from the kernel's
    # (float32 means): a row's LSE moves by up to a few 1e-3 then (relative to the LSE itself,
    # which is large without K smoothing), the output by far less.
    torch.testing.assert_close(full_lse, want_lse.double(), rtol=1e-3, atol=5e-3)
    # Unsmoothed K with offsets of 4 quantizes coarsely (what smoothing is for): a sanity bound.
    assert rel_l1(out, exact(q4, k4, v4, causal)[0]) <= (EXACT_L1 if smooth_k else 0.2)


def test_op_without_lse_and_scale() -> None:
    q4, k4, v4 = make_qkv(2, 4, 4, 333, 333, 128, torch.float16, seed=3, bias=(0.0, 2.0, 0.0))
    out, lse, _ = run_op(q4, k4, v4, True, return_lse=False, scale=0.05)
    assert lse.shape == (0,)
    assert_finite(out)
    want, _ = emulate(q4, k4, v4, True, scale=0.05)
    assert rel_l1(out, want.half()) <= EMULATION_L1
    out_lse, _, _ = run_op(q4, k4, v4, True, return_lse=True, scale=0.05)
    assert torch.equal(out, out_lse)


# ------------------------------------------------------------------------------------------------
# ANCHORS.md accuracy families (numbers for the closing note)
# ------------------------------------------------------------------------------------------------

# family -> (min CosSim, max rel. L1): the official 8-bit sm90 kernel's level (ANCHORS.md); the
# FP16 PV here should be at least as good. Outliers: the official kernel's 0.9984 / 0.0397.
ANCHOR_BOUNDS = {"bias0": (0.9992, 0.040), "bias4": (0.9999, 0.015), "outliers": (0.998, 0.040)}


def test_anchor_families(capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    families = {name: ref.make_input_family(name, (1, 8, 4096, 128), torch.float16, DEVICE)
                for name in ("bias0", "bias4", "outliers")}
    lines = []
    for name, (q, k, v) in families.items():
        for causal in (False, True):
            want, _ = exact(q, k, v, causal)
            poison_allocator()
            out = sageattn_no_fallback(q, k, v, is_causal=causal)
            assert_finite(out)
            emu, _ = emulate(q, k, v, causal)
            cos, l1 = ref.cosine_similarity(out, want), rel_l1(out, want)
            emu_cos, emu_l1 = ref.cosine_similarity(emu.half(), want), rel_l1(emu.half(), want)
            lines.append(f"{name:<9} causal={causal!s:<5}  kernel CosSim {cos:.6f} rel.L1 {l1:.5f}"
                         f"   emulation {emu_cos:.6f} / {emu_l1:.5f}"
                         f"   kernel vs emulation rel.L1 {rel_l1(out, emu.half()):.2e}")
            min_cos, max_l1 = ANCHOR_BOUNDS[name]
            assert cos >= min_cos and l1 <= max_l1, lines[-1]
            assert rel_l1(out, emu.half()) <= EMULATION_L1, lines[-1]
    with capsys.disabled():
        print("\nANCHORS families, B1 H8 N4096 D128 fp16, sageattn vs float64 SDPA:")
        print("\n".join(lines))


# ------------------------------------------------------------------------------------------------
# sageattn over shapes, layouts, dtypes
# ------------------------------------------------------------------------------------------------


def shape_cases() -> list[Any]:
    cases = []
    # b, hq, hkv, nq, nk, d, causal, layout, dtype, emulate
    for i, n in enumerate([1, 17, 64, 127, 128, 1000, 4097]):
        for causal in (False, True):
            d = (64, 128)[(i + causal) % 2]
            dtype = (torch.float16, torch.bfloat16)[i % 2]
            layout = ("HND", "NHD")[(i + causal) % 2]
            b = 2 if n <= 1000 else 1
            cases.append((b, 4, 4, n, n, d, causal, layout, dtype, n in (127, 4097)))
    for j, (nq, nk) in enumerate([(100, 300), (300, 100), (1, 77), (129, 1)]):
        for causal in (False, True):
            cases.append((2, 4, 2, nq, nk, (64, 128)[j % 2], causal, ("NHD", "HND")[j % 2],
                          (torch.bfloat16, torch.float16)[(j + causal) % 2], causal))
    cases += [
        (1, 8, 2, 1000, 1000, 128, True, "NHD", torch.bfloat16, True),  # GQA 4:1
        (2, 8, 2, 513, 2000, 64, False, "HND", torch.float16, False),  # GQA 4:1
        (2, 8, 1, 333, 1000, 64, False, "HND", torch.float16, True),  # MQA
        (1, 8, 1, 1000, 333, 128, True, "NHD", torch.bfloat16, False),  # MQA
        (2, 4, 4, 1000, 1000, 128, True, "packed", torch.float16, True),  # [B, N, 3, H, D]
        (1, 4, 4, 300, 300, 64, False, "packed", torch.bfloat16, False),
        (1, 4, 4, 500, 500, 64, False, "3d-NHD", torch.float16, False),
        (1, 4, 2, 200, 400, 128, True, "3d-HND", torch.bfloat16, False),
        (2, 4, 4, 250, 250, 128, False, "strided", torch.float16, True),
    ]
    params = []
    for c in cases:
        b, hq, hkv, nq, nk, d, causal, layout, dtype, emu = c
        tag = (f"b{b}h{hq}:{hkv}-{nq}x{nk}-d{d}-{'causal' if causal else 'full'}-{layout}-"
               f"{'bf16' if dtype == torch.bfloat16 else 'fp16'}{'-emu' if emu else ''}")
        params.append(pytest.param(*c, id=tag))
    return params


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,causal,layout,dtype,emu", shape_cases())
def test_sageattn_shapes(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, causal: bool,
                         layout: str, dtype: torch.dtype, emu: bool) -> None:
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq * 7 + nk)
    args, tensor_layout, views = in_layout(q4, k4, v4, layout)
    three_d = layout.startswith("3d-")
    poison_allocator()
    out = sageattn_no_fallback(*args, is_causal=causal, enable_gqa=hq != hkv,
                               tensor_layout=tensor_layout, strict=True)
    assert out.shape == args[0].shape and out.dtype == dtype
    if not three_d or tensor_layout == "HND":
        assert out.is_contiguous()  # written in the caller's layout, not transposed afterwards
    assert_finite(out)
    out4 = to_bhnd(out, tensor_layout, three_d)
    want, _ = exact(*views, causal)
    assert rel_l1(out4, want) <= EXACT_L1
    if emu:
        emu_out, _ = emulate(*views, causal)
        assert rel_l1(out4, emu_out.to(dtype)) <= EMULATION_L1
    if causal:  # query 0 attends key 0 alone: its output is v[0] (to an ulp)
        v0 = views[2][:, :, 0].repeat_interleave(hq // hkv, dim=1)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out4[:, :, 0], v0, rtol=eps, atol=1e-6)


@pytest.mark.parametrize("nq,nk", [(700, 200), (200, 700), (1, 300), (300, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_causal_unequal_lengths(nq: int, nk: int, dtype: torch.dtype) -> None:
    """SDPA's causal mask is top-left aligned: query i sees keys j <= i, also when q_len !=
    kv_len (queries past kv_len see every key)."""
    q4, k4, v4 = make_qkv(1, 4, 4, nq, nk, 128, dtype, seed=nq + 3 * nk, bias=(1.0, 3.0, 0.0))
    out = sageattn_no_fallback(q4, k4, v4, is_causal=True)
    want, _ = exact(q4, k4, v4, True)
    assert rel_l1(out, want) <= EXACT_L1
    emu_out, _ = emulate(q4, k4, v4, True)
    assert rel_l1(out, emu_out.to(dtype)) <= EMULATION_L1


# ------------------------------------------------------------------------------------------------
# return_lse
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "b,hq,hkv,nq,nk,d,causal,layout,smooth_k",
    [
        (2, 4, 4, 1000, 1000, 128, False, "HND", True),
        (2, 4, 4, 1000, 1000, 64, True, "NHD", True),
        (1, 8, 2, 300, 700, 128, True, "HND", True),  # GQA: each q head adds its kv head's mean
        (1, 8, 1, 700, 300, 64, False, "NHD", True),  # MQA
        (1, 4, 4, 500, 500, 128, True, "3d-NHD", True),
        (2, 4, 4, 1000, 1000, 128, False, "HND", False),
    ],
)
def test_return_lse(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, causal: bool,
                    layout: str, smooth_k: bool) -> None:
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, torch.float16, seed=nq + 11,
                          bias=(1.0, 2.0 if smooth_k else 0.0, 0.0))
    args, tensor_layout, views = in_layout(q4, k4, v4, layout)
    three_d = layout.startswith("3d-")
    kwargs = dict(is_causal=causal, enable_gqa=hq != hkv, tensor_layout=tensor_layout,
                  smooth_k=smooth_k)
    poison_allocator()
    out, lse = sageattn_no_fallback(*args, return_lse=True, **kwargs)
    assert_finite(out, lse)
    assert torch.equal(out, sageattn_no_fallback(*args, **kwargs))
    assert lse.dtype == torch.float32
    assert lse.shape == ((hq, nq) if three_d else (b, hq, nq))
    lse4 = lse[None] if three_d else lse
    _, want = exact(*views, causal)
    err = (lse4.double() - want).abs()
    # A query that sees few keys carries one score's quantization error (~0.02); with 64 or
    # more keys the errors average out.
    keys_seen = torch.arange(nq, device=DEVICE).clamp(max=nk - 1) + 1 if causal else \
        torch.full((nq,), nk, device=DEVICE)
    # 8-bit scores carry ~1e-2 of noise; on these biased inputs the attention is peaked enough
    # that the LSE keeps up to ~1.5e-2 of it (measured on the H100: max 0.0134).
    assert err[..., keys_seen >= 64].max().item() <= 2e-2
    assert err.max().item() <= 0.05
    _, emu_lse = emulate(*views, causal, smooth_k=smooth_k)
    torch.testing.assert_close(lse4, emu_lse, rtol=0, atol=1e-3)


# ------------------------------------------------------------------------------------------------
# Determinism, fallbacks, plan, op contract
# ------------------------------------------------------------------------------------------------


def test_repeated_runs_bit_identical() -> None:
    q4, k4, v4 = make_qkv(1, 8, 2, 4097, 4097, 128, torch.bfloat16, seed=5, bias=(1.0, 4.0, 1.0))
    args, _, _ = in_layout(q4, k4, v4, "NHD")
    first = sageattn_no_fallback(*args, is_causal=True, enable_gqa=True, tensor_layout="NHD",
                                 return_lse=True)
    for _ in range(3):
        again = sageattn_no_fallback(*args, is_causal=True, enable_gqa=True, tensor_layout="NHD",
                                     return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize(
    "kwargs,shape,reason",
    [
        (dict(qk_quant="int4"), (1, 2, 200, 128), "INT4"),
        (dict(smooth_q="block"), (1, 2, 200, 128), "per block"),
        ({}, (1, 2, 200, 96), "head_dim 64 and 128, got 96"),
    ],
    ids=["int4", "smooth-q-block", "head-dim-96"],
)
def test_unsupported_calls_fall_back(kwargs: dict[str, Any], shape: tuple[int, ...],
                                     reason: str) -> None:
    api._warned_reasons.clear()
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=torch.float16) for _ in range(3))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = sageattn(q, k, v, **kwargs)
    messages = [str(w.message) for w in record
                if issubclass(w.category, SageAttentionFallbackWarning)]
    assert len(messages) == 1 and reason in messages[0]
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    with pytest.raises(NotImplementedError, match=reason):
        sageattn(q, k, v, strict=True, **kwargs)
    api._warned_reasons.clear()


def test_kernel_plan_names_the_kernel() -> None:
    plan = kernel_plan()
    assert plan.startswith(f"quantized SageAttention2: {api.MMA_PLAN}"), plan


def test_opcheck_attention_mma() -> None:
    q4, k4, v4 = make_qkv(1, 4, 2, 200, 130, 64, torch.float16, seed=1, bias=(1.0, 2.0, 0.0))
    mult = 0.125 * LOG2E
    stats = ops.smoothing_stats(q4, k4, None, False)
    q_codes, q_scale, _ = ops.quantize_q(q4, stats.q_mean, ops.MMA_BLOCK_Q, ops.MMA_WARPS, "int8",
                                         False, mult)
    k_codes, k_scale, _, delta_s = ops.quantize_kv(k4, None, stats.k_mean, None, None,
                                                   stats.q_mean, ops.MMA_BLOCK_K, "int8", mult)
    for args in ((q_codes, q_scale, k_codes, k_scale, delta_s, v4, 200, True, False, True),
                 (q_codes, q_scale, k_codes, k_scale, None, v4, 200, False, True, False)):
        torch.library.opcheck(torch.ops.sageattention2.attention_mma.default, args)
