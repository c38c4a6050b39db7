"""GPU tests of the attention kernels (docs/DESIGN.md): the warp-level ``attention_mma`` in its
three variants (INT8 QK + fp16/bf16 PV on every arch; INT8 QK + FP8 PV and INT4 QK + FP8 PV on
sm_89+ builds), the Hopper ``attention_wgmma`` (sm_90a builds on sm_90 GPUs), and ``sageattn``'s
quantized path on all of them. ``sageattn`` picks the kernel and precisions with
``api._kernel_for`` (a :class:`api.KernelChoice`); the sageattn tests run the PATHS below (on an
H100: "default" attention_wgmma, "mma" INT8 + FP8 PV, "mma-fp16" INT8 + FP16/BF16 PV, "int4"
INT4 + FP8 PV) and compare each with the emulation of the variant it ran.

Three references:
- the emulation of the same algorithm (``reference.sage_attention_reference`` with the kernel's
  geometry, :func:`emulate`), run on the GPU in float64: relative L1 <= 1e-3 (the acceptance
  criterion), both outputs rounded to the kernel's output dtype (bf16 rounding alone is ~1.4e-3
  rel. L1), and the LSE to ~1e-3 (INT8; INT4's coarser codes move it further, see
  LSE_EMULATION_ATOL).
  attention_mma: per-thread INT8/INT4 groups of reference.quantize_q_reference(block_q=128,
  warps=ops.MMA_WARPS)
  (quantized in the kernel; Q smoothed per head or not) and quantize_kv(block_k=ops.MMA_BLOCK_K);
  PV either with P and V rounded to
  the input dtype, FP32 accumulation, no two-level buffer, or (FP8 variants) P~ (x448) and V per
  channel (minus its mean with smooth_v) in E4M3, two-level FP32 accumulation per 128-key tile,
  no FP22 (the H100 has no native FP8 mma.sync; on Ada's native one the FP22 rounding of a
  128-key tile, ~1e-4 relative, stays far below the 1e-3 criterion).
  attention_wgmma: Q unsmoothed, quantized in the kernel in groups of rows {g, g+8} of 16-row warp
  slabs (block_q=128, warps=8), K of quantize_kv(block_k=ops.WGMMA_BLOCK_K), FP8 PV as above;
- exact float64 attention (``reference.exact_attention``): the 8-bit error level (randn inputs
  give rel. L1 ~0.01 with FP16 PV, bound 0.03; ~0.038 with FP8 PV, bound 0.05), INT4's level
  derived from its emulation (it depends on the input far more than 8-bit's), and the ANCHORS.md
  accuracy families (attention_wgmma: no worse than the official 8-bit sm90 kernel);
- exact LSE (natural log).

A head_dim the kernels are not built for (32, 96, ...) runs zero-padded to the next built one
(64, 128); the emulation runs on the unpadded inputs (zero channels change nothing).

Every op allocates its outputs, so calls are preceded by freeing blocks of 0xFF bytes (NaN in
fp16/bf16/fp32) to the caching allocator: an element the kernel forgot to write is NaN.

The ANCHORS numbers are printed (shown without ``-s``).
"""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import pytest
import torch

from sageattention2 import SageAttentionFallbackWarning, api, kernel_plan, ops, sageattn
from sageattention2 import reference as ref
from sageattention2.api import KernelChoice

pytestmark = pytest.mark.gpu

if not ops.HAS_EXTENSION:
    pytest.skip(f"compiled extension not available: {ops.EXTENSION_ERROR}", allow_module_level=True)
if not ops.has_op("attention_mma"):
    pytest.skip("this build has no attention_mma op", allow_module_level=True)

DEVICE = "cuda"
LOG2E = math.log2(math.e)
WGMMA = KernelChoice("wgmma", "int8", "fp8")
MMA_INT8_INPUT = KernelChoice("mma", "int8", "input")
MMA_INT8_FP8 = KernelChoice("mma", "int8", "fp8")
MMA_INT4_FP8 = KernelChoice("mma", "int4", "fp8")
EMULATION_L1 = 1e-3  # kernel vs emulation of the same algorithm
EXACT_L1 = 0.03  # FP16/BF16 PV vs float64 attention on randn inputs (~0.01)
# FP8 PV vs float64 attention on randn inputs: nearly uniform attention, whose small outputs
# carry P's and V's E4M3 rounding (the emulation gives up to 0.038 on the shapes below; the
# official 8-bit sm90 kernel 0.0383 on ANCHORS bias0).
EXACT_L1_FP8 = 0.05
# 8-bit variants vs float64 attention on randn inputs. INT4 has no fixed entry: see
# exact_l1_bound.
EXACT_L1_OF = {MMA_INT8_INPUT: EXACT_L1, MMA_INT8_FP8: EXACT_L1_FP8, WGMMA: EXACT_L1_FP8}
# LSE, kernel vs emulation (atol), by QK format. The emulation takes its own float64 means, the
# kernel's preprocessing float32 ones, so a few codes at a rounding boundary sit one step apart;
# a row that few keys dominate moves its LSE by about one code step's score change. An INT4 step
# is 127/7 ~ 18x an INT8 one, hence 18x the INT8 tolerance (rounded up).
LSE_EMULATION_ATOL = {"int8": 1e-3, "int4": 0.02}
# attention_wgmma's l is summed by the FP8 PV wgmma (a column of ones), whose accumulator keeps
# fewer bits than the emulation's float32 per 32-key step (paper 3.4's FP22, truncating): the
# output, O / l of one accumulator, cancels that; the LSE, log l, shows it (1.3e-3 measured on
# the H100, session 5).
WGMMA_LSE_EMULATION_ATOL = 3e-3
# The same for the op tests, whose inputs have larger K offsets (4 instead of 2).
OP_LSE_ATOL = {"int8": 5e-3, "int4": 0.1}
# The sageattn paths of the sageattn tests, one per variant on an H100 with the default build:
# "default" passes no option (attention_wgmma on sm_90 with the wgmma build, else attention_mma
# with FP8 PV on sm_89, FP16/BF16 PV elsewhere); "mma" smooths Q per head, which the Hopper kernel
# does not, and asks for FP8 PV (attention_mma INT8 + FP8, emulated FP8 mma.sync on sm_90);
# "mma-fp16" asks for PV in the input dtype (attention_mma INT8 + FP16/BF16 PV everywhere, Q not
# smoothed: the default of an sm_80 GPU); "int4" INT4 QK with FP8 PV (sm_89+, Q smoothed by
# default).
PATHS: dict[str, dict[str, Any]] = {
    "default": {},
    "mma": {"smooth_q": "head", "pv_quant": "fp8"},
    "mma-fp16": {"pv_quant": "none"},
    "int4": {"qk_quant": "int4"},
}
# INT4 mma.sync has no native instruction on Hopper (emulated at ~50 TOPS, ANCHORS.md) and its
# exact bound needs the emulation of every case: the int4 path keeps to shapes up to this length.
INT4_MAX_LEN = 2000


