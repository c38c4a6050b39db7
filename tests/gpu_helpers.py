"""Helpers and bounds of the GPU tests of the attention kernels (docs/DESIGN.md#attention-mma,
#attention-wgmma):
test_attention_mma_gpu.py (the warp-level ``attention_mma`` in its three variants: INT8 QK +
fp16/bf16 PV on every arch; INT8 QK + FP8 PV and INT4 QK + FP8 PV on sm_89+ builds),
test_attention_wgmma_gpu.py (the Hopper ``attention_wgmma``, sm_90a builds on sm_90 GPUs) and
test_sageattn_gpu.py (``sageattn``'s quantized path on all of them). ``sageattn`` picks the kernel
and precisions with ``_plan.route`` (a :class:`_plan.KernelChoice`); the sageattn tests run the
PATHS below (on an H100: "default" attention_wgmma, "accurate" its INT8 + FP16/BF16 PV tier,
"mma" INT8 + FP8 PV, "mma-fp16" INT8 + FP16/BF16 PV, "int4" INT4 + FP8 PV) and compare each with the emulation of the variant it ran.

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
  slabs (block_q=128, warps=8), K of quantize_kv(block_k=ops.WGMMA_BLOCK_K), FP8 PV as above
  with one V scale per tile, or (the accurate tier) P and V in the input dtype, O the FP32
  accumulator, l the sum of the unrounded P;
- exact float64 attention (``reference.exact_attention``): the 8-bit error level (randn inputs
  give rel. L1 ~0.01 with FP16 PV, bound 0.03; ~0.038 with FP8 PV, bound 0.05), INT4's level
  derived from its emulation (it depends on the input far more than 8-bit's), and the accuracy
  families of docs/PROTOCOL.md#input-families (attention_wgmma: no worse than the official 8-bit
  sm90 kernel, docs/PROTOCOL.md#official-accuracy);
- exact LSE (natural log).

A head_dim the kernels are not built for (32, 96, ...) runs zero-padded to the next built one
(64, 128); the emulation runs on the unpadded inputs (zero channels change nothing).

Every op allocates its outputs, so calls are preceded by freeing blocks of 0xFF bytes (NaN in
fp16/bf16/fp32) to the caching allocator (``testing.poison_cuda_allocator``): an element the
kernel forgot to write is NaN.

The input families' figures are printed (shown without ``-s``).
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from sageattention2 import SageAttentionFallbackWarning, _execute, _plan, api, ops, sageattn
from sageattention2 import reference as ref
from sageattention2._plan import KernelChoice
from sageattention2.testing import poison_cuda_allocator, relative_l1

DEVICE = "cuda"
LOG2E = math.log2(math.e)
WGMMA = KernelChoice("wgmma", "int8", "fp8")
WGMMA_INPUT = KernelChoice("wgmma", "int8", "input")  # the accurate tier
MMA_INT8_INPUT = KernelChoice("mma", "int8", "input")
MMA_INT8_FP8 = KernelChoice("mma", "int8", "fp8")
MMA_INT4_FP8 = KernelChoice("mma", "int4", "fp8")
EMULATION_L1 = 1e-3  # kernel vs emulation of the same algorithm
EXACT_L1 = 0.03  # FP16/BF16 PV vs float64 attention on randn inputs (~0.01)
# FP8 PV vs float64 attention on randn inputs: nearly uniform attention, whose small outputs
# carry P's and V's E4M3 rounding (the emulation gives up to 0.038 on the shapes below; the
# official 8-bit sm90 kernel 0.0383 on bias0, docs/PROTOCOL.md#official-accuracy).
EXACT_L1_FP8 = 0.05
# 8-bit variants vs float64 attention on randn inputs. INT4 has no fixed entry: see
# exact_l1_bound.
EXACT_L1_OF = {MMA_INT8_INPUT: EXACT_L1, MMA_INT8_FP8: EXACT_L1_FP8, WGMMA: EXACT_L1_FP8,
               WGMMA_INPUT: EXACT_L1}
# LSE, kernel vs emulation (atol), by QK format. The emulation takes its own float64 means, the
# kernel's preprocessing float32 ones, so a few codes at a rounding boundary sit one step apart;
# a row that few keys dominate moves its LSE by about one code step's score change. An INT4 step
# is 127/7 ~ 18x an INT8 one, hence 18x the INT8 tolerance (rounded up).
LSE_EMULATION_ATOL = {"int8": 1e-3, "int4": 0.02}
# attention_wgmma's l is summed by the FP8 PV wgmma (a column of ones), whose accumulator keeps
# fewer bits than the emulation's float32 per 32-key step (paper 3.4's FP22, truncating): the
# output, O / l of one accumulator, cancels that; the LSE, log l, shows it (1.3e-3 measured on
# the H100, in the notebook entry of docs/DECISIONS.md#d7).
WGMMA_LSE_EMULATION_ATOL = 3e-3
# The same for the op tests, whose inputs have larger K offsets (4 instead of 2).
OP_LSE_ATOL = {"int8": 5e-3, "int4": 0.1}
# The sageattn paths of the sageattn tests, one per variant on an H100 with the default build:
# "default" passes no option (attention_wgmma on sm_90 with the wgmma build, else attention_mma
# with FP8 PV on sm_89, FP16/BF16 PV elsewhere); "accurate" asks for PV in the input dtype
# (attention_wgmma's accurate tier on sm_90, else attention_mma INT8 + FP16/BF16 PV, Q not
# smoothed: the default of an sm_80 GPU); "mma" smooths Q per head, which the Hopper kernel
# does not, and asks for FP8 PV (attention_mma INT8 + FP8, emulated FP8 mma.sync on sm_90);
# "mma-fp16" smooths Q and asks for PV in the input dtype (attention_mma INT8 + FP16/BF16 PV
# everywhere); "int4" INT4 QK with FP8 PV (sm_89+, Q smoothed by default).
PATHS: dict[str, dict[str, Any]] = {
    "default": {},
    "accurate": {"pv_quant": "none"},
    "mma": {"smooth_q": "head", "pv_quant": "fp8"},
    "mma-fp16": {"smooth_q": "head", "pv_quant": "none"},
    "int4": {"qk_quant": "int4"},
}
# INT4 mma.sync has no native instruction on Hopper (emulated at ~50 TOPS,
# docs/PROTOCOL.md#tensor-core-rates) and its exact bound needs the emulation of every case: the
# int4 path keeps to shapes up to this length.
INT4_MAX_LEN = 2000


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


def make_qkv(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype,
             seed: int, bias: tuple[float, float, float] = (0.0, 0.0, 0.0),
             outlier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HND-contiguous q, k, v: randn plus an optional channel offset per tensor (bias * randn
    [B, H, 1, D], like real activations and the bias4 family of
    docs/PROTOCOL.md#input-families), and channel OUTLIER_CHANNEL of q and k times ``outlier``
    (a channel far larger than the others, as the outliers family has six)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def draw(h: int, n: int, s: float, scale: float) -> torch.Tensor:
        x = torch.randn(b, h, n, d, device=DEVICE, generator=g)
        if s:
            x += s * torch.randn(b, h, 1, d, device=DEVICE, generator=g)
        if scale != 1.0:
            x[..., OUTLIER_CHANNEL] *= scale
        return x.to(dtype)

    return (draw(hq, nq, bias[0], outlier), draw(hkv, nk, bias[1], outlier),
            draw(hkv, nk, bias[2], 1.0))


OUTLIER_CHANNEL = 5


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
    groups of ops.WGMMA_BLOCK_K, FP8 PV with one V scale per tile (and V's mean when ``smooth_v``),
    or (``kernel.pv`` "input", the accurate tier) P and V in the input dtype.
    """
    common = dict(is_causal=causal, scale=scale, qk_dtype=kernel.qk, granularity="thread",
                  smooth_k=smooth_k, fp22=False, return_lse=True)
    if kernel.kernel == "wgmma":
        if smooth_q in (True, "head"):
            raise ValueError("attention_wgmma does not smooth Q")
        return ref.hopper_kernel_reference(
            q4, k4, v4, block_k=ops.WGMMA_BLOCK_K, mean_stride=api.smoothing_sample_stride(k4.shape[2]),
            is_causal=causal, scale=scale, smooth_k=smooth_k, smooth_v=smooth_v, pv=kernel.pv,
            return_lse=True)
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
        integer_max=not smoothed and _plan.kernel_head_dim(q4.shape[-1]) == 64,  # kFoldedExponent
        mean_stride=api.smoothing_sample_stride(k4.shape[2]), **mma, **common,
    )


