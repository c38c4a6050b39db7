"""GPU tests of ``sageattn``'s quantized path on every kernel this GPU runs (gpu_helpers.PATHS):
the accuracy families of docs/PROTOCOL.md#input-families, shapes, layouts and dtypes against the
emulation of the variant it ran and exact attention, the LSE, determinism, torch.compile and CUDA
graphs, the fallbacks, and kernel_plan (helpers, bounds and references: gpu_helpers.py)."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from gpu_helpers import (DEVICE, EMULATION_L1, INT4_MAX_LEN, LSE_EMULATION_ATOL, MMA_INT4_FP8,
                         MMA_INT8_FP8, MMA_INT8_INPUT, OFFICIAL_ROUNDING, OFFICIAL_SM90, PATHS,
                         WGMMA, WGMMA_INPUT,
                         WGMMA_LSE_EMULATION_ATOL,
                         assert_finite, assert_first_query_sees_first_key, emulate, exact,
                         exact_l1_bound, in_layout, make_qkv, mma_fp8_on_device, rel_l1,
                         sageattn_kernel, sageattn_no_fallback, to_bhnd, wgmma_on_device)
from sageattention2 import (SageAttentionFallbackWarning, _execute, _plan, ablation, kernel_plan,
                            ops, sageattn)
from sageattention2._plan import KernelChoice
from sageattention2.testing import cosine_similarity, make_input_family, poison_cuda_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("attention_kernel")]

if not ops.HAS_EXTENSION:
    pytest.skip(f"compiled extension not available: {ops.EXTENSION_ERROR}", allow_module_level=True)
if not ops.has_op("attention_mma"):
    pytest.skip("this build has no attention_mma op", allow_module_level=True)


# ------------------------------------------------------------------------------------------------
# The accuracy families of docs/PROTOCOL.md#input-families (numbers for the closing note)
# ------------------------------------------------------------------------------------------------

# 8-bit, family -> (min CosSim, max rel. L1): issue 3's bounds (docs/PROTOCOL.md#targets), the
# official 8-bit sm90 kernel's non-causal level (docs/PROTOCOL.md#official-accuracy). FP16/BF16 PV
# (the warp-level kernel's, and the Hopper kernel's accurate tier) must be at least as good on
# every family and mask (outliers: the official kernel's 0.9984 / 0.0397; the accurate tier gives
# 0.998793 / 0.02239 there, bias0 0.999940 / 0.01087, bias4 0.999993 / 0.00320, causal alike, on
# the H200). With FP8 PV the bounds hold non-causal on bias0 and bias4; causal, the official
# kernel itself is below the bias4 bound (0.99987), so there the FP8 path must be no worse than
# the official causal figure (OFFICIAL_SM90). On the outliers family the warp-level kernel's FP8
# PV is at the official kernel's level but not within its figures (H200: 0.998345 / 0.04031,
# causal 0.998449 / 0.03885; its emulation on the CPU's draw of the family 0.998297 / 0.04093):
# bounded by MMA_FP8_OUTLIERS at both masks, the emulation's figures widened by twice
# EMULATION_L1 (the kernel is within EMULATION_L1 of its emulation; draws differ).
ANCHOR_BOUNDS = {"bias0": (0.9992, 0.040), "bias4": (0.9999, 0.015), "outliers": (0.998, 0.040)}
MMA_FP8_OUTLIERS = (0.9978, 0.043)
ANCHOR_BOUNDS_OF = {
    MMA_INT8_INPUT: ANCHOR_BOUNDS,
    WGMMA_INPUT: ANCHOR_BOUNDS,
    MMA_INT8_FP8: {"bias0": ANCHOR_BOUNDS["bias0"], "bias4": ANCHOR_BOUNDS["bias4"],
                   "outliers": MMA_FP8_OUTLIERS},
}
OFFICIAL_BOUNDS_WHEN_CAUSAL = {(MMA_INT8_FP8, "bias0"), (MMA_INT8_FP8, "bias4")}
# Measured on the H100: with one Q scale per row attention_wgmma is at 0.998436 / 0.03923 on the
# outliers family (official 0.998399 / 0.0397) and 0.998557 / 0.03783 causal (0.99846 / 0.0387);
# with the per-thread Q groups of Eq. 8 it was 0.998273 / 0.04071 and 0.998403 / 0.03925, short
# of the official figures (docs/DECISIONS.md#d3). Every path is bounded on every family.
ANCHOR_SHAPE = (1, 8, 4096, 128)
ANCHOR_FAMILIES = ("bias0", "bias4", "outliers")
# The 8-bit paths (INT4 has its own test below).
ANCHOR_PATHS = [path for path, options in PATHS.items() if options.get("qk_quant") != "int4"]


def anchor_families() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The input families, drawn as docs/PROTOCOL.md#input-families says (manual_seed(0), in this
    order)."""
    torch.manual_seed(0)
    return {name: make_input_family(name, ANCHOR_SHAPE, torch.float16, DEVICE)
            for name in ANCHOR_FAMILIES}