@pytest.fixture(autouse=True)
def _kernel_available() -> None:
    dev = torch.device(DEVICE)
    reason = api._device_reason(dev) or api._build_reason(dev)
    if reason is not None:
        pytest.skip(f"the attention kernel cannot run here: {reason}")


@pytest.fixture
def wgmma_kernel() -> None:
    """Skip unless the build has attention_wgmma and this GPU runs its code (sm_90a)."""
    if not ops.has_op("attention_wgmma"):
        pytest.skip("this build has no attention_wgmma op")
    capability = api._capability(torch.cuda.current_device())
    if not api._wgmma_runs_on(capability):
        pytest.skip(f"no attention_wgmma code for sm_{capability[0]}{capability[1]} in this build")


@pytest.fixture
def mma_fp8_kernel() -> None:
    """Skip unless the build has attention_mma's FP8 PV variants for this GPU (sm_89+)."""
    if not mma_fp8_on_device():
        capability = torch.cuda.get_device_capability()
        pytest.skip(f"no {ops.MMA_FP8_FAMILY} code for sm_{capability[0]}{capability[1]} in "
                    "this build")


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def wgmma_on_device() -> bool:
    """Whether this GPU is sm_90 and the build has attention_wgmma code for it (from build_info,
    not from api's own decision)."""
    info = ops.build_info()
    return (ops.has_op("attention_wgmma") and info is not None
            and torch.cuda.get_device_capability() == (9, 0)
            and any(ops.kernel_family(family) == ops.WGMMA_FAMILY and "sm_90a" in archs
                    for family, archs in info.kernels.items()))


