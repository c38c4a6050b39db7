"""GPU tests of the Hopper attention op, ``attention_wgmma`` (sm_90a builds on sm_90 GPUs),
against the emulation of its algorithm, and of ``sageattn_wgmma``, the one-op path sageattn runs
for it (helpers, bounds and references: gpu_helpers.py)."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import (EMULATION_L1, EXACT_L1, EXACT_L1_FP8, WGMMA, WGMMA_INPUT, assert_finite,
                         emulate, exact, make_qkv, q_view, rel_l1, run_wgmma_op)
from sageattention2 import api, ops, sageattn
from sageattention2.testing import poison_cuda_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("attention_kernel")]

if not ops.HAS_EXTENSION:
    pytest.skip(f"compiled extension not available: {ops.EXTENSION_ERROR}", allow_module_level=True)
if not ops.has_op("attention_mma"):
    pytest.skip("this build has no attention_mma op", allow_module_level=True)


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
# head_dim 256: the FP8 tier only (its Q and K rows in two 128-byte spans, PV in two halves, a
# 2-stage ring and Q read without staging: csrc/hopper/geometry.cuh).
WGMMA_HD256_SHAPES = [
    (1, 2, 2, 1, 1, 256),
    (2, 4, 2, 129, 300, 256),  # GQA 2:1, q_len < kv_len
    (1, 4, 1, 1000, 333, 256),  # MQA, q_len > kv_len
    (1, 2, 2, 4097, 4097, 256),
]
WGMMA_SMOOTHING = [(True, False), (True, True), (False, False)]  # (smooth_k, smooth_v)
# The emulation takes its own float64 K means, the kernel's preprocessing float32 ones, so a few
# K codes sit one step apart: a row that few keys dominate moves its LSE by up to a few 1e-3 (as
# in test_op_matches_emulation); the output by far less.
WGMMA_OP_LSE_ATOL = 5e-3


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("shape", WGMMA_OP_SHAPES + WGMMA_HD256_SHAPES, ids=lambda s: "x".join(map(str, s)))
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
            poison_cuda_allocator()
            out, lse = ops.sageattn_wgmma(q, k, v, "fp8", smooth_k, smooth_v,
                                          api.smoothing_sample_stride(nk), 0.07, causal, out_nhd,
                                          return_lse)
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
    """attention_wgmma's two grids (csrc/hopper/launch.cu): persistent CTAs walking several units
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


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("shape", WGMMA_OP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("smooth_k", [True, False], ids=["smooth-k", "no-smooth"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_accurate_tier_matches_emulation(shape: tuple[int, ...], smooth_k: bool, causal: bool,
                                         dtype: torch.dtype) -> None:
    """The accurate tier (issue 36: P and the caller's V in 16 bits on the same kernel, O the
    FP32 accumulator, l summed from P): against its emulation and float64 attention, on poisoned
    memory, V read in place (HND, or an NHD view for half the cases); and closer to float64
    than the FP8 tier on the same inputs."""
    b, hq, hkv, nq, nk, d = shape
    q4, k4, v4 = make_qkv(b, hq, hkv, nq, nk, d, dtype, seed=nq + nk + d + 1, bias=(1.0, 4.0, 4.0))
    out_nhd = (nq + causal) % 2 == 1
    # (an NHD view of one KV head or one key is the contiguous tensor itself)
    v_view = q_view(v4, "NHD") if (nk + causal) % 2 == 0 and hkv > 1 and nk > 1 else None
    out, lse = run_wgmma_op(q4, k4, v4, causal, smooth_k=smooth_k, out_nhd=out_nhd, pv="input",
                            v_view=v_view)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype
    assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
    assert_finite(out, lse)
    want, want_lse = emulate(q4, k4, v4, causal, smooth_k=smooth_k, kernel=WGMMA_INPUT)
    l1 = rel_l1(out, want.to(dtype))
    assert l1 <= EMULATION_L1, f"rel. L1 vs emulation {l1:.2e}"
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=WGMMA_OP_LSE_ATOL)
    truth = exact(q4, k4, v4, causal)[0]
    accurate = rel_l1(out, truth)
    assert accurate <= (EXACT_L1 if smooth_k else 0.2)
    if smooth_k and nk > 1:
        fp8_out, _ = run_wgmma_op(q4, k4, v4, causal, smooth_k=smooth_k)
        assert accurate < rel_l1(fp8_out, truth)


@pytest.mark.usefixtures("wgmma_kernel")
def test_accurate_tier_refuses_head_dim_256() -> None:
    """The accurate tier stops at head_dim 128 (a 16-bit V stage of 64 KB and O's 128 registers
    leave no room): a clear error from the op, before any launch."""
    q4, k4, v4 = make_qkv(1, 2, 2, 200, 200, 256, torch.float16, seed=3)
    kv = ops.quantize_kv(k4, None, None, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    with pytest.raises(RuntimeError, match="head_dim 256 runs attention_wgmma with FP8 V only"):
        ops.attention_wgmma(q4, kv.k_quant, kv.k_scale, v4, None, None, None, 200, 0.0625, False,
                            False, True)


@pytest.mark.usefixtures("wgmma_kernel")
def test_accurate_tier_reads_v_views() -> None:
    """The accurate tier reads the caller's V through a 4-D tensor map of its strides: a packed
    [B, N, 3, H, D] slice, a broadcast view (stride 0 over batch and heads: read from a copy)
    and a size-1 batch with another tensor's strides give the contiguous V's output bit for
    bit."""
    q4, k4, v4 = make_qkv(2, 4, 2, 300, 517, 128, torch.bfloat16, seed=9, bias=(1.0, 2.0, 2.0))
    want, want_lse = run_wgmma_op(q4, k4, v4, False, pv="input")
    for view in (q_view(v4, "packed"), q_view(v4, "NHD")):
        assert torch.equal(view, v4)
        out, lse = run_wgmma_op(q4, k4, v4, False, pv="input", v_view=view)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    broadcast = v4[:1, :1].expand(2, 2, 517, 128)
    assert broadcast.stride(0) == 0 and broadcast.stride(1) == 0
    out, lse = run_wgmma_op(q4, k4, broadcast, False, pv="input")
    out_c, lse_c = run_wgmma_op(q4, k4, broadcast.contiguous(), False, pv="input")
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    one = q_view(v4, "NHD")[1:]  # [1, 2, 517, 128] with the strides of the [2, ...] view
    out, lse = run_wgmma_op(q4[1:], k4[1:], v4[1:], True, pv="input", v_view=one)
    out_c, lse_c = run_wgmma_op(q4[1:], k4[1:], v4[1:], True, pv="input")
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


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
    for args in ((q4, k4, v4, "fp8", True, True, 3, 0.125, True, False, True),
                 (q_view(q4, "NHD"), k_nhd, q_view(v4, "NHD"), "fp8", True, False, 1, 0.125, False,
                  True, False),
                 (q4, k_nhd, q_view(v4, "NHD"), "input", True, False, 3, 0.125, True, False, True)):
        torch.library.opcheck(torch.ops.sageattention2.sageattn_wgmma.default, args)


@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("pv", ["fp8", "input", "fp8-hd64", "fp8-hd256"])
def test_items_of_one_or_two_tiles_do_not_hang(pv: str) -> None:
    """Causal 4096 queries on 256 keys, 64 heads: a persistent grid whose CTAs walk ~15 items of
    one or two tiles each. Warpgroup 0 then starts items ahead of warpgroup 1 (up to the ring's
    depth: 2 to 6 tiles, so each head_dim's ring is here); with one barrier for the item-start
    handshake its arrivals over-counted and one call in a few hung (D35), hence a barrier per ring
    slot (hopper/mainloop.cuh, item_start_barrier). 40 calls here (a hang stops the run at
    device_check's step limit). Every call gives the first one's output, bit for bit (a race
    that corrupts one call of the 40, not the last, is caught too)."""
    d = int(pv.split("-hd")[1]) if "-hd" in pv else 128
    q4, k4, v4 = make_qkv(1, 64, 64, 4096, 256, d, torch.float16, seed=29, bias=(1.0, 2.0, 1.0))
    options = dict(is_causal=True, qk_quant="int8", pv_quant="none" if pv == "input" else "fp8",
                   strict=True)
    first = sageattn(q4, k4, v4, **options)
    assert_finite(first)
    outs = [sageattn(q4, k4, v4, **options) for _ in range(40)]  # (queued back to back)
    torch.cuda.synchronize()
    differ = [i for i, out in enumerate(outs, 1) if not torch.equal(out, first)]
    assert not differ, f"calls {differ} of 40 differ from the first"