@pytest.mark.parametrize("path", ANCHOR_PATHS)
def test_anchor_families(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    families = anchor_families()
    lines, failures, kernels = [], [], set()
    for name, (q, k, v) in families.items():
        for causal in (False, True):
            kwargs = dict(is_causal=causal, **PATHS[path])
            kernel = sageattn_kernel(q, k, v, **kwargs)
            kernels.add(kernel)
            want, _ = exact(q, k, v, causal)
            poison_cuda_allocator()
            out = sageattn_no_fallback(q, k, v, **kwargs)
            assert_finite(out)
            emu, _ = emulate(q, k, v, causal, PATHS[path].get("smooth_q"), kernel=kernel)
            cos, l1 = cosine_similarity(out, want), rel_l1(out, want)
            emu_cos, emu_l1 = cosine_similarity(emu.half(), want), rel_l1(emu.half(), want)
            vs_emu = rel_l1(out, emu.half())
            official = OFFICIAL_SM90[name, causal]
            lines.append(f"{name:<9} causal={causal!s:<5}  kernel CosSim {cos:.6f} rel.L1 {l1:.5f}"
                         f"   emulation {emu_cos:.6f} / {emu_l1:.5f}"
                         f"   kernel vs emulation rel.L1 {vs_emu:.2e}"
                         f"   (official sm90 {official[0]:.6f} / {official[1]:.4f})")
            bounds = ANCHOR_BOUNDS_OF.get(kernel, {}).get(name)
            if kernel == WGMMA or (causal and (kernel, name) in OFFICIAL_BOUNDS_WHEN_CAUSAL):
                bounds = (official[0] - OFFICIAL_ROUNDING[0], official[1] + OFFICIAL_ROUNDING[1])
            if bounds is None:
                failures.append(f"{lines[-1]}: no float64 bound for {kernel} on {name}")
            elif not (cos >= bounds[0] and l1 <= bounds[1]):
                failures.append(f"{lines[-1]}: needs CosSim >= {bounds[0]}, rel.L1 <= {bounds[1]}")
            if vs_emu > EMULATION_L1:
                failures.append(f"{lines[-1]}: kernel vs emulation above {EMULATION_L1}")
    ran = ", ".join(f"attention_{c.kernel} {c.qk.upper()} QK + {c.pv} PV" for c in sorted(kernels))
    with capsys.disabled():
        print(f"\ninput families of docs/PROTOCOL.md, B1 H8 N4096 D128 fp16, sageattn ({path} call: {ran}) vs "
              f"float64 SDPA:")
        print("\n".join(lines))
    assert not failures, "\n".join(failures)


@pytest.mark.usefixtures("wgmma_kernel")
def test_anchor_families_head_dim_256(capsys: pytest.CaptureFixture[str]) -> None:
    """The input families at head_dim 256 (B1 H8 N4096) on the Hopper kernel's FP8 tier (the
    only one at 256): issue 3's 8-bit bounds on every family and mask for the default call (the
    authors' kernels stop at 128, so no official figures exist here), and within EMULATION_L1 of
    the emulation. The default smooth_v ("auto") subtracts V's mean at 256: without it (printed,
    not bounded) bias4, V's channel offsets of 4, is at CosSim 0.99987, V's one FP8 scale per
    tile spanning the largest offset of 256 channels (H100)."""
    torch.manual_seed(0)
    shape = (1, 8, 4096, 256)
    lines, failures = [], []
    for name in ANCHOR_FAMILIES:
        q, k, v = make_input_family(name, shape, torch.float16, DEVICE)
        for causal in (False, True):
            for smooth_v in (("auto", False) if name == "bias4" else ("auto",)):
                options = dict(is_causal=causal, smooth_v=smooth_v)
                assert sageattn_kernel(q, k, v, **options) == WGMMA
                want, _ = exact(q, k, v, causal)
                poison_cuda_allocator()
                out = sageattn_no_fallback(q, k, v, **options)
                assert_finite(out)
                emu, _ = emulate(q, k, v, causal, None, kernel=WGMMA, smooth_v=smooth_v == "auto")
                cos, l1, vs_emu = cosine_similarity(out, want), rel_l1(out, want), rel_l1(out, emu.half())
                lines.append(f"{name:<9} causal={causal!s:<5} smooth_v={smooth_v!s:<5}  kernel CosSim "
                             f"{cos:.6f} rel.L1 {l1:.5f}   kernel vs emulation rel.L1 {vs_emu:.2e}")
                bounds = ANCHOR_BOUNDS[name]
                if smooth_v == "auto" and not (cos >= bounds[0] and l1 <= bounds[1]):
                    failures.append(f"{lines[-1]}: needs CosSim >= {bounds[0]}, rel.L1 <= {bounds[1]}")
                if vs_emu > EMULATION_L1:
                    failures.append(f"{lines[-1]}: kernel vs emulation above {EMULATION_L1}")
    with capsys.disabled():
        print("\ninput families of docs/PROTOCOL.md, B1 H8 N4096 D256 fp16, sageattn (default call: "
              "attention_wgmma INT8 QK + fp8 PV) vs float64 SDPA:")
        print("\n".join(lines))
    assert not failures, "\n".join(failures)


# 4-bit on the bias4 family (channel offsets, which smoothing removes): with Q and K smoothed the
# error must come down to near the 8-bit level (the idealised simulation of
# docs/PROTOCOL.md#idealised-simulation: 0.9998 / 0.0182), and smoothing Q must at least halve it
# (the simulation: 0.0463 -> 0.0182).
INT4_BIAS4_BOUNDS = (0.9995, 0.03)
INT4_Q_SMOOTHING_GAIN = 2.0


@pytest.mark.usefixtures("mma_fp8_kernel")
def test_anchor_families_int4(capsys: pytest.CaptureFixture[str]) -> None:
    """sageattn(qk_quant="int4") on the input families (docs/PROTOCOL.md#input-families), with and
    without Q smoothing (K always smoothed); and, emulation only, whether finer query groups than
    the kernel's would help on the outlier family (which smoothing cannot fix: its large channels
    vary per token)."""
    families = anchor_families()
    lines, failures, results = [], [], {}
    for name, (q, k, v) in families.items():
        want, _ = exact(q, k, v, False)
        for smooth_q in (True, False):
            kwargs = dict(qk_quant="int4", smooth_q=smooth_q)
            kernel = sageattn_kernel(q, k, v, **kwargs)
            assert kernel == MMA_INT4_FP8
            poison_cuda_allocator()
            out = sageattn_no_fallback(q, k, v, **kwargs)
            assert_finite(out)
            emu, _ = emulate(q, k, v, False, smooth_q=smooth_q, kernel=kernel)
            cos, l1 = cosine_similarity(out, want), rel_l1(out, want)
            results[name, smooth_q] = (cos, l1)
            emu_cos, emu_l1 = cosine_similarity(emu.half(), want), rel_l1(emu.half(), want)
            vs_emu = rel_l1(out, emu.half())
            lines.append(f"{name:<9} smooth Q {'yes' if smooth_q else 'no ':<3}  kernel CosSim "
                         f"{cos:.6f} rel.L1 {l1:.5f}   emulation {emu_cos:.6f} / {emu_l1:.5f}"
                         f"   kernel vs emulation rel.L1 {vs_emu:.2e}")
            if vs_emu > EMULATION_L1:
                failures.append(f"{lines[-1]}: kernel vs emulation above {EMULATION_L1}")
    cos, l1 = results["bias4", True]
    if not (cos >= INT4_BIAS4_BOUNDS[0] and l1 <= INT4_BIAS4_BOUNDS[1]):
        failures.append(f"bias4 with Q+K smoothing: CosSim {cos:.6f} rel.L1 {l1:.5f}, needs "
                        f">= {INT4_BIAS4_BOUNDS[0]} and <= {INT4_BIAS4_BOUNDS[1]}")
    if not INT4_Q_SMOOTHING_GAIN * l1 <= results["bias4", False][1]:
        failures.append(f"bias4: smoothing Q takes rel.L1 from {results['bias4', False][1]:.5f} "
                        f"to {l1:.5f}, not by a factor {INT4_Q_SMOOTHING_GAIN}")

    # Would finer query groups help where smoothing cannot (outliers)? The kernel's geometry
    # (block_q=128, 8 warps: 16-row slabs, groups of 2 rows {g, g+8}) against the paper's
    # coarser c_w=4 (32-row slabs, groups of 4 rows) and the finest, one scale per token
    # (per-token Q and K), all with Q and K smoothed and the kernel's FP8 PV.
    q, k, v = families["outliers"]
    want, _ = exact(q, k, v, False)
    geometries = {
        "warps=8 (this kernel: Q groups of 2 rows)": dict(granularity="thread", warps=8),
        "warps=4 (paper's c_w=4: Q groups of 4 rows)": dict(granularity="thread", warps=4),
        "per token (Q and K)": dict(granularity="token", warps=8),
    }
    finer = []
    for label, geometry in geometries.items():
        emu = ablation.sage_attention_ablation(
            q, k, v, qk_dtype="int4", block_q=ops.MMA_BLOCK_Q, block_k=ops.MMA_BLOCK_K,
            smooth_k=True, smooth_q="head", smooth_v=False, pv_dtype="e4m3", two_level=True,
            fp22=False, **geometry)
        finer.append(f"  {label:<45} CosSim {cosine_similarity(emu.half(), want):.6f} "
                     f"rel.L1 {rel_l1(emu.half(), want):.5f}")
    with capsys.disabled():
        print("\ninput families of docs/PROTOCOL.md, B1 H8 N4096 D128 fp16, sageattn(qk_quant='int4') "
              "(attention_mma INT4 QK + FP8 PV, K smoothed) vs float64 SDPA:")
        print("\n".join(lines))
        print("INT4 query-group geometry on the outliers family, emulation only (Q and K "
              "smoothed, FP8 PV):")
        print("\n".join(finer))
    assert not failures, "\n".join(failures)


# Issue 36's acceptance for the INT4 guard: the outlier family with qk_quant="int4" at 8-bit quality.
INT4_GUARD_OUTLIERS_COSSIM = 0.998


@pytest.mark.usefixtures("mma_fp8_kernel")
def test_int4_guard_on_the_anchor_families(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """sageattn(qk_quant="int4") with the INT4 guard at its default threshold (D38): on the
    outliers family (channel spread ~8) every head runs INT8 QK, CosSim >= 0.998 against float64
    (INT4 alone: ~0.81); on bias0 and bias4 (spread ~1.07) no head does, the output bit for bit
    the guard-off call's."""
    lines = []
    for name, (q, k, v) in anchor_families().items():
        want, _ = exact(q, k, v, False)
        runs = {}
        for guard in ("off", None):
            if guard is None:
                monkeypatch.delenv(_execute.INT4_GUARD_ENVIRONMENT)
            else:
                monkeypatch.setenv(_execute.INT4_GUARD_ENVIRONMENT, guard)
            _execute.clear_call_cache()
            poison_cuda_allocator()
            runs[guard] = sageattn_no_fallback(q, k, v, qk_quant="int4")
            assert_finite(runs[guard])
        guarded, raw = runs[None], runs["off"]
        cos, l1 = cosine_similarity(guarded, want), rel_l1(guarded, want)
        lines.append(f"{name:<9} guard on: CosSim {cos:.6f} rel.L1 {l1:.5f}   guard off: CosSim "
                     f"{cosine_similarity(raw, want):.6f} rel.L1 {rel_l1(raw, want):.5f}")
        if name == "outliers":
            assert cos >= INT4_GUARD_OUTLIERS_COSSIM, lines[-1]
        else:
            assert torch.equal(guarded, raw), lines[-1]
    with capsys.disabled():
        print("\nthe INT4 guard on the input families (B1 H8 N4096 D128 fp16, qk_quant='int4'):")
        print("\n".join(lines))


# ------------------------------------------------------------------------------------------------
# sageattn over shapes, layouts, dtypes
# ------------------------------------------------------------------------------------------------


# The channel offsets of test_sageattn_shapes' inputs (gpu_helpers.make_qkv's bias: Q, K, V).
SHAPE_BIAS = (1.0, 4.0, 0.0)


def is_int4_path(path: str) -> bool:
    return PATHS[path].get("qk_quant") == "int4"


def shape_cases() -> list[tuple[Any, ...]]:
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
    # Head dims the kernels are not built for: zero-padded to 128 (96) and 64 (32).
    cases += [
        (2, 4, 4, 200, 200, 96, False, "HND", torch.float16, True),
        (2, 4, 4, 200, 200, 96, True, "NHD", torch.bfloat16, True),
        (2, 4, 4, 129, 129, 32, False, "NHD", torch.float16, True),
        (2, 4, 4, 129, 129, 32, True, "HND", torch.bfloat16, True),
        (1, 8, 2, 300, 700, 32, False, "NHD", torch.bfloat16, True),  # GQA 4:1
        (1, 4, 4, 1000, 1000, 96, True, "packed", torch.float16, False),
        (1, 4, 4, 17, 17, 32, True, "3d-NHD", torch.float16, True),
        (1, 4, 4, 4097, 4097, 96, True, "HND", torch.bfloat16, False),
    ]
    return cases


def sageattn_shape_params() -> list[Any]:
    params = []
    for path in PATHS:
        for c in shape_cases():
            b, hq, hkv, nq, nk, d, causal, layout, dtype, emu = c
            if is_int4_path(path) and max(nq, nk) > INT4_MAX_LEN:
                continue
            tag = (f"{path}-b{b}h{hq}:{hkv}-{nq}x{nk}-d{d}-{'causal' if causal else 'full'}-"
                   f"{layout}-{'bf16' if dtype == torch.bfloat16 else 'fp16'}"
                   f"{'-emu' if emu else ''}")
            params.append(pytest.param(path, *c, id=tag))
    return params


@pytest.mark.parametrize("path,b,hq,hkv,nq,nk,d,causal,layout,dtype,emu",
                         sageattn_shape_params())
def test_sageattn_shapes(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, causal: bool,
                         layout: str, dtype: torch.dtype, emu: bool, path: str) -> None:
    """Every path on every shape, layout and dtype of shape_cases, on poisoned memory: within
    the documented bound of float64 attention and (``emu``, and INT4 always) of the emulation;
    causal query 0 is v[0]. Q and K carry channel offsets as real activations do (K's removed by
    its smoothing, Q's widening the Q groups' range on the kernels that do not smooth Q); V does
    not (an offset of V raises |out| and so lowers every relative error: plain V keeps the
    bounds' randn level; the emulations give at most 0.74 of the bounds with these inputs)."""
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq * 7 + nk, bias=SHAPE_BIAS)
    args, tensor_layout, views = in_layout(q4, k4, v4, layout)
    three_d = layout.startswith("3d-")
    kwargs = dict(is_causal=causal, enable_gqa=hq != hkv, tensor_layout=tensor_layout,
                  strict=True, **PATHS[path])
    kernel = sageattn_kernel(*args, **kwargs)
    poison_cuda_allocator()
    out = sageattn_no_fallback(*args, **kwargs)
    assert out.shape == args[0].shape and out.dtype == dtype
    if not three_d or tensor_layout == "HND":
        assert out.is_contiguous()  # written in the caller's layout, not transposed afterwards
    assert_finite(out)
    out4 = to_bhnd(out, tensor_layout, three_d)
    want, _ = exact(*views, causal)
    # INT4's exact bound comes from its emulation, so INT4 always runs it.
    emu_out = (emulate(*views, causal, PATHS[path].get("smooth_q"), kernel=kernel)[0]
               if emu or kernel.qk == "int4" else None)
    assert rel_l1(out4, want) <= exact_l1_bound(kernel, emu_out, want, dtype)
    if emu_out is not None:
        assert rel_l1(out4, emu_out.to(dtype)) <= EMULATION_L1
    if causal:
        assert_first_query_sees_first_key(out4, views[2], kernel)


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("d", [256, 192, 160, 136])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims_above_128_run_the_hopper_kernel(d: int, causal: bool) -> None:
    """head_dim 256 runs the Hopper kernel's FP8 tier, 136-248 zero-padded to it: against float64
    attention and the emulation (at the caller's head_dim: zero channels change no scale, mean or
    score), on poisoned memory, GQA, lengths that are not multiples of a tile, both layouts."""
    b, hq, hkv, nq, nk = (2, 4, 2, 1000, 777) if causal else (1, 8, 4, 513, 2049)
    dtype = torch.bfloat16 if d in (192, 136) else torch.float16
    layout = "NHD" if d in (160, 136) else "HND"
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=d + causal, bias=(1.0, 4.0, 4.0))
    args, tensor_layout, views = in_layout(q4, k4, v4, layout)
    kwargs = dict(is_causal=causal, enable_gqa=True, tensor_layout=tensor_layout, strict=True)
    assert sageattn_kernel(*args, **kwargs) == WGMMA
    poison_cuda_allocator()
    out = sageattn_no_fallback(*args, **kwargs)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert_finite(out)
    out4 = to_bhnd(out, tensor_layout, False)
    want, _ = exact(*views, causal)
    assert rel_l1(out4, want) <= exact_l1_bound(WGMMA, None, want, dtype)
    emu, _ = emulate(*views, causal, None, kernel=WGMMA, smooth_v=True)  # (smooth_v "auto": on above 128)
    assert rel_l1(out4, emu.to(dtype)) <= EMULATION_L1
    if causal:
        assert_first_query_sees_first_key(out4, views[2], WGMMA, smooth_v=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nq,nk", [(700, 200), (200, 700), (1, 300), (300, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_causal_unequal_lengths(nq: int, nk: int, dtype: torch.dtype, path: str) -> None:
    """SDPA's causal mask is top-left aligned: query i sees keys j <= i, also when q_len !=
    kv_len (queries past kv_len see every key)."""
    q4, k4, v4 = make_qkv(1, 4, 4, nq, nk, 128, dtype, seed=nq + 3 * nk, bias=(1.0, 3.0, 0.0))
    kernel = sageattn_kernel(q4, k4, v4, is_causal=True, **PATHS[path])
    poison_cuda_allocator()
    out = sageattn_no_fallback(q4, k4, v4, is_causal=True, **PATHS[path])
    assert_finite(out)
    want, _ = exact(q4, k4, v4, True)
    emu_out, _ = emulate(q4, k4, v4, True, PATHS[path].get("smooth_q"), kernel=kernel)
    assert rel_l1(out, want) <= exact_l1_bound(kernel, emu_out, want, dtype)
    assert rel_l1(out, emu_out.to(dtype)) <= EMULATION_L1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sageattn_smooth_v(path: str, layout: str) -> None:
    """smooth_v subtracts V's per-channel mean before FP8 (attention_wgmma and attention_mma's FP8
    variants) and adds it back; with PV in the input dtype V is not quantized, so it changes
    nothing there."""
    q4, k4, v4 = make_qkv(2, 8, 2, 1000, 777, 128, torch.bfloat16, seed=17, bias=(1.0, 2.0, 4.0))
    args, tensor_layout, views = in_layout(q4, k4, v4, layout)
    want, _ = exact(*views, False)
    errors = {}
    for smooth_v in (False, True):
        kwargs = dict(enable_gqa=True, tensor_layout=tensor_layout, smooth_v=smooth_v,
                      **PATHS[path])
        kernel = sageattn_kernel(*args, **kwargs)
        poison_cuda_allocator()
        out = sageattn_no_fallback(*args, **kwargs)
        assert_finite(out)
        out4 = to_bhnd(out, tensor_layout, False)
        emu_out, _ = emulate(*views, False, PATHS[path].get("smooth_q"), smooth_v=smooth_v,
                             kernel=kernel)
        assert rel_l1(out4, emu_out.to(out.dtype)) <= EMULATION_L1
        errors[smooth_v] = rel_l1(out4, want)
        assert errors[smooth_v] <= exact_l1_bound(kernel, emu_out, want, out.dtype)
    if kernel.pv == "fp8":  # V's offsets of 4 cost FP8 precision, which its mean gives back
        assert errors[True] < errors[False], errors


@pytest.mark.parametrize("path", PATHS)
def test_sageattn_scale(path: str) -> None:
    """sageattn(scale=...) end to end on the kernel (strict: no fallback), on poisoned memory:
    the output within EMULATION_L1 of the emulation at that scale and within the documented bound
    of float64 attention at that scale (the emulations: 0.006-0.038 here, INT4 0.12 against its
    own bound; the output at the default scale 1 / sqrt(D) is ~1.1 away), the LSE the
    emulation's at that scale."""
    scale = 0.05  # (1 / sqrt(128) = 0.088 by default)
    q4, k4, v4 = make_qkv(1, 4, 2, 300, 777, 128, torch.float16, seed=23, bias=SHAPE_BIAS)
    kwargs = dict(enable_gqa=True, scale=scale, strict=True, **PATHS[path])
    kernel = sageattn_kernel(q4, k4, v4, **kwargs)
    poison_cuda_allocator()
    out, lse = sageattn_no_fallback(q4, k4, v4, return_lse=True, **kwargs)
    assert_finite(out, lse)
    want, _ = exact(q4, k4, v4, False, scale)
    emu, emu_lse = emulate(q4, k4, v4, False, PATHS[path].get("smooth_q"), scale=scale,
                           kernel=kernel)
    assert rel_l1(out, emu.to(out.dtype)) <= EMULATION_L1
    assert rel_l1(out, want) <= exact_l1_bound(kernel, emu, want, out.dtype)
    atol = WGMMA_LSE_EMULATION_ATOL if kernel.kernel == "wgmma" else LSE_EMULATION_ATOL[kernel.qk]
    torch.testing.assert_close(lse, emu_lse, rtol=0, atol=atol)


# ------------------------------------------------------------------------------------------------
# return_lse
# ------------------------------------------------------------------------------------------------


# LSE vs exact, kernel -> (max |error| of queries that see >= 64 keys, max |error|). A query that
# sees few keys carries one score's quantization error (~0.02); with 64 or more keys the errors
# average out. attention_mma INT8 (either PV: the LSE comes from the scores alone): 8-bit scores
# carry ~1e-2 of noise; on these biased inputs the attention is peaked enough that the LSE keeps
# up to ~1.5e-2 of it (measured on the H100: max 0.0134). attention_wgmma does not smooth Q, whose
# offsets widen the Q groups' range: the emulation gives up to 0.038 (>= 64 keys) and 0.050 (all)
# over 58 draws of these shapes; its accurate tier has the same scores. INT4 has no fixed entry: its emulation's error plus
# LSE_EMULATION_ATOL (the kernel is within that of its emulation).
LSE_EXACT_BOUNDS = {MMA_INT8_INPUT: (2e-2, 0.05), MMA_INT8_FP8: (2e-2, 0.05), WGMMA: (0.06, 0.1),
                    WGMMA_INPUT: (0.06, 0.1)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "b,hq,hkv,nq,nk,d,causal,layout,smooth_k",
    [
        (2, 4, 4, 1000, 1000, 128, False, "HND", True),
        (2, 4, 4, 1000, 1000, 64, True, "NHD", True),
        (1, 8, 2, 300, 700, 128, True, "HND", True),  # GQA: each q head adds its kv head's mean
        (1, 8, 1, 700, 300, 64, False, "NHD", True),  # MQA
        (1, 4, 4, 500, 500, 128, True, "3d-NHD", True),
        (2, 4, 4, 1000, 1000, 128, False, "HND", False),
        (1, 4, 2, 300, 300, 96, True, "NHD", True),  # padded head_dim
    ],
)
def test_return_lse(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, causal: bool,
                    layout: str, smooth_k: bool, path: str) -> None:
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, torch.float16, seed=nq + 11,
                          bias=(1.0, 2.0 if smooth_k else 0.0, 0.0))
    args, tensor_layout, views = in_layout(q4, k4, v4, layout)
    three_d = layout.startswith("3d-")
    kwargs = dict(is_causal=causal, enable_gqa=hq != hkv, tensor_layout=tensor_layout,
                  smooth_k=smooth_k, **PATHS[path])
    kernel = sageattn_kernel(*args, **kwargs)
    poison_cuda_allocator()
    out, lse = sageattn_no_fallback(*args, return_lse=True, **kwargs)
    assert_finite(out, lse)
    assert torch.equal(out, sageattn_no_fallback(*args, **kwargs))
    assert lse.dtype == torch.float32
    assert lse.shape == ((hq, nq) if three_d else (b, hq, nq))
    lse4 = lse[None] if three_d else lse
    _, want = exact(*views, causal)
    _, emu_lse = emulate(*views, causal, PATHS[path].get("smooth_q"), smooth_k=smooth_k,
                         kernel=kernel)
    atol = WGMMA_LSE_EMULATION_ATOL if kernel.kernel == "wgmma" else LSE_EMULATION_ATOL[kernel.qk]
    torch.testing.assert_close(lse4, emu_lse, rtol=0, atol=atol)
    err = (lse4.double() - want).abs()
    keys_seen = torch.arange(nq, device=DEVICE).clamp(max=nk - 1) + 1 if causal else \
        torch.full((nq,), nk, device=DEVICE)
    many = keys_seen >= 64
    if kernel.qk == "int4":
        emu_err = (emu_lse.double() - want).abs()
        many_keys_bound = emu_err[..., many].max().item() + atol
        bound = emu_err.max().item() + atol
    else:
        many_keys_bound, bound = LSE_EXACT_BOUNDS[kernel]
    assert err[..., many].max().item() <= many_keys_bound
    assert err.max().item() <= bound