def mma_fp8_on_device() -> bool:
    """Whether the build has attention_mma's FP8 PV code (family attention_mma_fp8) that runs on
    this GPU (from build_info, not from api's own decision)."""
    capability = torch.cuda.get_device_capability()
    info = ops.build_info()
    return info is not None and any(
        ops.kernel_family(family) == ops.MMA_FP8_FAMILY
        and any(ops.arch_runs_on(a, capability) for a in archs)
        for family, archs in info.kernels.items())


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
            smooth_q: bool | str | None = None, smooth_k: bool = True, scale: float | None = None,
            *, smooth_v: bool = False, kernel: KernelChoice = MMA_INT8_INPUT,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The algorithm of ``kernel`` in float64: (out float32, lse with the row constant).

    attention_mma: Q smoothed per head (``smooth_q`` True or "head"; None or "auto": as
    sageattn's "auto", for INT4 QK only) or not (False), QK in ``kernel.qk``; PV in the input
    dtype (K's mean over sageattn's token sample, api.smoothing_sample_stride; V is not
    quantized, so ``smooth_v`` changes nothing there: ignored; softmax steps of
    MMA_INPUT_PV_TILE_K keys, the lazy running max of a warp's rows) or in FP8 (K's mean over
    all tokens; P~ x448 and V per channel, minus its mean with ``smooth_v``, two-level
    accumulation).
    attention_wgmma: no Q smoothing (``smooth_q`` None, "auto" or False), one Q scale per row, K
    groups of ops.WGMMA_BLOCK_K, FP8 PV with one V scale per tile (and V's mean when ``smooth_v``).
    """
    common = dict(is_causal=causal, scale=scale, qk_dtype=kernel.qk, granularity="thread",
                  smooth_k=smooth_k, fp22=False, return_lse=True)
    if kernel.kernel == "wgmma":
        if smooth_q in (True, "head"):
            raise ValueError("attention_wgmma does not smooth Q")
        return ref.hopper_kernel_reference(
            q4, k4, v4, block_k=ops.WGMMA_BLOCK_K, mean_stride=api.smoothing_sample_stride(k4.shape[2]),
            is_causal=causal, scale=scale, smooth_k=smooth_k, smooth_v=smooth_v, return_lse=True)
    smoothed = smooth_q in (True, "head") or (smooth_q in (None, "auto") and kernel.qk == "int4")
    mma = dict(block_q=ops.MMA_BLOCK_Q, warps=ops.MMA_WARPS, block_k=ops.MMA_BLOCK_K,
               smooth_q="head" if smoothed else None)
    if kernel.pv == "fp8":
        return ref.sage_attention_reference(
            q4, k4, v4, smooth_v=smooth_v, pv_dtype="e4m3", two_level=True, **mma, **common)
    return ref.sage_attention_reference(
        q4, k4, v4, smooth_v=False, pv_dtype="bf16" if v4.dtype == torch.bfloat16 else "fp16",
        two_level=False, softmax_block=ops.MMA_INPUT_PV_TILE_K, lazy_rescale=ops.MMA_LAZY_RESCALE_LOG2,
        rescale_rows=ops.MMA_BLOCK_Q // ops.MMA_INPUT_PV_WARPS,
        integer_max=not smoothed and api._kernel_head_dim(q4.shape[-1]) == 64,  # kFoldedExponent
        mean_stride=api.smoothing_sample_stride(k4.shape[2]), **mma, **common,
    )


def exact_l1_bound(kernel: KernelChoice, emu_out: torch.Tensor | None, want: torch.Tensor,
                   dtype: torch.dtype) -> float:
    """The largest rel. L1 vs exact attention (``want``) the kernel may have. 8-bit: the fixed
    level of EXACT_L1_OF. INT4: its error depends on the input far more (ANCHORS.md: ~0.2 on
    randn, ~0.02 with channel offsets and smoothing), so the bound is what its emulation
    ``emu_out`` gives, with 10 % slack, plus twice EMULATION_L1 (by the triangle inequality the
    kernel, within EMULATION_L1 of the emulation, can be at most that much further away)."""
    if kernel.qk == "int8":
        return EXACT_L1_OF[kernel]
    assert emu_out is not None, "INT4's exact bound needs the emulation"
    return 1.1 * rel_l1(emu_out.to(dtype), want) + 2 * EMULATION_L1


def sageattn_kernel(*args: Any, **kwargs: Any) -> KernelChoice:
    """The kernel and precisions that sageattn runs on this device for these arguments: the
    choice of ``api._kernel_for`` on the validated call (which must not fall back; a call that
    needs FP8 PV on a GPU or build without it skips the test)."""
    bound = inspect.signature(sageattn).bind(*args, **kwargs)
    bound.apply_defaults()
    call = api._validate(**bound.arguments)
    reason = api._unsupported_reason(call)
    if reason is not None and reason.startswith("FP8 PV needs") and not mma_fp8_on_device():
        pytest.skip(reason)
    assert reason is None, reason
    return api._kernel_for(call)


def assert_first_query_sees_first_key(out4: torch.Tensor, v4: torch.Tensor,
                                      kernel: KernelChoice) -> None:
    """Causal query 0 attends key 0 alone: its output is v[0], to an ulp of the output dtype
    (PV in the input dtype), or to v's E4M3 rounding (FP8 PV without smooth_v: at most 2^-4 |v|
    in E4M3's normal range, half a subnormal step, 2^-10 * scale, below it; the scale is
    max_n |v_c| / 448 per channel (attention_mma), or attention_wgmma's per-tile one, at most
    2 * max |v| / 448 over the first 128 keys; P~ of the lone key is 448, exact in E4M3)."""
    v = v4.repeat_interleave(out4.shape[1] // v4.shape[1], dim=1)
    v0, got = v[:, :, 0], out4[:, :, 0]
    eps = torch.finfo(out4.dtype).eps
    if kernel.pv == "input":
        torch.testing.assert_close(got, v0, rtol=eps, atol=1e-6)
        return
    if kernel.kernel == "wgmma":
        scale = 2 * v[:, :, :ops.WGMMA_BLOCK_K].double().abs().amax(dim=(2, 3))[..., None] / 448
    else:
        scale = v.double().abs().amax(dim=2) / 448
    tol = (2 ** -4 + 2 * eps) * v0.double().abs() + 2 ** -10 * scale + 1e-6
    err = (got.double() - v0.double()).abs()
    assert (err <= tol).all(), f"query 0 differs from v[0] by up to {(err / tol).max():.2f} x tol"


def run_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, *,
           qk: str = "int8", pv: str = "input", smooth_q: bool = True, smooth_k: bool = True,
           smooth_v: bool = False, out_nhd: bool = False, return_lse: bool = True,
           scale: float | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """sageattn's preprocessing for the warp-level kernel (api._mma) written out, then
    attention_mma on poisoned memory with ``q4`` as given (the kernel quantizes Q): ``qk``
    "int8"/"int4" K codes; ``pv`` "input" (the caller's fp16/bf16 v; K's mean over the token
    sample, api.smoothing_sample_stride) or "fp8" (K's mean over all tokens, V's scale and, with
    ``smooth_v``, mean from smoothing_stats, FP8 V from quantize_kv). Returns (out, lse), the
    LSE complete (the kernel adds the row constant of K smoothing)."""
    sm_scale = q4.shape[-1] ** -0.5 if scale is None else scale
    mult = sm_scale * LOG2E
    fp8 = pv == "fp8"
    q_mean = k_mean = v_scale = v_mean = None
    if smooth_q or smooth_k or fp8:
        k_rows = k4 if fp8 else k4[:, :, ::api.smoothing_sample_stride(k4.shape[2])]
        stats = ops.smoothing_stats(q4 if smooth_q else None, k_rows if smooth_k else None,
                                    v4 if fp8 else None, fp8 and smooth_v)
        q_mean = stats.q_mean if smooth_q else None
        k_mean = stats.k_mean if smooth_k else None
        v_scale = stats.v_scale if fp8 else None
        v_mean = stats.v_mean if fp8 and smooth_v else None
    kv = ops.quantize_kv(k4, v4 if fp8 else None, k_mean, v_mean, v_scale, q_mean,
                         ops.MMA_BLOCK_K, qk, mult)
    poison_allocator()
    return ops.attention_mma(q4, q_mean, kv.k_quant, kv.k_scale, kv.delta_s if smooth_q else None,
                             kv.v_fp8 if fp8 else v4, v_scale, v_mean, k_mean, qk, k4.shape[2],
                             sm_scale, causal, out_nhd, return_lse)


def run_wgmma_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, *,
                 smooth_k: bool = True, smooth_v: bool = False, out_nhd: bool = False,
                 return_lse: bool = True, scale: float | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """sageattn's preprocessing for the Hopper kernel (api._wgmma) written out: one
    smoothing_stats pass (K's mean and, with smooth_v, V's mean), one quantize_kv pass (INT8 K,
    FP8 V with one scale per tile); then attention_wgmma on poisoned memory, with ``q4`` as given
    (it reads any view with a contiguous last dimension in place). The means are over the
    token sample sageattn takes (api.smoothing_sample_stride). Returns (out, lse)."""
    sm_scale = q4.shape[-1] ** -0.5 if scale is None else scale
    sample = slice(None, None, api.smoothing_sample_stride(k4.shape[2]))
    stats = ops.smoothing_stats(None, k4[:, :, sample], v4[:, :, sample], smooth_v)
    k_mean = stats.k_mean if smooth_k else None
    v_mean = stats.v_mean if smooth_v else None
    kv = ops.quantize_kv(k4, v4, k_mean, v_mean, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    poison_allocator()
    return ops.attention_wgmma(q4, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, v_mean,
                               k_mean, k4.shape[2], sm_scale, causal, out_nhd, return_lse)


def q_view(q4: torch.Tensor, layout: str) -> torch.Tensor:
    """A [B, H, N, D] view of q4's values in another memory layout: "NHD" (a transposed
    contiguous [B, N, H, D] tensor) or "packed" (slot 1 of a [B, N, 3, H, D] tensor whose other
    slots are NaN, so a read outside the view poisons the output)."""
    if layout == "NHD":
        view = q4.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "packed":
        b, h, n, d = q4.shape
        packed = torch.full((b, n, 3, h, d), math.nan, dtype=q4.dtype, device=q4.device)
        packed[:, :, 1] = q4.transpose(1, 2)
        view = packed[:, :, 1].transpose(1, 2)
    else:
        raise ValueError(layout)
    assert not view.is_contiguous() and torch.equal(view, q4)
    return view


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
OP_KERNELS = {"int8-input-pv": MMA_INT8_INPUT, "int8-fp8-pv": MMA_INT8_FP8,
              "int4-fp8-pv": MMA_INT4_FP8}
# The variants of attention_mma with smooth_v (which only matters with FP8 PV).
OP_VARIANTS = {**{name: (kernel, False) for name, kernel in OP_KERNELS.items()},
               "int8-fp8-pv-smooth-v": (MMA_INT8_FP8, True),
               "int4-fp8-pv-smooth-v": (MMA_INT4_FP8, True)}


def require_kernel(kernel: KernelChoice) -> None:
    """Skip unless this GPU and build run ``kernel``'s variant of attention_mma (FP8 PV: sm_89+
    with the attention_mma_fp8 family)."""
    if kernel.pv == "fp8" and not mma_fp8_on_device():
        capability = torch.cuda.get_device_capability()
        pytest.skip(f"no {ops.MMA_FP8_FAMILY} code for sm_{capability[0]}{capability[1]} in "
                    "this build")


@pytest.mark.parametrize("variant", OP_VARIANTS)
@pytest.mark.parametrize("shape", OP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("smoothing", SMOOTHING, ids=["smooth-qk", "smooth-k", "smooth-q"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_op_matches_emulation(shape: tuple[int, ...], smoothing: tuple[bool, bool], causal: bool,
                              dtype: torch.dtype, variant: str) -> None:
    kernel, smooth_v = OP_VARIANTS[variant]
    require_kernel(kernel)
    smooth_q, smooth_k = smoothing
    b, hq, hkv, nq, nk, d = shape
    # V's channel offsets (4 * randn with smooth_v, else 1) make smooth_v change its FP8 codes,
    # and the output by far more than EMULATION_L1.
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq + d,
                          bias=(1.0, 4.0, 4.0 if smooth_v else 1.0))
    out_nhd = (nq + causal) % 2 == 1
    out, lse = run_op(q4, k4, v4, causal, qk=kernel.qk, pv=kernel.pv, smooth_q=smooth_q,
                      smooth_k=smooth_k, smooth_v=smooth_v, out_nhd=out_nhd)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype
    assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    assert_finite(out, lse)
    want, want_lse = emulate(q4, k4, v4, causal, smooth_q, smooth_k, smooth_v=smooth_v,
                             kernel=kernel)
    l1 = rel_l1(out, want.to(dtype))
    assert l1 <= EMULATION_L1, f"rel. L1 vs emulation {l1:.2e}"
    # The op's LSE is complete: the kernel adds the row constant sm_scale * q . k_mean that K
    # smoothing drops (k's offsets of 4 make it large, so leaving it out fails by far).
    # The emulation takes its own float64 means, so a few codes sit one step from the kernel's
    # (float32 means): a row's LSE moves by up to a few 1e-3 then with INT8 (relative to the
    # LSE itself, which is large without K smoothing), the output by far less.
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-3, atol=OP_LSE_ATOL[kernel.qk])
    # Unsmoothed K with offsets of 4 quantizes coarsely (what smoothing is for): a sanity bound.
    exact_out = exact(q4, k4, v4, causal)[0]
    bound = exact_l1_bound(kernel, want, exact_out, dtype)
    assert rel_l1(out, exact_out) <= (bound if smooth_k else max(bound, 0.2))


@pytest.mark.parametrize("variant", OP_KERNELS)
def test_op_without_lse_and_scale(variant: str) -> None:
    kernel = OP_KERNELS[variant]
    require_kernel(kernel)
    q4, k4, v4 = make_qkv(2, 4, 4, 333, 333, 128, torch.float16, seed=3, bias=(0.0, 2.0, 0.0))
    out, lse = run_op(q4, k4, v4, True, qk=kernel.qk, pv=kernel.pv, return_lse=False,
                         scale=0.05)
    assert lse.shape == (0,)
    assert_finite(out)
    want, _ = emulate(q4, k4, v4, True, True, scale=0.05, kernel=kernel)  # run_op smooths Q
    assert rel_l1(out, want.half()) <= EMULATION_L1
    out_lse, _ = run_op(q4, k4, v4, True, qk=kernel.qk, pv=kernel.pv, return_lse=True,
                           scale=0.05)
    assert torch.equal(out, out_lse)


# ------------------------------------------------------------------------------------------------
# The Hopper kernel (attention_wgmma) against the emulation of its algorithm
# ------------------------------------------------------------------------------------------------

WGMMA_OP_SHAPES = [
    # b, hq, hkv, nq, nk, d
    (1, 2, 2, 1, 1, 128),  # one query, one key
    (2, 4, 4, 17, 17, 64),
    (1, 8, 2, 127, 127, 128),  # GQA 4:1
    (1, 4, 4, 300, 1000, 128),  # q_len < kv_len
    (1, 8, 1, 1000, 333, 64),  # MQA, q_len > kv_len
    (2, 4, 2, 1000, 1000, 64),  # GQA 2:1
    (1, 2, 2, 4097, 4097, 128),
]
WGMMA_SMOOTHING = [(True, False), (True, True), (False, False)]  # (smooth_k, smooth_v)
# The emulation takes its own float64 K means, the kernel's preprocessing float32 ones, so a few
# K codes sit one step apart: a row that few keys dominate moves its LSE by up to a few 1e-3 (as
# in test_op_matches_emulation); the output by far less.
WGMMA_OP_LSE_ATOL = 5e-3


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("shape", WGMMA_OP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("smoothing", WGMMA_SMOOTHING, ids=["smooth-k", "smooth-kv", "no-smooth"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wgmma_op_matches_emulation(shape: tuple[int, ...], smoothing: tuple[bool, bool],
                                    causal: bool, dtype: torch.dtype) -> None:
    smooth_k, smooth_v = smoothing
    b, hq, hkv, nq, nk, d = shape
    # V's channel offsets (4 * randn) make smooth_v change its FP8 codes, and the output by far
    # more than EMULATION_L1.
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq + nk + d, bias=(1.0, 4.0, 4.0))
    out_nhd = (nq + causal) % 2 == 1
    out, lse = run_wgmma_op(q4, k4, v4, causal, smooth_k=smooth_k, smooth_v=smooth_v,
                            out_nhd=out_nhd)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype
    assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    assert_finite(out, lse)
    want, want_lse = emulate(q4, k4, v4, causal, smooth_k=smooth_k, smooth_v=smooth_v,
                             kernel=WGMMA)
    l1 = rel_l1(out, want.to(dtype))
    assert l1 <= EMULATION_L1, f"rel. L1 vs emulation {l1:.2e}"
    # The kernel's LSE is complete: it adds the row constant of K smoothing itself.
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=WGMMA_OP_LSE_ATOL)
    # Unsmoothed K with offsets of 4 quantizes coarsely (what smoothing is for): a sanity bound.
    assert rel_l1(out, exact(q4, k4, v4, causal)[0]) <= (EXACT_L1_FP8 if smooth_k else 0.2)
    out_only, no_lse = run_wgmma_op(q4, k4, v4, causal, smooth_k=smooth_k, smooth_v=smooth_v,
                                    out_nhd=out_nhd, return_lse=False)
    assert no_lse.shape == (0,)
    assert torch.equal(out, out_only)


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wgmma_v_tiles_of_different_magnitudes(causal: bool, dtype: torch.dtype) -> None:
    """V's per-tile FP8 scales through the kernel's fold (O in the units of the last folded
    tile): tiles 10^4 apart in magnitude, an all-zero tile (the floor scale) and a short last
    tile, against the emulation and against float64 attention."""
    q4, k4, v4 = make_qkv(1, 4, 2, 700, 700, 128, dtype, seed=11, bias=(1.0, 2.0, 1.0))
    v4 = v4.clone()
    v4[:, :, 128:256] *= 1e-2
    v4[:, 0, 256:384] = 0
    v4[:, 1, 384:512] *= 1e2
    v4[:, :, 640:] *= 3e-2
    out, lse = run_wgmma_op(q4, k4, v4, causal)
    assert_finite(out, lse)
    want, want_lse = emulate(q4, k4, v4, causal, kernel=WGMMA)
    assert rel_l1(out, want.to(dtype)) <= EMULATION_L1
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=WGMMA_OP_LSE_ATOL)
    assert rel_l1(out, exact(q4, k4, v4, causal)[0]) <= EXACT_L1_FP8


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("layout", ["NHD", "packed"])
@pytest.mark.parametrize(
    "shape,causal,dtype",
    [((2, 4, 4, 1000, 1000, 128), True, torch.float16),
     ((1, 8, 2, 333, 129, 64), False, torch.bfloat16)],
    ids=["2x4x4x1000x1000x128-causal-fp16", "1x8x2x333x129x64-full-bf16"],
)
def test_wgmma_op_reads_q_views(layout: str, shape: tuple[int, ...], causal: bool,
                                dtype: torch.dtype) -> None:
    """q is read in place through its strides (NHD, a packed [B, N, 3, H, D] slice): the same
    result as from the contiguous tensor, bit for bit."""
    b, hq, hkv, nq, nk, d = shape
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq + 2 * nk, bias=(1.0, 4.0, 1.0))
    view = q_view(q4, layout)
    out, lse = run_wgmma_op(view, k4, v4, causal, out_nhd=layout == "NHD")
    assert_finite(out, lse)
    want, want_lse = emulate(q4, k4, v4, causal, kernel=WGMMA)
    assert rel_l1(out, want.to(dtype)) <= EMULATION_L1
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=WGMMA_OP_LSE_ATOL)
    out_c, lse_c = run_wgmma_op(q4, k4, v4, causal, out_nhd=layout == "NHD")
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1, 128), (2, 4, 2, 300, 1000, 64),
                                   (1, 8, 2, 1000, 4097, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("smoothing", [*WGMMA_SMOOTHING, (False, True)],
                         ids=["smooth-k", "smooth-kv", "no-smooth", "smooth-v"])
@pytest.mark.parametrize("env", [{}, {"SAGEATTN_PDL": "0"}], ids=["default", "no-programmatic-launch"])
def test_sageattn_wgmma_is_its_chain(shape: tuple[int, ...], smoothing: tuple[bool, bool],
                                     env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """sageattn_wgmma (the op sageattn runs on Hopper: statistics over the token sample,
    quantize_kv and the kernel, from one C++ call) gives run_wgmma_op's output and LSE (the ops
    one by one) bit for bit, its intermediates and outputs on poisoned memory, for HND and NHD k
    and v (the sample is a strided view of either), by default (each launch a programmatic
    dependent of the one before) and without that."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    smooth_k, smooth_v = smoothing
    b, hq, hkv, nq, nk, d = shape
    for causal, layout, dtype in ((False, "HND", torch.float16), (True, "NHD", torch.bfloat16)):
        q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq + nk, bias=(1.0, 4.0, 4.0))
        out_nhd = layout == "NHD"
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) if out_nhd else t
                   for t in (q4, k4, v4))
        for return_lse in (True, False):
            want, want_lse = run_wgmma_op(q, k, v, causal, smooth_k=smooth_k, smooth_v=smooth_v,
                                          out_nhd=out_nhd, return_lse=return_lse, scale=0.07)
            poison_allocator()
            out, lse = ops.sageattn_wgmma(q, k, v, smooth_k, smooth_v,
                                          api.smoothing_sample_stride(nk), 0.07, causal, out_nhd,
                                          return_lse)
            assert out.shape == (b, hq, nq, d) and out.dtype == dtype
            assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
            assert_finite(out, lse)
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
            assert lse.shape == ((b, hq, nq) if return_lse else (0,))


