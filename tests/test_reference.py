"""CPU tests of the pure-PyTorch reference (sageattention2/reference.py).

They pin the reference to the paper (SageAttention2, ICML 2025) and to docs/DESIGN.md: group
geometry (#quantization-groups), bit-level quantizer arithmetic (#quantizer-arithmetic, checked
against an independent scalar float32 emulation), layouts (#v-layout), smoothing algebra, the FP22
rule, the tiled forward against float64 SDPA, and the kernels' variants of the simulation (per-tile
V, the row sum of the PV mma, the lazy running max). The paper's ablations are in test_ablation.py.
"""
from __future__ import annotations

import math
import struct

import pytest
import torch
import torch.nn.functional as F

from helpers import gen, input_family, simulated_l1, smoothed_input
from sageattention2 import reference as ref
from sageattention2.testing import relative_l1


def _f32(x: float) -> float:
    """Round a Python float (double) to the nearest float32. For +,-,*,/ of float32 operands the
    double result rounded once to float32 is the correctly rounded float32 result."""
    return struct.unpack("f", struct.pack("f", x))[0]

# ------------------------------------------------------------------------------------------
# Group geometry (paper Eq. 8, Fig. 18, appendix A.6; docs/DESIGN.md#quantization-groups)
# ------------------------------------------------------------------------------------------


def test_q_groups_match_appendix_a6():
    sets = ref.q_group_sets(128, 4)
    # 32 groups: warp w, lane row i -> rows {i, 8+i, 16+i, 24+i} of that warp's 32 rows.
    expected = [[w * 32 + i + 8 * m for m in range(4)] for w in range(4) for i in range(8)]
    assert sets == expected
    assert sorted(r for s in sets for r in s) == list(range(128))


def test_k_groups_match_fragment_layout():
    sets = ref.k_group_sets(64)
    expected = [sorted(8 * m + 2 * g + p for m in range(8) for p in range(2)) for g in range(4)]
    assert sets == expected
    assert sets[1][:4] == [2, 3, 10, 11]