# ------------------------------------------------------------------------------------------------
# Determinism, fallbacks, plan
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_repeated_runs_bit_identical(path: str) -> None:
    n = INT4_MAX_LEN + 1 if is_int4_path(path) else 4097
    q4, k4, v4 = make_qkv(1, 8, 2, n, n, 128, torch.bfloat16, seed=5, bias=(1.0, 4.0, 1.0))
    args, _, _ = in_layout(q4, k4, v4, "NHD")
    kwargs = dict(is_causal=True, enable_gqa=True, tensor_layout="NHD", return_lse=True,
                  **PATHS[path])
    sageattn_kernel(*args, **kwargs)  # skips a path this GPU cannot run
    poison_cuda_allocator()
    first = sageattn_no_fallback(*args, **kwargs)
    assert_finite(*first)
    for _ in range(3):
        poison_cuda_allocator()
        again = sageattn_no_fallback(*args, **kwargs)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("d", [64, 128, 96])
def test_sageattn_runs_the_kernel_it_names(monkeypatch: pytest.MonkeyPatch, d: int) -> None:
    """sageattn runs the op and variant sageattn_kernel names (which the emulations above rely
    on), and that is what the build and GPU imply: on sm_90 with the wgmma build,
    attention_wgmma for INT8 without Q smoothing (pv_quant="none": its accurate tier); else attention_mma
    with FP8 PV when asked for, for INT4, or ("auto") where the build has FP8 code for this GPU;
    PV in the input dtype otherwise."""
    ran: list[tuple[str, str, bool]] = []

    def recording_mma(*args: Any, _real: Any = ops.sageattn_mma) -> Any:
        ran.append(("mma", args[3], args[4] == "fp8"))
        return _real(*args)

    def recording_wgmma(*args: Any, _real: Any = ops.sageattn_wgmma) -> Any:
        ran.append(("wgmma", "int8", args[3] == "fp8"))
        return _real(*args)

    monkeypatch.setattr(ops, "sageattn_mma", recording_mma)
    monkeypatch.setattr(ops, "sageattn_wgmma", recording_wgmma)
    q, k, v = make_qkv(1, 4, 4, 200, 200, d, torch.float16, seed=d)
    fp8_here = mma_fp8_on_device()
    for qk in ("int8", "int4"):
        for pv in ("auto", "fp8", "none"):
            for smooth_q in ("auto", False, True, "head"):
                options = dict(qk_quant=qk, pv_quant=pv, smooth_q=smooth_q)
                needs_fp8 = pv == "fp8" or qk == "int4"
                if (qk == "int4" and pv == "none") or (needs_fp8 and not fp8_here):
                    continue  # falls back (test_unsupported_calls_fall_back)
                ran.clear()
                named = sageattn_kernel(q, k, v, **options)
                poison_cuda_allocator()
                out = sageattn_no_fallback(q, k, v, **options)
                assert_finite(out)
                assert ran == [(named.kernel, named.qk, named.pv == "fp8")], (options, ran, named)
                smoothed = smooth_q in (True, "head")
                if wgmma_on_device() and qk == "int8" and not smoothed:
                    expected = WGMMA if pv != "none" else WGMMA_INPUT
                else:
                    # "auto" takes FP8 where FP8 mma.sync is native: Ada, consumer Blackwell.
                    capability = torch.cuda.get_device_capability()
                    native = capability == (8, 9) or capability[0] == 12
                    fp8 = needs_fp8 or (pv == "auto" and fp8_here and native)
                    expected = KernelChoice("mma", qk, "fp8" if fp8 else "input")
                assert named == expected, options