@pytest.mark.parametrize("variant", OP_VARIANTS)
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1, 128), (2, 4, 2, 300, 1000, 64),
                                   (1, 4, 1, 1000, 257, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("smoothing", [*SMOOTHING, (False, False)],
                         ids=["smooth-qk", "smooth-k", "smooth-q", "no-smooth"])
@pytest.mark.parametrize("env", [{}, {"SAGEATTN_PDL": "0"}],
                         ids=["default", "no-programmatic-launch"])
def test_sageattn_mma_is_its_chain(variant: str, shape: tuple[int, ...],
                                   smoothing: tuple[bool, bool], env: dict[str, str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """sageattn_mma (the op sageattn runs for the warp-level kernel: the statistics, quantize_kv
    and attention_mma from one C++ call, by default each launch a programmatic dependent of the
    one before) gives its chain's output and LSE (ops.sageattn_mma_chain: the ops one by one)
    bit for bit, on poisoned memory, for HND and NHD views; without any statistics launch too
    (no smoothing, FP16/BF16 PV)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kernel, smooth_v = OP_VARIANTS[variant]
    require_kernel(kernel)
    smooth_q, smooth_k = smoothing
    b, hq, hkv, nq, nk, d = shape
    for causal, layout, dtype in ((False, "HND", torch.float16), (True, "NHD", torch.bfloat16)):
        q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq + nk,
                              bias=(1.0, 4.0, 4.0 if smooth_v else 1.0))
        out_nhd = layout == "NHD"
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) if out_nhd else t
                   for t in (q4, k4, v4))
        for return_lse in (True, False):
            args = (q, k, v, kernel.qk, kernel.pv, smooth_q, smooth_k, smooth_v,
                    api.smoothing_sample_stride(nk), 0.07, causal, out_nhd, return_lse)
            poison_allocator()
            want, want_lse = ops.sageattn_mma_chain(*args)
            poison_allocator()
            out, lse = ops.sageattn_mma(*args)
            assert out.shape == (b, hq, nq, d) and out.dtype == dtype
            assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
            assert_finite(out, lse)
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
            assert lse.shape == ((b, hq, nq) if return_lse else (0,))


@pytest.mark.usefixtures("wgmma_kernel")
def test_wgmma_op_reads_broadcast_and_size_one_views() -> None:
    """The kernel reads q through a tensor map of its strides: a broadcast view (stride 0 over
    batch and heads, which the copy engine cannot step along) and views whose size-1 dimensions
    have strides of another tensor (one query of a longer sequence) give the contiguous
    tensor's result, bit for bit."""
    q4, k4, v4 = make_qkv(2, 4, 4, 300, 300, 128, torch.float16, seed=5, bias=(1.0, 4.0, 1.0))
    broadcast = q4[:1, :1].expand(2, 4, 300, 128)
    assert broadcast.stride(0) == 0 and broadcast.stride(1) == 0
    out, lse = run_wgmma_op(broadcast, k4, v4, False)
    assert_finite(out, lse)
    out_c, lse_c = run_wgmma_op(broadcast.contiguous(), k4, v4, False)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    one_query = q4[:1, :, 7:8]  # [1, 4, 1, 128] with the strides of [2, 4, 300, 128]
    out, lse = run_wgmma_op(one_query, k4[:1], v4[:1], True)
    out_c, lse_c = run_wgmma_op(one_query.contiguous(), k4[:1], v4[:1], True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    want, _ = emulate(one_query.contiguous(), k4[:1], v4[:1], True, kernel=WGMMA)
    assert rel_l1(out, want.half()) <= EMULATION_L1


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("out_nhd", [False, True], ids=["out-hnd", "out-nhd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wgmma_op_without_lse_and_scale(out_nhd: bool, dtype: torch.dtype) -> None:
    q4, k4, v4 = make_qkv(2, 4, 4, 333, 333, 128, dtype, seed=3, bias=(0.0, 2.0, 1.0))
    out, lse = run_wgmma_op(q4, k4, v4, True, return_lse=False, out_nhd=out_nhd, scale=0.05)
    assert lse.shape == (0,)
    assert_finite(out)
    want, want_lse = emulate(q4, k4, v4, True, scale=0.05, kernel=WGMMA)
    assert rel_l1(out, want.to(dtype)) <= EMULATION_L1
    out_lse, lse = run_wgmma_op(q4, k4, v4, True, return_lse=True, out_nhd=out_nhd, scale=0.05)
    assert torch.equal(out, out_lse)
    assert_finite(lse)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=WGMMA_OP_LSE_ATOL)


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_grid_modes_agree(causal: bool) -> None:
    """attention_wgmma's two grids (attention_wgmma.cu): persistent CTAs walking several units
    each (up to 8 units per SM: 512 units here, more than any GPU's SMs) and one CTA per unit
    (beyond: the same inputs repeated 9 times over the batch, 4608 units). Each item's arithmetic
    does not depend on which CTA runs it, so the outputs agree bit for bit; with an odd number of
    Q blocks (a unit holding the middle block alone), GQA and q_len < kv_len."""
    q4, k4, v4 = make_qkv(4, 16, 8, 1900, 2100, 64, torch.float16, seed=11, bias=(1.0, 4.0, 4.0))
    out, lse = run_wgmma_op(q4, k4, v4, causal)
    out_units, lse_units = run_wgmma_op(*(t.repeat(9, 1, 1, 1) for t in (q4, k4, v4)), causal)
    assert_finite(out, lse)
    assert torch.equal(out, out_units[:4]) and torch.equal(lse, lse_units[:4])
    want, want_lse = emulate(q4, k4, v4, causal, kernel=WGMMA)
    assert rel_l1(out, want.to(out.dtype)) <= EMULATION_L1
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=WGMMA_OP_LSE_ATOL)


# ------------------------------------------------------------------------------------------------
# ANCHORS.md accuracy families (numbers for the closing note)
# ------------------------------------------------------------------------------------------------

# 8-bit, family -> (min CosSim, max rel. L1): issue 3's bounds, the official 8-bit sm90 kernel's
# non-causal level (ANCHORS.md). FP16/BF16 PV should be at least as good on every family and mask
# (outliers: the official kernel's 0.9984 / 0.0397). With FP8 PV the bounds hold non-causal; causal,
# the official kernel itself is below the bias4 bound (0.99987), so there the FP8 path must be no
# worse than the official causal figure (OFFICIAL_SM90); the outliers family is printed only (the
# emulated algorithm of the warp-level kernel is at the official kernel's level there).
ANCHOR_BOUNDS = {"bias0": (0.9992, 0.040), "bias4": (0.9999, 0.015), "outliers": (0.998, 0.040)}
ANCHOR_BOUNDS_OF = {
    MMA_INT8_INPUT: ANCHOR_BOUNDS,
    MMA_INT8_FP8: {name: ANCHOR_BOUNDS[name] for name in ("bias0", "bias4")},
}
OFFICIAL_BOUNDS_WHEN_CAUSAL = {MMA_INT8_FP8}
# ANCHORS.md: the official 8-bit sm90 kernel, (family, causal) -> (CosSim, rel. L1). attention_wgmma
# (FP8 PV like the official kernel) must be no worse on the same family and mask (issue 4's
# acceptance point), up to the rounding of the printed figures (half a unit of the last digit).
OFFICIAL_SM90 = {("bias0", False): (0.999265, 0.0383), ("bias0", True): (0.999389, 0.0367),
                 ("bias4", False): (0.99990, 0.0117), ("bias4", True): (0.99987, 0.0132),
                 ("outliers", False): (0.998399, 0.0397), ("outliers", True): (0.99846, 0.0387)}
OFFICIAL_ROUNDING = (5e-6, 5e-5)
# Measured on the H100: with one Q scale per row attention_wgmma is at 0.998436 / 0.03923 on the
# outliers family (official 0.998399 / 0.0397) and 0.998557 / 0.03783 causal (0.99846 / 0.0387);
# with the per-thread Q groups of Eq. 8 it was 0.998345 / 0.0403 and 0.998449 / 0.0389, short of
# the official figures (benchmarks/RESULTS.md, session 17). No known gaps remain.
KNOWN_GAPS: set[tuple[KernelChoice, str]] = set()
ANCHOR_SHAPE = (1, 8, 4096, 128)
ANCHOR_FAMILIES = ("bias0", "bias4", "outliers")
# The 8-bit paths (INT4 has its own test below).
ANCHOR_PATHS = [path for path, options in PATHS.items() if options.get("qk_quant") != "int4"]


def anchor_families() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The ANCHORS.md families, drawn as its protocol says (manual_seed(0), in this order)."""
    torch.manual_seed(0)
    return {name: ref.make_input_family(name, ANCHOR_SHAPE, torch.float16, DEVICE)
            for name in ANCHOR_FAMILIES}


@pytest.mark.parametrize("path", ANCHOR_PATHS)
def test_anchor_families(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    families = anchor_families()
    lines, failures, gaps, kernels = [], [], [], set()
    for name, (q, k, v) in families.items():
        for causal in (False, True):
            kwargs = dict(is_causal=causal, **PATHS[path])
            kernel = sageattn_kernel(q, k, v, **kwargs)
            kernels.add(kernel)
            want, _ = exact(q, k, v, causal)
            poison_allocator()
            out = sageattn_no_fallback(q, k, v, **kwargs)
            assert_finite(out)
            emu, _ = emulate(q, k, v, causal, PATHS[path].get("smooth_q"), kernel=kernel)
            cos, l1 = ref.cosine_similarity(out, want), rel_l1(out, want)
            emu_cos, emu_l1 = ref.cosine_similarity(emu.half(), want), rel_l1(emu.half(), want)
            vs_emu = rel_l1(out, emu.half())
            official = OFFICIAL_SM90[name, causal]
            lines.append(f"{name:<9} causal={causal!s:<5}  kernel CosSim {cos:.6f} rel.L1 {l1:.5f}"
                         f"   emulation {emu_cos:.6f} / {emu_l1:.5f}"
                         f"   kernel vs emulation rel.L1 {vs_emu:.2e}"
                         f"   (official sm90 {official[0]:.6f} / {official[1]:.4f})")
            bounds = ANCHOR_BOUNDS_OF.get(kernel, {}).get(name)
            if kernel == WGMMA or (causal and bounds is not None
                                   and kernel in OFFICIAL_BOUNDS_WHEN_CAUSAL):
                bounds = (official[0] - OFFICIAL_ROUNDING[0], official[1] + OFFICIAL_ROUNDING[1])
            if bounds is not None and not (cos >= bounds[0] and l1 <= bounds[1]):
                short = f"{lines[-1]}: needs CosSim >= {bounds[0]}, rel.L1 <= {bounds[1]}"
                (gaps if (kernel, name) in KNOWN_GAPS else failures).append(short)
            if vs_emu > EMULATION_L1:
                failures.append(f"{lines[-1]}: kernel vs emulation above {EMULATION_L1}")
    ran = ", ".join(f"attention_{c.kernel} {c.qk.upper()} QK + {c.pv} PV" for c in sorted(kernels))
    with capsys.disabled():
        print(f"\nANCHORS families, B1 H8 N4096 D128 fp16, sageattn ({path} call: {ran}) vs "
              f"float64 SDPA:")
        print("\n".join(lines))
    assert not failures, "\n".join(failures)
    if gaps:
        pytest.xfail("known gap (KNOWN_GAPS): " + "; ".join(gaps))


# 4-bit on the bias4 family (channel offsets, which smoothing removes): with Q and K smoothed the
# error must come down to near the 8-bit level (ANCHORS' idealised simulation: 0.9998 / 0.0182),
# and smoothing Q must at least halve it (the simulation: 0.0463 -> 0.0182).
INT4_BIAS4_BOUNDS = (0.9995, 0.03)
INT4_Q_SMOOTHING_GAIN = 2.0


@pytest.mark.usefixtures("mma_fp8_kernel")
def test_anchor_families_int4(capsys: pytest.CaptureFixture[str]) -> None:
    """sageattn(qk_quant="int4") on the ANCHORS families, with and without Q smoothing (K always
    smoothed); and, emulation only, whether finer query groups than the kernel's would help on
    the outlier family (which smoothing cannot fix: its large channels vary per token)."""
    families = anchor_families()
    lines, failures, results = [], [], {}
    for name, (q, k, v) in families.items():
        want, _ = exact(q, k, v, False)
        for smooth_q in (True, False):
            kwargs = dict(qk_quant="int4", smooth_q=smooth_q)
            kernel = sageattn_kernel(q, k, v, **kwargs)
            assert kernel == MMA_INT4_FP8
            poison_allocator()
            out = sageattn_no_fallback(q, k, v, **kwargs)
            assert_finite(out)
            emu, _ = emulate(q, k, v, False, smooth_q=smooth_q, kernel=kernel)
            cos, l1 = ref.cosine_similarity(out, want), rel_l1(out, want)
            results[name, smooth_q] = (cos, l1)
            emu_cos, emu_l1 = ref.cosine_similarity(emu.half(), want), rel_l1(emu.half(), want)
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
        emu = ref.sage_attention_reference(
            q, k, v, qk_dtype="int4", block_q=ops.MMA_BLOCK_Q, block_k=ops.MMA_BLOCK_K,
            smooth_k=True, smooth_q="head", smooth_v=False, pv_dtype="e4m3", two_level=True,
            fp22=False, **geometry)
        finer.append(f"  {label:<45} CosSim {ref.cosine_similarity(emu.half(), want):.6f} "
                     f"rel.L1 {rel_l1(emu.half(), want):.5f}")
    with capsys.disabled():
        print("\nANCHORS families, B1 H8 N4096 D128 fp16, sageattn(qk_quant='int4') "
              "(attention_mma INT4 QK + FP8 PV, K smoothed) vs float64 SDPA:")
        print("\n".join(lines))
        print("INT4 query-group geometry on the outliers family, emulation only (Q and K "
              "smoothed, FP8 PV):")
        print("\n".join(finer))
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------------
# sageattn over shapes, layouts, dtypes
# ------------------------------------------------------------------------------------------------


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
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq * 7 + nk)
    args, tensor_layout, views = in_layout(q4, k4, v4, layout)
    three_d = layout.startswith("3d-")
    kwargs = dict(is_causal=causal, enable_gqa=hq != hkv, tensor_layout=tensor_layout,
                  strict=True, **PATHS[path])
    kernel = sageattn_kernel(*args, **kwargs)
    poison_allocator()
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nq,nk", [(700, 200), (200, 700), (1, 300), (300, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_causal_unequal_lengths(nq: int, nk: int, dtype: torch.dtype, path: str) -> None:
    """SDPA's causal mask is top-left aligned: query i sees keys j <= i, also when q_len !=
    kv_len (queries past kv_len see every key)."""
    q4, k4, v4 = make_qkv(1, 4, 4, nq, nk, 128, dtype, seed=nq + 3 * nk, bias=(1.0, 3.0, 0.0))
    kernel = sageattn_kernel(q4, k4, v4, is_causal=True, **PATHS[path])
    poison_allocator()
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
        poison_allocator()
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


# ------------------------------------------------------------------------------------------------
# return_lse
# ------------------------------------------------------------------------------------------------


# LSE vs exact, kernel -> (max |error| of queries that see >= 64 keys, max |error|). A query that
# sees few keys carries one score's quantization error (~0.02); with 64 or more keys the errors
# average out. attention_mma INT8 (either PV: the LSE comes from the scores alone): 8-bit scores
# carry ~1e-2 of noise; on these biased inputs the attention is peaked enough that the LSE keeps
# up to ~1.5e-2 of it (measured on the H100: max 0.0134). attention_wgmma does not smooth Q, whose
# offsets widen the Q groups' range: the emulation gives up to 0.038 (>= 64 keys) and 0.050 (all)
# over 58 draws of these shapes. INT4 has no fixed entry: its emulation's error plus
# LSE_EMULATION_ATOL (the kernel is within that of its emulation).
LSE_EXACT_BOUNDS = {MMA_INT8_INPUT: (2e-2, 0.05), MMA_INT8_FP8: (2e-2, 0.05), WGMMA: (0.06, 0.1)}


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
    poison_allocator()
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
# Determinism, fallbacks, plan, op contract
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_repeated_runs_bit_identical(path: str) -> None:
    n = INT4_MAX_LEN + 1 if is_int4_path(path) else 4097
    q4, k4, v4 = make_qkv(1, 8, 2, n, n, 128, torch.bfloat16, seed=5, bias=(1.0, 4.0, 1.0))
    args, _, _ = in_layout(q4, k4, v4, "NHD")
    kwargs = dict(is_causal=True, enable_gqa=True, tensor_layout="NHD", return_lse=True,
                  **PATHS[path])
    sageattn_kernel(*args, **kwargs)  # skips a path this GPU cannot run
    poison_allocator()
    first = sageattn_no_fallback(*args, **kwargs)
    assert_finite(*first)
    for _ in range(3):
        poison_allocator()
        again = sageattn_no_fallback(*args, **kwargs)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("d", [64, 128, 96])
def test_sageattn_runs_the_kernel_it_names(monkeypatch: pytest.MonkeyPatch, d: int) -> None:
    """sageattn runs the op and variant sageattn_kernel names (which the emulations above rely
    on), and that is what the build and GPU imply: on sm_90 with the wgmma build,
    attention_wgmma for INT8 without Q smoothing unless pv_quant="none"; else attention_mma
    with FP8 PV when asked for, for INT4, or ("auto") where the build has FP8 code for this GPU;
    PV in the input dtype otherwise."""
    ran: list[tuple[str, str, bool]] = []

    def recording_mma(*args: Any, _real: Any = ops.sageattn_mma) -> Any:
        ran.append(("mma", args[3], args[4] == "fp8"))
        return _real(*args)

    def recording_wgmma(*args: Any, _real: Any = ops.sageattn_wgmma) -> Any:
        ran.append(("wgmma", "int8", True))
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
                poison_allocator()
                out = sageattn_no_fallback(q, k, v, **options)
                assert_finite(out)
                assert ran == [(named.kernel, named.qk, named.pv == "fp8")], (options, ran, named)
                smoothed = smooth_q in (True, "head")
                if wgmma_on_device() and qk == "int8" and pv != "none" and not smoothed:
                    expected = WGMMA
                else:
                    # "auto" takes FP8 where FP8 mma.sync is native: Ada, consumer Blackwell.
                    capability = torch.cuda.get_device_capability()
                    native = capability == (8, 9) or capability[0] == 12
                    fp8 = needs_fp8 or (pv == "auto" and fp8_here and native)
                    expected = KernelChoice("mma", qk, "fp8" if fp8 else "input")
                assert named == expected, options


@pytest.mark.parametrize("path", ["default", "mma-fp16"])
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
        pytest.param({}, (1, 2, 200, 256), "built for head_dim 64 and 128", id="head-dim-256"),
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
    if wgmma_on_device():
        assert plan.startswith(f"quantized SageAttention2: {api.WGMMA_PLAN}"), plan
        assert api.MMA_PLAN in plan, plan  # smooth_q="head"/True still runs the warp-level kernel
    else:
        assert plan.startswith(f"quantized SageAttention2: {api.MMA_PLAN}"), plan
    if mma_fp8_on_device():
        assert "INT8 QK + FP8 PV" in plan and "INT4 QK + FP8 PV" in plan, plan
    else:
        assert "INT8 QK + FP16/BF16 PV" in plan and "INT4 QK + FP8 PV" not in plan, plan


def mma_op_args(kernel: KernelChoice, smooth_v: bool, q_len: int, smooth_q: bool,
                causal: bool, out_nhd: bool, return_lse: bool) -> tuple[Any, ...]:
    """attention_mma's arguments for ``kernel``'s variant, from the real preprocessing ops
    (GQA 2:1, 130 keys: two key tiles, the second mostly padding; q as a strided NHD view; Q
    smoothed when ``smooth_q``, K always, so the LSE takes K's row constant)."""
    q4, k4, v4 = make_qkv(1, 4, 2, q_len, 130, 64, torch.float16, seed=1, bias=(1.0, 2.0, 2.0))
    sm_scale = 0.125
    fp8 = kernel.pv == "fp8"
    stats = ops.smoothing_stats(q4, k4, v4 if fp8 else None, fp8 and smooth_v)
    v_mean = stats.v_mean if fp8 and smooth_v else None
    v_scale = stats.v_scale if fp8 else None
    q_mean = stats.q_mean if smooth_q else None
    kv = ops.quantize_kv(k4, v4 if fp8 else None, stats.k_mean, v_mean, v_scale, q_mean,
                         ops.MMA_BLOCK_K, kernel.qk, sm_scale * LOG2E)
    return (q_view(q4, "NHD"), q_mean, kv.k_quant, kv.k_scale, kv.delta_s if smooth_q else None,
            kv.v_fp8 if fp8 else v4, v_scale, v_mean, stats.k_mean, kernel.qk, 130, sm_scale,
            causal, out_nhd, return_lse)


def test_opcheck_attention_mma() -> None:
    for args in (mma_op_args(MMA_INT8_INPUT, False, 200, True, True, False, True),
                 mma_op_args(MMA_INT8_INPUT, False, 200, False, False, True, False)):
        torch.library.opcheck(torch.ops.sageattention2.attention_mma.default, args)


@pytest.mark.usefixtures("mma_fp8_kernel")
@pytest.mark.parametrize("kernel", [MMA_INT8_FP8, MMA_INT4_FP8], ids=["int8", "int4"])
def test_opcheck_attention_mma_fp8(kernel: KernelChoice) -> None:
    for args in (mma_op_args(kernel, True, 200, True, True, False, True),
                 mma_op_args(kernel, False, 77, False, False, True, False)):
        # test_schema is left out: it probes for input mutation by multiplying every input,
        # which torch does not implement for float8_e4m3fn (v) on CUDA.
        torch.library.opcheck(torch.ops.sageattention2.attention_mma.default, args,
                              test_utils=("test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))


@pytest.mark.usefixtures("wgmma_kernel")
def test_opcheck_attention_wgmma() -> None:
    q4, k4, v4 = make_qkv(1, 4, 2, 200, 130, 64, torch.float16, seed=1, bias=(1.0, 2.0, 2.0))
    smooth = ops.smoothing_stats(None, k4, v4, True)
    kv = ops.quantize_kv(k4, v4, smooth.k_mean, smooth.v_mean, None, None, ops.WGMMA_BLOCK_K,
                         "int8", 1.0)
    kv_plain = ops.quantize_kv(k4, v4, None, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    for args in ((q4, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, smooth.v_mean,
                  smooth.k_mean, 130, 0.125, True, False, True),
                 (q_view(q4, "NHD"), kv_plain.k_quant, kv_plain.k_scale, kv_plain.v_fp8,
                  kv_plain.v_tile_scale, None, None, 130, 0.125, False, True, False)):
        # test_schema is left out: it probes for input mutation by multiplying every input,
        # which torch does not implement for float8_e4m3fn (v_fp8) on CUDA.
        torch.library.opcheck(torch.ops.sageattention2.attention_wgmma.default, args,
                              test_utils=("test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))
    # The composite takes only fp16/bf16 inputs: every opcheck test applies.
    k_nhd = q_view(k4, "NHD")
    for args in ((q4, k4, v4, True, True, 3, 0.125, True, False, True),
                 (q_view(q4, "NHD"), k_nhd, q_view(v4, "NHD"), True, False, 1, 0.125, False, True,
                  False)):
        torch.library.opcheck(torch.ops.sageattention2.sageattn_wgmma.default, args)