def exact_l1_bound(kernel: KernelChoice, emu_out: torch.Tensor | None, want: torch.Tensor,
                   dtype: torch.dtype) -> float:
    """The largest rel. L1 vs exact attention (``want``) the kernel may have. 8-bit: the fixed
    level of EXACT_L1_OF. INT4: its error depends on the input far more (~0.2 on randn, ~0.02
    with channel offsets and smoothing: docs/PROTOCOL.md#idealised-simulation), so the bound is
    what its emulation ``emu_out`` gives, with 10 % slack, plus twice EMULATION_L1 (by the triangle
    inequality the kernel, within EMULATION_L1 of the emulation, can be at most that much further
    away)."""
    if kernel.qk == "int8":
        return EXACT_L1_OF[kernel]
    assert emu_out is not None, "INT4's exact bound needs the emulation"
    return 1.1 * rel_l1(emu_out.to(dtype), want) + 2 * EMULATION_L1


def sageattn_kernel(*args: Any, **kwargs: Any) -> KernelChoice:
    """The kernel and precisions that sageattn runs on this device for these arguments: the
    choice of ``_plan.route`` on the validated call (which must not fall back; a call that
    needs FP8 PV on a GPU or build without it skips the test)."""
    choice, reason = _plan.route(api.validated_call(*args, **kwargs))
    if reason is not None and reason.startswith("FP8 PV needs") and not mma_fp8_on_device():
        pytest.skip(reason)
    assert reason is None, reason
    return choice