def test_groups_give_each_lane_one_q_scale_and_one_k_scale():
    """Fig. 18: lane l holds rows l/4, l/4+8 of every 16-row slab and columns 2(l%4), 2(l%4)+1
    of every 8-column slab of its warp's tile; all of them must share one Q and one K group."""
    block_q, warps, block_k = 128, 4, 64
    qg, kg = ref.q_group_index(block_q, warps), ref.k_group_index(block_k)
    rows_per_warp = block_q // warps
    for w in range(warps):
        for lane in range(32):
            rows = [w * rows_per_warp + slab * 16 + lane // 4 + h
                    for slab in range(rows_per_warp // 16) for h in (0, 8)]
            cols = [slab * 8 + 2 * (lane % 4) + c for slab in range(block_k // 8) for c in (0, 1)]
            assert len({int(qg[r]) for r in rows}) == 1
            assert len({int(kg[c]) for c in cols}) == 1


def test_group_geometry_other_shapes_and_validation():
    assert ref.q_group_sets(64, 4)[0] == [0, 8]  # 16 rows a warp: groups of 2 rows
    assert len(ref.q_group_sets(128, 8)) == 64
    assert ref.k_group_sets(32)[3] == [6, 7, 14, 15, 22, 23, 30, 31]
    with pytest.raises(ValueError):
        ref.q_group_index(128, 3)
    with pytest.raises(ValueError):
        ref.q_group_index(64, 8)  # 8 rows a warp is not an mma slab
    with pytest.raises(ValueError):
        ref.k_group_index(20)


def test_hopper_reference_quantizes_q_per_row():
    """The Hopper kernel's emulation gives every query row its own Q scale: a row next to a row of
    1000x larger values (its partner g + 8 in the per-thread group of Eq. 8) keeps its precision,
    which the 2-row groups of block_q=128, warps=8 lose. Bad q_granularity values are refused."""
    g = gen(7)
    q, k, v = (torch.randn(1, 1, 128, 64, generator=g) for _ in range(3))
    q[:, :, 8:16] *= 1000.0  # rows 8..15 share a group with rows 0..7 under Eq. 8
    q, k, v = q.half(), k.half(), v.half()
    want = ref.exact_attention(q, k, v)
    common = dict(block_k=128, smooth_k=True, smooth_q=None, pv_dtype="e4m3", two_level=True, fp22=False,
                  row_sum="pv", v_granularity="tile")
    per_row = ref.hopper_kernel_reference(q, k, v, block_k=128, mean_stride=1)
    assert torch.equal(per_row, ref.sage_attention_reference(q, k, v, q_granularity="token", **common))
    grouped = ref.sage_attention_reference(q, k, v, block_q=128, warps=8, **common)
    err_row = relative_l1(per_row[:, :, :8], want[:, :, :8])
    err_group = relative_l1(grouped[:, :, :8], want[:, :, :8])
    assert err_row < 0.06 and err_group > 3 * err_row, (err_row, err_group)
    with pytest.raises(ValueError, match="q_granularity"):
        ref.sage_attention_reference(q, k, v, q_granularity="row")

# ------------------------------------------------------------------------------------------
# Bit-level quantizers
# ------------------------------------------------------------------------------------------


def test_per_thread_scales_are_group_absmax():
    x = smoothed_input((1, 2, 128, 16), seed=2)
    codes, scale = ref.quantize_q_per_thread(x, 128, 4, 7)
    for g, rows in enumerate(ref.q_group_sets(128, 4)):
        amax = x[:, :, rows].abs().amax(dim=(-1, -2))
        assert torch.equal(scale[:, :, 0, g], (amax.double() / 7).float())
    codes, scale = ref.quantize_k_per_thread(x, 64, 127)
    for blk in range(2):
        for g, keys in enumerate(ref.k_group_sets(64)):
            amax = x[:, :, [blk * 64 + j for j in keys]].abs().amax(dim=(-1, -2))
            assert torch.equal(scale[:, :, blk, g], (amax.double() / 127).float())


def test_quantizer_arithmetic_on_hand_made_values():
    # Group 0 of a K block: amax 127 -> scale 1, inv 1; exact .5 ties round to even.
    x = torch.zeros(1, 1, 64, 8)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 126.5, 127.0])
    x[0, 0, 0] = ties
    x[0, 0, 1, 0] = -127.0
    codes, scale = ref.quantize_k_per_thread(x, 64, 127)
    assert scale[0, 0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]  # zero groups: zero scale
    assert codes[0, 0, 0].tolist() == [0, 2, 2, 0, -2, 4, 126, 127]
    assert codes[0, 0, 1, 0] == -127 and not codes[0, 0, 2:].any()
    # INT4, amax 3.5 -> scale 0.5 exactly: 1.25 * 2 = 2.5 -> 2, 0.75 * 2 = 1.5 -> 2, -3.5 -> -7.
    x = torch.tensor([1.25, 0.75, -3.5, 0.25]).view(1, 1, 1, 4)
    codes, scale = ref.quantize_per_token(x, 7)
    assert scale.item() == 0.5 and codes.flatten().tolist() == [2, 2, -7, 0]
    # A non-representable scale: amax 1 -> scale = f32(1/127), inv = f32(1/scale).
    x = torch.tensor([1.0, 0.5, -0.25, 0.1]).view(1, 1, 1, 4)
    codes, scale = ref.quantize_per_token(x, 127)
    s = _f32(1.0 / 127)
    inv = _f32(1.0 / s)
    assert scale.item() == s
    assert codes.flatten().tolist() == [round(_f32(_f32(v) * inv)) for v in x.flatten().tolist()]


def _scalar_quantize(values: list[float], qmax: int) -> tuple[float, list[int]]:
    """Independent scalar float32 emulation of the docs/DESIGN.md#quantizer-arithmetic quantizer
    on one group."""
    amax = max(abs(v) for v in values)
    scale = _f32(amax / qmax)
    inv = _f32(1.0 / scale) if scale > 0 else 0.0
    return scale, [max(-qmax, min(qmax, round(_f32(v * inv)))) for v in values]


@pytest.mark.parametrize("qk_dtype", ["int8", "int4"])
def test_op_references_match_scalar_float32_emulation(qk_dtype):
    g = gen(3)
    B, Hq, Hkv, Nq, Nk, D, block_q, warps, block_k = 1, 4, 2, 70, 45, 16, 64, 4, 32
    q = (torch.randn(B, Hq, Nq, D, generator=g) + 2).half()
    k = (torch.randn(B, Hkv, Nk, D, generator=g) - 1).half()
    v = (3 * torch.randn(B, Hkv, Nk, D, generator=g) + 5).half()
    qmax = ref.INT_QMAX[qk_dtype]
    q_mean, k_mean, v_mean, v_scale = ref.smoothing_stats_reference(q, k, v, True)
    mult = 0.125 * math.log2(math.e)
    q_quant, q_scale, _ = ref.quantize_q_reference(q, q_mean, block_q, warps, qk_dtype, False, mult)
    k_quant, k_scale, v_fp8, _, _ = ref.quantize_kv_reference(
        k, v, k_mean, v_mean, v_scale, None, block_k, qk_dtype, 1.0)
    # V with one scale per tile (no v_scale): the same arithmetic with the tile's scale.
    _, _, v_fp8_tiled, _, tile_scale = ref.quantize_kv_reference(
        k, v, k_mean, v_mean, None, None, block_k, qk_dtype, 1.0)
    if qk_dtype == "int4":
        q_quant, k_quant = ref.unpack_int4(q_quant), ref.unpack_int4(k_quant)

    m32 = _f32(mult)
    for b in range(B):
        for h in range(Hq):
            for blk in range(2):
                for grp, rows in enumerate(ref.q_group_sets(block_q, warps)):
                    rows = [blk * block_q + r for r in rows if blk * block_q + r < Nq]
                    vals = [_f32(float(q[b, h, r, c]) - float(q_mean[b, h, c]))
                            for r in rows for c in range(D)]
                    scale, codes = _scalar_quantize(vals, qmax) if rows else (0.0, [])
                    assert q_scale[b, h, blk, grp].item() == _f32(scale * m32)
                    got = [int(q_quant[b, h, r, c]) for r in rows for c in range(D)]
                    assert got == codes
        for h in range(Hkv):
            for blk in range(2):
                for grp, keys in enumerate(ref.k_group_sets(block_k)):
                    keys = [blk * block_k + j for j in keys if blk * block_k + j < Nk]
                    vals = [_f32(float(k[b, h, j, c]) - float(k_mean[b, h, c]))
                            for j in keys for c in range(D)]
                    scale, codes = _scalar_quantize(vals, qmax) if keys else (0.0, [])
                    assert k_scale[b, h, blk, grp].item() == scale
                    assert [int(k_quant[b, h, j, c]) for j in keys for c in range(D)] == codes
            # V: per channel, e4m3 of (v - v_mean) * (1 / v_scale), stored permuted.
            perm = ref.v_key_permutation(64).tolist()
            for c in range(D):
                inv = _f32(1.0 / float(v_scale[b, h, c]))
                for s, j in enumerate(perm):
                    want = 0.0
                    if j < Nk:
                        x = _f32(_f32(float(v[b, h, j, c]) - float(v_mean[b, h, c])) * inv)
                        want = float(torch.tensor(x).to(torch.float8_e4m3fn).float())
                    assert float(v_fp8[b, h, c, s].float()) == want
            for blk in range(2):
                keys = range(blk * block_k, min(Nk, (blk + 1) * block_k))
                centred = [_f32(float(v[b, h, j, c]) - float(v_mean[b, h, c])) for j in keys for c in range(D)]
                scale = max(_f32(max(abs(x) for x in centred) / 448.0), ref.V_TILE_SCALE_MIN)
                mantissa, exponent = math.frexp(scale)
                scale = scale if mantissa == 0.5 else math.ldexp(1.0, exponent)  # up to 2^k
                assert tile_scale[b, h, blk].item() == scale
                inv = _f32(1.0 / scale)
                for s, j in enumerate(perm[:block_k]):
                    want = 0.0
                    if blk * block_k + j < Nk:
                        x = _f32(_f32(float(v[b, h, blk * block_k + j, c]) - float(v_mean[b, h, c])) * inv)
                        want = float(torch.tensor(x).to(torch.float8_e4m3fn).float())
                    assert float(v_fp8_tiled[b, h, c, blk * block_k + s].float()) == want
    # Padding rows / keys are zero codes.
    assert not q_quant[:, :, Nq:].any() and not k_quant[:, :, Nk:].any()


def test_pack_unpack_int4():
    x = torch.tensor([1, -1, 7, -7, 0, -8, 3, 4], dtype=torch.int8)
    packed = ref.pack_int4(x)
    assert packed.dtype == torch.int8
    # channel 2c low nibble, 2c+1 high nibble: (1, -1) -> 0xF1, (7, -7) -> 0x97, ...
    assert packed.view(torch.uint8).tolist() == [0xF1, 0x97, 0x80, 0x43]
    y = torch.randint(-7, 8, (3, 5, 64), generator=gen(4), dtype=torch.int8)
    assert ref.pack_int4(y).shape == (3, 5, 32)
    assert torch.equal(ref.unpack_int4(ref.pack_int4(y)), y)


def test_fp8_rounding_and_saturation():
    e4m3 = ref.quantize_fp8(torch.tensor([1.0625, 1.1875, 2**-10, 3 * 2**-10, 464.0, -1e4, 0.3]))
    # ties to even (mantissa step 1/8 near 1, subnormal step 2^-9), saturation at +-448
    assert e4m3.dtype == torch.float8_e4m3fn
    assert e4m3.float().tolist() == [1.0, 1.25, 0.0, 2**-8, 448.0, -448.0, 0.3125]
    e5m2 = ref.quantize_fp8(torch.tensor([1.125, 1.375, 7e4]), "e5m2")
    assert e5m2.float().tolist() == [1.0, 1.5, 57344.0]
    p = ref.quantize_p_fp8(torch.tensor([1.0, 0.5, 1e-6]))
    assert p.float().tolist() == [448.0, 224.0, 0.0]


def test_v_tile_codes_in_fp16_arithmetic_equal_the_float_path():
    """quantize_kv quantizes fp16 V without a mean in packed fp16 (HMUL2 by 1/s, then E4M3 from
    the fp16 product), claiming the float path's codes, e4m3(float(v) * (1/s)), bit for bit
    wherever 1/s is a power of two in [2^-8, 2^15] (a tile scale of fp16 V) and |v| * (1/s) <=
    448 (every value of the tile whose max set s). Checked here for every finite fp16 value and
    every such 1/s: the fp16 product is exact while it is a normal number, and smaller products
    round to a signed zero in E4M3 either way."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.float16)
    x = x[torch.isfinite(x)]
    for k in range(-8, 16):
        inv = 2.0 ** k
        v = x[x.float().abs() * inv <= 448.0]
        float_path = (v.float() * inv).to(torch.float8_e4m3fn).view(torch.uint8)
        half_path = (v * torch.tensor(inv, dtype=torch.float16)).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(half_path, float_path), f"1/s = 2^{k}"
        assert v.numel() > 1000


def test_quantize_q_reference_layout_and_padding():
    g = gen(5)
    B, H, N, D = 2, 3, 200, 32
    base = (torch.randn(B, N, H, D, generator=g) + 3).half()
    q = base.transpose(1, 2)  # an NHD tensor seen as [B,H,N,D]: non-contiguous
    mult = 0.7
    for qk_dtype, width in (("int8", D), ("int4", D // 2)):
        qq, qs, qm = ref.quantize_q_reference(q, None, 128, 4, qk_dtype, True, mult)
        qq2, qs2, qm2 = ref.quantize_q_reference(q.contiguous(), None, 128, 4, qk_dtype, True, mult)
        assert torch.equal(qq, qq2) and torch.equal(qs, qs2) and torch.equal(qm, qm2)
        assert qq.shape == (B, H, 256, width) and qq.dtype == torch.int8 and qq.is_contiguous()
        assert qs.shape == (B, H, 2, 32) and qs.dtype == torch.float32
        assert qm.shape == (B, H, 2, D) and qm.dtype == torch.float32
        assert not qq[:, :, N:].any()
    # Block means over valid rows only (rows 128..199 for the last block), times the multiplier.
    mean_last = q[:, :, 128:].double().mean(dim=2).float()
    assert torch.equal(qm[:, :, 1], mean_last * torch.tensor(mult, dtype=torch.float32))
    # Groups of the last block made only of padding rows (rows >= 200) have zero scale.
    for grp, rows in enumerate(ref.q_group_sets(128, 4)):
        all_pad = all(128 + r >= N for r in rows)
        assert bool((qs[:, :, 1, grp] == 0).all()) == all_pad
    # No smoothing: empty block mean; the means are absent-equivalent for None and empty.
    a = ref.quantize_q_reference(q, None, 128, 4, "int8", False, 1.0)
    b = ref.quantize_q_reference(q, torch.empty(0), 128, 4, "int8", False, 1.0)
    assert a[2].shape == (0,) and a[2].dtype == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # Feeding the same block means through block_mean (how a GPU test feeds a kernel's own
    # means) reproduces the op exactly; other means give other codes.
    means = torch.stack([q[:, :, :128].double().mean(dim=2).float(), mean_last], dim=2)
    own = ref.quantize_q_reference(q, None, 128, 4, "int8", True, mult)
    fed = ref.quantize_q_reference(q, None, 128, 4, "int8", True, mult, block_mean=means)
    assert all(torch.equal(x, y) for x, y in zip(own, fed))
    shifted = ref.quantize_q_reference(q, None, 128, 4, "int8", True, mult, block_mean=means + 0.5)
    assert not torch.equal(shifted[0], own[0])


def test_quantize_kv_reference_layout_and_delta_s():
    g = gen(6)
    B, Hq, Hkv, N, D = 1, 4, 2, 100, 16
    q = torch.randn(B, Hq, 7, D, generator=g).half()
    k = (torch.randn(B, Hkv, N, D, generator=g) + 2).half()
    v = (torch.randn(B, Hkv, N, D, generator=g) + 4).half()
    q_mean, k_mean, v_mean, v_scale = ref.smoothing_stats_reference(q, k, v, False)
    assert v_mean.shape == (0,)
    mult = 0.3
    kq, ks, v8, ds, vts = ref.quantize_kv_reference(
        k, v, k_mean, v_mean, v_scale, q_mean, 64, "int8", mult)
    assert vts.shape == (0,)  # V came with per-channel scales
    assert kq.shape == (B, Hkv, 128, D) and ks.shape == (B, Hkv, 2, 4)
    assert v8.shape == (B, Hkv, D, 128) and v8.dtype == torch.float8_e4m3fn and v8.is_contiguous()
    assert ds.shape == (B, Hq, 128) and ds.dtype == torch.float32
    assert not kq[:, :, N:].any() and not ds[:, :, N:].any()
    assert not v8.float()[..., ref.v_key_permutation(128) >= N].any()
    # Undoing the 16-key permutation gives V per channel in e4m3 (v_mean = 0 here).
    perm = ref.v_key_permutation(128)
    assert perm[:16].tolist() == list(ref.V_KEY_ORDER)
    natural = torch.empty_like(v8.float())
    natural[..., perm] = v8.float()
    codes, scale = ref.quantize_v_per_channel(v, None, "e4m3")
    assert torch.equal(scale, v_scale)
    assert torch.equal(natural[..., :N], codes.float().transpose(-1, -2))
    # delta_s: q head hq uses kv head hq // 2; float64 value of q_mean . (k - k_mean).
    gk = k.float() - k_mean[:, :, None]
    for hq in range(Hq):
        want = (gk[:, hq // 2].double() @ q_mean[:, hq].double()[0]) * mult
        torch.testing.assert_close(ds[:, hq, :N], want.float(), rtol=1e-6, atol=1e-6)
    # Absent outputs
    kq2, ks2, v82, ds2, vts2 = ref.quantize_kv_reference(k, None, None, None, None, None, 64, "int4", 1.0)
    assert kq2.shape == (B, Hkv, 128, D // 2)
    assert v82.shape == (0,) and ds2.shape == (0,) and vts2.shape == (0,) and v82.dtype == torch.float32
    # Without v_scale: one scale per tile of 64 keys, [B, Hkv, tiles].
    *_, v8t, _, vts3 = ref.quantize_kv_reference(k, v, None, None, None, None, 64, "int8", 1.0)
    assert vts3.shape == (B, Hkv, 2) and v8t.shape == v8.shape


def test_smoothing_stats_reference():
    g = gen(7)
    q = torch.randn(2, 4, 33, 8, generator=g).half()
    k = torch.randn(2, 2, 50, 8, generator=g).half()
    v = (torch.randn(2, 2, 50, 8, generator=g) + 3).half()
    qm, km, vm, vs = ref.smoothing_stats_reference(q, k, v, True)
    assert torch.equal(qm, q.double().mean(dim=2).float())
    assert torch.equal(km, k.double().mean(dim=2).float())
    assert torch.equal(vm, v.double().mean(dim=2).float())
    want = ((v.float() - vm[:, :, None]).abs().amax(dim=2).double() / 448).float()
    assert torch.equal(vs, want)
    _, _, vm0, vs0 = ref.smoothing_stats_reference(None, None, v, False)
    assert vm0.shape == (0,)
    assert torch.equal(vs0, (v.float().abs().amax(dim=2).double() / 448).float())
    out = ref.smoothing_stats_reference(None, k, None, True)
    assert [t.shape for t in out] == [(0,), km.shape, (0,), (0,)]

# ------------------------------------------------------------------------------------------
# Smoothing algebra (paper 3.1)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("smooth_q", ["block", "head"])
def test_smoothing_preserves_softmax(smooth_q):
    q, k, _ = input_family("bias4", (1, 4, 200, 64), seed=8)
    k = k[:, ::2]  # GQA: 4 q heads on 2 kv heads
    q, k = q.double(), k.double()
    sm = ref.smooth_qk(q, k, smooth_q=smooth_q, smooth_k=True, block_q=64)
    gk = sm.gamma_k.repeat_interleave(2, dim=1)
    ds = ref.delta_s(sm.q_offset, sm.gamma_k)[:, :, sm.q_offset_index]
    s_smooth = sm.gamma_q @ gk.transpose(-1, -2) + ds
    s_true = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    scale = 1 / math.sqrt(64)
    p_true = torch.softmax(s_true * scale, dim=-1)
    assert (torch.softmax(s_smooth * scale, dim=-1) - p_true).abs().max() < 1e-12
    # Smoothing really changed the operands, and Delta-S is what makes it exact.
    assert sm.gamma_q.abs().max() < 0.5 * q.abs().max()
    no_ds = torch.softmax((s_smooth - ds) * scale, dim=-1)
    assert (no_ds - p_true).abs().max() > 1e-2
    # The row bias q_i . k_mean is all that is left.
    bias = q @ sm.k_mean.repeat_interleave(2, dim=1)[..., None]
    assert (s_smooth + bias - s_true).abs().max() < 1e-10


def test_sampled_smoothing_means():
    """mean_stride: K's (and with smooth_v V's) smoothing vector is the mean of every s-th token.
    Any vector subtracted from every key shifts a row of S by a constant, and V's mean is added
    back, so without quantization the output and the LSE do not change; with INT8 QK and FP8 PV
    (the Hopper path) the error stays that of the all-token mean on a family with channel
    offsets, to within a few percent."""
    q, k, v = input_family("bias4", (1, 2, 700, 64), seed=11)
    sm = ref.smooth_qk(q.float(), k.float(), mean_stride=5)
    assert torch.equal(sm.k_mean, k.float()[:, :, ::5].double().mean(dim=2).float())
    assert not torch.equal(sm.k_mean, ref.smooth_qk(q.float(), k.float()).k_mean)
    assert torch.equal(sm.gamma_k, k.float() - sm.k_mean[:, :, None])
    exact_kw = dict(qk_dtype="fp16", pv_dtype="fp32", smooth_v=True, return_lse=True, is_causal=True)
    out1, lse1 = ref.sage_attention_reference(q, k, v, **exact_kw)
    out5, lse5 = ref.sage_attention_reference(q, k, v, mean_stride=5, **exact_kw)
    torch.testing.assert_close(out5, out1, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse5, lse1, rtol=0, atol=1e-5)
    want = ref.exact_attention(q, k, v)
    hopper = dict(block_q=128, warps=8, block_k=128, row_sum="pv", v_granularity="tile")
    for smooth_v in (False, True):
        full = simulated_l1(q, k, v, want, smooth_v=smooth_v, **hopper)
        sampled = simulated_l1(q, k, v, want, smooth_v=smooth_v, mean_stride=5, **hopper)
        assert sampled < 1.05 * full, (smooth_v, sampled, full)
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="mean_stride"):
            ref.sage_attention_reference(q, k, v, mean_stride=bad)

# ------------------------------------------------------------------------------------------
# FP22 accumulator (paper 3.4)
# ------------------------------------------------------------------------------------------


def test_fp22_truncate_hand_values():
    ok = [1.0, 1 + 2**-13, -(1 + 2**-13), 2**100 * (1 + 2**-5 + 2**-13), 0.0, 3 * 2**-120]
    x = torch.tensor(ok, dtype=torch.float32)
    assert torch.equal(ref.fp22_truncate(x), x)  # <= 13 mantissa bits: unchanged
    more = torch.tensor([1 + 2**-14, 1 + 2**-13 + 2**-23, -(1 + 2**-14 + 2**-20),
                         (2 - 2**-23) * 2**20, -3.0000002], dtype=torch.float32)
    want = torch.tensor([1.0, 1 + 2**-13, -1.0, (2 - 2**-13) * 2**20, -3.0],
                        dtype=torch.float32)
    assert torch.equal(ref.fp22_truncate(more), want)  # low bits dropped, toward zero
    y = torch.randn(10000, generator=gen(9)) * 100
    t = ref.fp22_truncate(y)
    assert torch.all(t.abs() <= y.abs()) and torch.all(torch.sign(t) == torch.sign(y))
    assert torch.all((y - t).abs() < y.abs() * 2**-13)
    assert not (t.view(torch.int32) & 0x3FF).any()
    # The float64 form truncates the exact value: same as float32 for float32 values.
    assert torch.equal(ref.fp22_truncate(y.double()).float(), t)
    assert ref.fp22_truncate(torch.tensor([1 + 2**-14 + 2**-40], dtype=torch.float64)).item() == 1.0

# ------------------------------------------------------------------------------------------
# Ground truth against torch SDPA, and the tiled form against the ground truth
# ------------------------------------------------------------------------------------------


def _sdpa64(q, k, v, **kw):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


@pytest.mark.parametrize("nq,nk,causal", [(37, 53, True), (53, 37, True), (40, 40, True),
                                          (37, 53, False)])
def test_exact_attention_matches_sdpa(nq, nk, causal):
    g = gen(10)
    q = torch.randn(2, 3, nq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, nk, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, nk, 24, generator=g, dtype=torch.float64)
    out, lse = ref.exact_attention(q, k, v, is_causal=causal, scale=0.3, return_lse=True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _sdpa64(q, k, v, is_causal=causal, scale=0.3),
                               rtol=1e-12, atol=1e-12)
    s = q @ k.transpose(-1, -2) * 0.3
    if causal:
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).tril().logical_not(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-12, atol=1e-12)


def test_exact_attention_masks_and_gqa():
    g = gen(11)
    q = torch.randn(1, 6, 20, 8, generator=g).half()
    k = torch.randn(1, 2, 30, 8, generator=g).half()
    v = torch.randn(1, 2, 30, 8, generator=g).half()
    torch.testing.assert_close(ref.exact_attention(q, k, v, enable_gqa=True),
                               _sdpa64(q, k, v, enable_gqa=True), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError):
        ref.exact_attention(q, k, v)
    qe, ke, ve = q[:, :2], k, v
    bool_mask = torch.rand(20, 30, generator=g) > 0.5
    bool_mask[3] = False  # a row with no key: SDPA gives 0, LSE -inf
    out, lse = ref.exact_attention(qe, ke, ve, attn_mask=bool_mask, return_lse=True)
    torch.testing.assert_close(out, _sdpa64(qe, ke, ve, attn_mask=bool_mask),
                               rtol=1e-12, atol=1e-12)
    assert torch.all(out[:, :, 3] == 0) and torch.all(lse[:, :, 3] == -math.inf)
    float_mask = torch.randn(1, 1, 20, 30, generator=g, dtype=torch.float64)
    float_mask[..., 5, :7] = -math.inf
    torch.testing.assert_close(ref.exact_attention(qe, ke, ve, attn_mask=float_mask),
                               _sdpa64(qe, ke, ve, attn_mask=float_mask), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError):
        ref.exact_attention(qe, ke, ve, attn_mask=bool_mask, is_causal=True)


_UNQUANTIZED = dict(qk_dtype="fp16", pv_dtype="fp32", fp22=False)


@pytest.mark.parametrize(
    "nq,nk,hq,hkv,causal,extra",
    [
        (256, 256, 2, 2, False, {}),
        (200, 333, 2, 2, True, {}),
        (333, 200, 2, 2, True, {}),
        (131, 97, 4, 2, False, {"smooth_q": "block"}),
        (97, 131, 4, 1, True, {"smooth_q": "head", "smooth_v": True}),
        (150, 150, 2, 2, True, {"smooth_k": False, "two_level": False}),
    ],
)
def test_tiled_unquantized_matches_exact(nq, nk, hq, hkv, causal, extra):
    g = gen(12)
    q = (torch.randn(1, hq, nq, 64, generator=g) + 1).half()
    k = (torch.randn(1, hkv, nk, 64, generator=g) - 1).half()
    v = (torch.randn(1, hkv, nk, 64, generator=g) + 2).half()
    out, lse = ref.sage_attention_reference(q, k, v, is_causal=causal, return_lse=True,
                                            block_q=64, **_UNQUANTIZED, **extra)
    want, want_lse = ref.exact_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                         return_lse=True)
    assert out.dtype == torch.float32 and out.shape == want.shape and lse.shape == want_lse.shape
    assert (out.double() - want).abs().max() < 1.5e-6
    assert (lse.double() - want_lse).abs().max() < 2e-6

# ------------------------------------------------------------------------------------------
# The kernels' variants of the simulation: accuracy against exact attention
# ------------------------------------------------------------------------------------------


def test_v_tile_scales_match_per_channel_accuracy():
    """v_granularity="tile" (the Hopper kernel's V, one FP8 scale per tile, O kept in the units
    of the last folded tile): as accurate as per-channel V on the input families (E4M3's
    exponent gives a tile-wide scale the per-channel one's relative precision), and exact in
    its bookkeeping: with V constant per tile (each tile a different magnitude, one tile zero)
    and uniform attention, O is the average of the tile values to float32 rounding."""
    for family in ("bias0", "bias4"):
        q, k, v = input_family(family, (1, 2, 1000, 64), seed=3)
        want = ref.exact_attention(q, k, v, is_causal=True)
        kw = dict(is_causal=True, block_k=128, row_sum="pv")
        tile = simulated_l1(q, k, v, want, v_granularity="tile", **kw)
        channel = simulated_l1(q, k, v, want, **kw)
        assert tile < 1.05 * channel, (family, tile, channel)
    q = torch.zeros(1, 1, 3, 64).half()
    k = torch.zeros(1, 1, 512, 64).half()
    values = torch.tensor([3.0, 0.0, 2.0**-10, 224.0]).repeat_interleave(128)  # exact in E4M3 at 2^k scales
    v = values[None, None, :, None].expand(1, 1, 512, 64).half()
    out = ref.sage_attention_reference(q, k, v, block_k=128, row_sum="pv", v_granularity="tile")
    torch.testing.assert_close(out, torch.full_like(out, float(v.float().mean())), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="v_granularity"):
        ref.sage_attention_reference(q, k, v, pv_dtype="fp16", v_granularity="tile")


def test_row_sum_from_the_pv_mma():
    """row_sum="pv": l sums the P8 the PV mma multiplies (the Hopper kernel's ones column), so with
    V = 1 every output is 1 (the weights sum to 1 exactly, up to float32); row_sum="p" divides
    by the unrounded P~ and misses 1 by the FP8 rounding of P."""
    g = gen(7)
    q, k = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(2))
    v = torch.ones(1, 2, 300, 64)
    kw = dict(qk_dtype="int8", block_q=128, warps=8, block_k=128, pv_dtype="e4m3", fp22=False)
    for causal in (False, True):
        pv = ref.sage_attention_reference(q, k, v, is_causal=causal, row_sum="pv", **kw)
        p = ref.sage_attention_reference(q, k, v, is_causal=causal, row_sum="p", **kw)
        assert (pv - 1).abs().max().item() < 1e-6
        assert (p - 1).abs().max().item() > 1e-4
    with pytest.raises(ValueError, match="row_sum"):
        ref.sage_attention_reference(q, k, v, pv_dtype="fp16", row_sum="pv")
    with pytest.raises(ValueError, match="row_sum"):
        ref.sage_attention_reference(q, k, v, row_sum="ones")


def test_lazy_rescale_and_softmax_steps():
    """softmax_block and lazy_rescale (attention_mma's FP16-PV softmax) change how the online
    softmax walks the keys, not what it computes: without rounding of P~ the output and LSE are
    the exact-max ones to float32. With FP16 P~ a later key 2^20 above a row's earlier scores
    (P~ past FP16's range unless the max moves) still gives the exact answer: a jump beyond
    2^lazy_rescale moves the max of every row of the group."""
    g = gen(11)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g) for _ in range(3))
    kw = dict(qk_dtype="int8", block_q=128, warps=8, block_k=128, fp22=False, two_level=False,
              return_lse=True)
    for causal in (False, True):
        base, base_lse = ref.sage_attention_reference(q, k, v, is_causal=causal, pv_dtype="fp32", **kw)
        for integer_max in (False, True):  # integer_max: the max rounded up in base 2 as it moves
            lazy, lazy_lse = ref.sage_attention_reference(q, k, v, is_causal=causal, pv_dtype="fp32",
                                                          softmax_block=64, lazy_rescale=8.0,
                                                          integer_max=integer_max, **kw)
            torch.testing.assert_close(lazy, base, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lazy_lse, base_lse, rtol=1e-5, atol=1e-5)
    # integer_max moves m to an integer in base 2 (the kernel's folded exponent): with one key,
    # P~ = 1 exactly at the exact max, 2^(m - ceil m) otherwise, whose FP16 rounding (divided by
    # the unrounded sum) then shows in the output.
    one = dict(qk_dtype="fp16", pv_dtype="fp16", softmax_block=64, lazy_rescale=8.0, block_k=128,
               fp22=False, two_level=False, smooth_k=False, return_lse=True)  # (a smoothed lone key is 0)
    k1, v1 = k[:, :, :1], v[:, :, :1]
    exact_max, exact_lse = ref.sage_attention_reference(q, k1, v1, **one)
    rounded_max, rounded_lse = ref.sage_attention_reference(q, k1, v1, integer_max=True, **one)
    torch.testing.assert_close(exact_max, v1.half().float().expand_as(exact_max), rtol=0, atol=0)
    assert not torch.equal(rounded_max, exact_max)
    torch.testing.assert_close(rounded_max, exact_max, rtol=2 ** -10, atol=1e-6)
    torch.testing.assert_close(rounded_lse, exact_lse, rtol=1e-6, atol=1e-6)
    # Query 5 meets key 150 (third 64-key step) 20 (log2) above everything before it.
    q2, k2 = q.clone(), k.clone()
    k2[:, :, 150] = q2[:, :, 5] * (20 * math.log(2) * 8 / q2[:, :, 5].square().sum(-1, keepdim=True))
    want = ref.exact_attention(q2, k2, v)
    got = ref.sage_attention_reference(q2, k2, v, qk_dtype="fp16", pv_dtype="fp16", softmax_block=64,
                                       lazy_rescale=8.0, block_k=128, fp22=False, two_level=False)
    assert torch.isfinite(got).all()
    assert relative_l1(got, want) < 2e-3
    for bad in (dict(softmax_block=48), dict(softmax_block=96), dict(lazy_rescale=8.0, pv_dtype="e4m3"),
                dict(softmax_block=64, v_granularity="tile", pv_dtype="e4m3"), dict(rescale_rows=0),
                dict(integer_max=True)):
        with pytest.raises(ValueError):
            ref.sage_attention_reference(q, k, v, block_k=128, **bad)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("algorithm", ["hopper", "mma int8+input", "mma int4+fp8"])
def test_emulations_keep_nan_and_inf(where: str, value: float, algorithm: str) -> None:
    """The kernels' algorithms (as emulated) make every element that SDPA makes NaN or Inf
    non-finite, and leave what the poison cannot reach finite (issue 34 item 5; the kernels:
    tests/test_nan_gpu.py)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    {"q": q[0, 1, 5], "k": k[0, 1, 7], "v": v[0, 1, 7]}[where][3] = value
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                            enable_gqa=True)
    if algorithm == "hopper":
        out = ref.hopper_kernel_reference(q, k, v, block_k=128, mean_stride=1)
    else:
        qk, pv = ("int8", "bf16") if algorithm == "mma int8+input" else ("int4", "e4m3")
        out = ref.sage_attention_reference(
            q, k, v, qk_dtype=qk, granularity="thread", block_q=128, warps=8, block_k=64,
            smooth_k=True, smooth_q="head" if qk == "int4" else None, pv_dtype=pv,
            two_level=pv == "e4m3", fp22=False)
    assert int(torch.isfinite(out)[~torch.isfinite(want)].sum()) == 0
    unreached = [0, 2, 3] if where == "q" else [0, 1]
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, unreached]).all()