@pytest.mark.parametrize("path", ["default", "accurate", "mma-fp16"])
def test_sageattn_compiled_and_graphed(path: str) -> None:
    """The kernels under torch.compile (inductor, fullgraph=True: sageattn is one graph op, with
    ops around it fused by inductor; dynamic=True over two lengths) and in a captured CUDA graph
    (replayed on new inputs): eager's result, bit for bit, strict (no fallback)."""
    options = dict(PATHS[path], strict=True, enable_gqa=True)
    dtype = torch.float16

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = sageattn(q * 1.5, k, v, is_causal=causal, return_lse=True,
                            tensor_layout="NHD", **options)
        return out * 2, lse

    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for n, causal in ((300, True), (1000, False)):
        q, k, v = (t.transpose(1, 2).contiguous()
                   for t in make_qkv(2, 4, 2, n, n, 128, dtype, seed=n, bias=(1.0, 4.0, 1.0)))
        got, want = compiled(q, k, v, causal), block(q, k, v, causal)
        assert_finite(*got)
        assert all(map(torch.equal, got, want)), (n, causal)

    q, k, v = (t.transpose(1, 2).contiguous() for t in make_qkv(1, 4, 4, 700, 700, 64, dtype, seed=9))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block(q, k, v, True)  # warm-up outside capture (lazy initialisation, allocator pools)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = block(q, k, v, True)
    for seed in (10, 11):
        fresh = [t.transpose(1, 2).contiguous()
                 for t in make_qkv(1, 4, 4, 700, 700, 64, dtype, seed=seed, bias=(0.5, 2.0, 1.0))]
        for t, new in zip((q, k, v), fresh):
            t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert all(map(torch.equal, graphed, block(*fresh, True))), seed