def assert_first_query_sees_first_key(out4: torch.Tensor, v4: torch.Tensor,
                                      kernel: KernelChoice, smooth_v: bool = False) -> None:
    """Causal query 0 attends key 0 alone: its output is v[0], to an ulp of the output dtype
    (PV in the input dtype), or to the E4M3 rounding of what PV codes (FP8 PV: at most 2^-4 of
    it in E4M3's normal range, half a subnormal step, 2^-10 * scale, below it; the scale is
    max_n |v_c| / 448 per channel (attention_mma), or attention_wgmma's per-tile one, at most
    2 * max |v| / 448 over the first 128 keys; P~ of the lone key is 448, exact in E4M3). What
    PV codes is v, or with smooth_v v minus its mean over the keys' sample (added back in FP32)."""
    v = v4.repeat_interleave(out4.shape[1] // v4.shape[1], dim=1)
    v0, got = v[:, :, 0], out4[:, :, 0]
    eps = torch.finfo(out4.dtype).eps
    if kernel.pv == "input":
        torch.testing.assert_close(got, v0, rtol=eps, atol=1e-6)
        return
    # (smooth_v's mean is over the smoothing sample, every stride-th key: _execute)
    stride = _execute.smoothing_sample_stride(v.shape[2])
    coded = v.double() - v.double()[:, :, ::stride].mean(dim=2, keepdim=True) if smooth_v else v.double()
    if kernel.kernel == "wgmma":
        scale = 2 * coded[:, :, :ops.WGMMA_BLOCK_K].abs().amax(dim=(2, 3))[..., None] / 448
    else:
        scale = coded.abs().amax(dim=2) / 448
    tol = 2 ** -4 * coded[:, :, 0].abs() + 2 * eps * v0.double().abs() + 2 ** -10 * scale + 1e-6
    err = (got.double() - v0.double()).abs()
    worst = int((err / tol).argmax())
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    assert (err <= tol).all(), (
        f"query 0 differs from v[0] by up to {(err / tol).max():.2f} x tol at {at}: got {got[at].item()}, "
        f"v0 {v0[at].item()}, coded {coded[:, :, 0][at].item()}, tol {tol[at].item()}")


def run_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, *,
           qk: str = "int8", pv: str = "input", smooth_q: bool = True, smooth_k: bool = True,
           smooth_v: bool = False, out_nhd: bool = False, return_lse: bool = True,
           scale: float | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """sageattn's preprocessing for the warp-level kernel (_execute._mma) written out, then
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
    poison_cuda_allocator()
    return ops.attention_mma(q4, q_mean, kv.k_quant, kv.k_scale, kv.delta_s if smooth_q else None,
                             kv.v_fp8 if fp8 else v4, v_scale, v_mean, k_mean, qk, k4.shape[2],
                             sm_scale, causal, out_nhd, return_lse)


def run_wgmma_op(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool, *,
                 smooth_k: bool = True, smooth_v: bool = False, out_nhd: bool = False,
                 return_lse: bool = True, scale: float | None = None, pv: str = "fp8",
                 v_view: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sageattn's preprocessing for the Hopper kernel (_execute._wgmma) written out: one
    smoothing_stats pass (K's mean and, with smooth_v, V's mean), one quantize_kv pass (INT8 K,
    FP8 V with one scale per tile); then attention_wgmma on poisoned memory, with ``q4`` as given
    (it reads any view with a contiguous last dimension in place). ``pv`` "input": the accurate
    tier, K only quantized, V (``v_view`` if given: the same values in another layout) as it is. The means are over the
    token sample sageattn takes (api.smoothing_sample_stride). Returns (out, lse)."""
    sm_scale = q4.shape[-1] ** -0.5 if scale is None else scale
    sample = slice(None, None, api.smoothing_sample_stride(k4.shape[2]))
    stats = ops.smoothing_stats(None, k4[:, :, sample], v4[:, :, sample], smooth_v)
    k_mean = stats.k_mean if smooth_k else None
    v_mean = stats.v_mean if smooth_v else None
    fp8 = pv == "fp8"
    kv = ops.quantize_kv(k4, v4 if fp8 else None, k_mean, v_mean if fp8 else None, None, None,
                         ops.WGMMA_BLOCK_K, "int8", 1.0)
    poison_cuda_allocator()
    if not fp8:
        return ops.attention_wgmma(q4, kv.k_quant, kv.k_scale, v4 if v_view is None else v_view,
                                   None, None, k_mean, k4.shape[2], sm_scale, causal, out_nhd,
                                   return_lse)
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
    return relative_l1(out, want)


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


def require_kernel(kernel: KernelChoice) -> None:
    """Skip unless this GPU and build run ``kernel``'s variant of attention_mma (FP8 PV: sm_89+
    with the attention_mma_fp8 family)."""
    if kernel.pv == "fp8" and not mma_fp8_on_device():
        capability = torch.cuda.get_device_capability()
        pytest.skip(f"no {ops.MMA_FP8_FAMILY} code for sm_{capability[0]}{capability[1]} in "
                    "this build")


# docs/PROTOCOL.md#official-accuracy: the official 8-bit sm90 kernel, (family, causal) ->
# (CosSim, rel. L1). attention_wgmma (FP8 PV like the official kernel) must be no worse on the same
# family and mask (issue 4's acceptance point), up to the rounding of the printed figures (half a
# unit of the last digit).
OFFICIAL_SM90 = {("bias0", False): (0.999265, 0.0383), ("bias0", True): (0.999389, 0.0367),
                 ("bias4", False): (0.99990, 0.0117), ("bias4", True): (0.99987, 0.0132),
                 ("outliers", False): (0.998399, 0.0397), ("outliers", True): (0.99846, 0.0387)}
OFFICIAL_ROUNDING = (5e-6, 5e-5)