def test_sageattn_compiled_reduce_overhead() -> None:
    """torch.compile(mode="reduce-overhead") (inductor's CUDA-graph trees) around sageattn: each
    call on new inputs gives eager's result, bit for bit."""

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sageattn(q, k, v, is_causal=True, strict=True) + 1

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # the first calls record, later ones replay
        q, k, v = make_qkv(1, 4, 4, 500, 500, 128, torch.bfloat16, seed=seed, bias=(1.0, 4.0, 1.0))
        got = compiled(q, k, v).clone()
        assert torch.equal(got, block(q, k, v)), seed


def fallback_cases() -> list[Any]:
    return [
        pytest.param(dict(smooth_q="block"), (1, 2, 200, 128), "per block", id="smooth-q-block"),
        pytest.param({}, (1, 2, 200, 264), "built for head_dim 64, 128, 256", id="head-dim-264"),
        pytest.param(dict(pv_quant="none"), (1, 2, 200, 256), "run head_dim up to 128",
                     id="head-dim-256-accurate"),
        pytest.param({}, (1, 2, 200, 100), "got 100", id="head-dim-100"),
        pytest.param(dict(qk_quant="int4", pv_quant="none"), (1, 2, 200, 128),
                     "INT4 QK runs with FP8 PV only", id="int4-pv-none"),
        pytest.param(dict(qk_quant="int4"), (1, 2, 200, 128), "FP8 PV needs an sm_89+ GPU",
                     id="int4-without-fp8"),
        pytest.param(dict(pv_quant="fp8", smooth_q="head"), (1, 2, 200, 64),
                     "FP8 PV needs an sm_89+ GPU", id="fp8-without-fp8"),
    ]


@pytest.mark.parametrize("kwargs,shape,reason", fallback_cases())
def test_unsupported_calls_fall_back(kwargs: dict[str, Any], shape: tuple[int, ...],
                                     reason: str) -> None:
    if reason.startswith("FP8 PV needs") and mma_fp8_on_device():
        pytest.skip("this GPU and build run FP8 PV")
    _execute._warned_reasons.clear()
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
    _execute._warned_reasons.clear()


def test_kernel_plan_names_the_kernel() -> None:
    plan = kernel_plan()
    if wgmma_on_device():
        assert plan.startswith(f"quantized SageAttention2: {_plan.WGMMA_PLAN}"), plan
        assert _plan.MMA_PLAN in plan, plan  # smooth_q="head"/True still runs the warp-level kernel
    else:
        assert plan.startswith(f"quantized SageAttention2: {_plan.MMA_PLAN}"), plan
    if mma_fp8_on_device():
        assert "INT8 QK + FP8 PV" in plan and "INT4 QK + FP8 PV" in plan, plan
    else:
        assert "INT8 QK + FP16/BF16 PV" in plan and "INT4 QK + FP8 PV" not in plan, plan


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("d", [64, 40])
def test_output_memory_follows_the_query(path: str, d: int) -> None:
    """[B, H, N, D] views of [B, N, H, D] memory (diffusers' dispatcher): the output comes back
    in NHD memory, as SDPA's flash and cuDNN backends give it (the caller's transpose back is
    then free), with the values of the same call on contiguous inputs, bit for bit."""
    q4, k4, v4 = make_qkv(2, 6, 6, 333, 333, d, torch.bfloat16, seed=11)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q4, k4, v4)]
    assert views[0].stride(1) < views[0].stride(2)
    kwargs = PATHS[path]
    sageattn_kernel(*views, **kwargs)  # skips a path this GPU cannot run
    poison_cuda_allocator()
    out = sageattn_no_fallback(*views, **kwargs)
    assert out.transpose(1, 2).is_contiguous()
    assert_finite(out)
    assert torch.equal(out, sageattn_no_fallback(q4, k4, v4, **kwargs))
