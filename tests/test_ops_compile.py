"""The op layer (needs the compiled extension; the preprocessing ops' CPU implementations call
the reference): opcheck, the Meta implementations' shapes and errors, torch.compile of the ops
and of sageattn (one graph op, ``sageattention2::sageattn``), the build information."""
from __future__ import annotations

import math
import re
import shutil
import subprocess
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, needs_extension, qkv
from sageattention2 import SageAttentionFallbackWarning, ops, sageattn

# The kernels' geometry that the Python side feeds (quantize_kv's blocks) and emulates (the GPU
# tests: Q groups, the FP16-PV variant's warps, tiles and lazy rescale; the Hopper kernel's
# 128-query CTA, whose Q scales are per row: q_granularity="token"), by its csrc name.
KERNEL_GEOMETRY = {
    "mma": {"kMmaBlockQ": ops.MMA_BLOCK_Q, "kMmaWarps": ops.MMA_WARPS,
            "kMmaBlockK": ops.MMA_BLOCK_K, "kMmaInputPvWarps": ops.MMA_INPUT_PV_WARPS,
            "kMmaInputPvTileK": ops.MMA_INPUT_PV_TILE_K,
            "kMmaLazyRescaleLog2": ops.MMA_LAZY_RESCALE_LOG2},
    "wgmma": {"kWgmmaBlockK": ops.WGMMA_BLOCK_K, "kWgmmaBlockQ": 128},
    "parallel": {"kCopyManyMaxPairs": ops.COPY_MANY_MAX_PAIRS},
    "merge": {"kMergeMaxParts": ops.MERGE_MAX_PARTS},
}


@pytest.mark.parametrize("kernel", KERNEL_GEOMETRY)
def test_geometry_matches_csrc(kernel: str) -> None:
    """ops' geometry constants of each kernel are its csrc header's."""
    path = REPO / "csrc" / {"mma": "mma/params.h", "wgmma": "hopper/params.h",
                            "parallel": "parallel/copy_many.h", "merge": "parallel/merge_parts.h"}[kernel]
    if not path.exists():
        pytest.skip(f"{path} not in this checkout")
    text = path.read_text()
    for name, value in KERNEL_GEOMETRY[kernel].items():
        match = re.search(rf"constexpr\s+int\s+{name}\s*=\s*(\d+)\s*;", text)
        assert match is not None, f"{name} not found in {path}"
        assert int(match.group(1)) == value, f"{name} = {match.group(1)} but Python has {value}"


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
        args = dict(q=q, k_codes=k_codes, k_scale=k_scale, v=v_fp8, v_tile_scale=v_tile_scale,
                    v_mean=None, k_mean=None, kv_len=kv_len, sm_scale=0.1, is_causal=False,
                    out_nhd=False, return_lse=True)
        args.update(changes)
        ops.attention_wgmma(**args)

    for kv_bad in (k_pad - ops.WGMMA_BLOCK_K, k_pad + 1, 0):  # k_codes is not kv_len padded
        with pytest.raises(RuntimeError, match="kv_len"):
            call(kv_len=kv_bad)
    with pytest.raises(RuntimeError, match=r"v \(float8_e4m3fn\) must have shape"):
        call(v=torch.empty(b, hkv, d, k_pad - ops.WGMMA_BLOCK_K, dtype=torch.float8_e4m3fn, **meta))
    with pytest.raises(RuntimeError, match=r"v \(float8_e4m3fn\) must have shape"):
        call(v=torch.empty(b, hkv, k_pad, d, dtype=torch.float8_e4m3fn, **meta))
    with pytest.raises(RuntimeError, match="v_scale .* is required with float8_e4m3fn v"):
        call(v_tile_scale=None)
    # The accurate tier: the caller's V in q's dtype, without scales.
    v_input = torch.empty(b, hkv, kv_len, d, dtype=q.dtype, device="meta")
    out, _ = ops.attention_wgmma(q, k_codes, k_scale, v_input, None, None, None, kv_len, 0.1, False,
                                 True, False)
    assert out.shape == q.shape and out.dtype == q.dtype and out.transpose(1, 2).is_contiguous()
    with pytest.raises(RuntimeError, match="v_scale and v_mean go with float8_e4m3fn v only"):
        call(v=v_input)
    with pytest.raises(RuntimeError, match=r"v must have shape \[batch, kv_heads, kv_len, head_dim\]"):
        call(v=v_input[:, :, 1:], v_tile_scale=None)
    with pytest.raises(RuntimeError, match="or have q's dtype"):
        call(v=v_input.to(torch.bfloat16 if q.dtype == torch.float16 else torch.float16), v_tile_scale=None)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256"):
        call(q=torch.empty(b, hq, nq, 96, dtype=torch.float16, **meta),
             k_codes=torch.empty(b, hkv, k_pad, 96, dtype=torch.int8, **meta))
    # head_dim 256: the FP8 tier only.
    q256 = torch.empty(b, hq, nq, 256, dtype=q.dtype, **meta)
    k256 = torch.empty(b, hkv, k_pad, 256, dtype=torch.int8, **meta)
    out, _ = ops.attention_wgmma(q256, k256, k_scale, torch.empty(b, hkv, 256, k_pad, dtype=torch.float8_e4m3fn, **meta),
                                 v_tile_scale, None, None, kv_len, 0.1, False, False, True)
    assert out.shape == q256.shape
    with pytest.raises(RuntimeError, match="head_dim 256 runs attention_wgmma with FP8 V only"):
        call(q=q256, k_codes=k256, v=torch.empty(b, hkv, kv_len, 256, dtype=q.dtype, **meta),
             v_tile_scale=None)
    with pytest.raises(RuntimeError, match="q must be contiguous in its last dimension"):
        call(q=torch.empty(b, hq, d, nq, dtype=torch.float16, **meta).transpose(2, 3))
    with pytest.raises(RuntimeError, match="v_scale must have shape"):  # a per-channel scale
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
        for pv in ("fp8", "input"):
            out, lse_out = ops.sageattn_wgmma(q, k.transpose(1, 2).contiguous().transpose(1, 2), v,
                                              pv, smooth_k, smooth_v, 3, 0.1, True, out_nhd, lse)
            assert out.shape == (b, hq, nq, d) and out.dtype == torch.bfloat16
            assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
            assert lse_out.shape == ((b, hq, nq) if lse else (0,)) and lse_out.dtype == torch.float32

    def call(**changes: Any) -> None:
        args = dict(q=q, k=k, v=v, pv_dtype="fp8", smooth_k=True, smooth_v=True, sample_stride=1,
                    sm_scale=0.1, is_causal=False, out_nhd=False, return_lse=True)
        args.update(changes)
        ops.sageattn_wgmma(**args)

    with pytest.raises(RuntimeError, match="sample_stride must be >= 1"):
        call(sample_stride=0)
    with pytest.raises(RuntimeError, match="pv_dtype must be 'fp8' or 'input', got 'fp16'"):
        call(pv_dtype="fp16")
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
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256"):
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
    with pytest.raises(RuntimeError, match="pv_dtype must be 'fp8' or 'input', got 'fp16'"):
        call(pv_dtype="fp16")
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


# ------------------------------------------------------------------------------------------------
# The op layer (needs the compiled extension; CPU implementations call the reference)
# ------------------------------------------------------------------------------------------------

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
    bit (here the CPU fallback; tests/test_sageattn_gpu.py does the kernels)."""
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


def test_graph_op_output_memory_follows_the_query() -> None:
    """[B, H, N, D] views of [B, N, H, D] memory (diffusers' dispatcher): the graph op's out is
    in that memory too, in the fake and the real implementation alike (opcheck), as the eager
    kernel call writes it (docs/DECISIONS.md#d32), so the caller's transpose back is free."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in qkv(b=2, hq=4, hkv=4, nq=37, nk=29, d=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        want = sageattn(q, k, v)
        got = torch.compile(lambda q, k, v: sageattn(q, k, v), fullgraph=True,
                            backend="aot_eager")(q, k, v)
        assert got.transpose(1, 2).is_contiguous() and torch.equal(got, want)
        for args in ((q, k, v, None, 0.0, False, None, False, "HND", "auto", "auto", True, "auto",
                      False, True, False, "top_left"),
                     (q[0], k[0], v[0], None, 0.0, True, None, False, "HND", "auto", "auto", True,
                      "auto", False, False, False, "top_left")):
            torch.library.opcheck(torch.ops.sageattention2.sageattn.default, args)
            out = torch.ops.sageattention2.sageattn(*args)[0]
            assert out.transpose(-3, -2).is_contiguous()


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
                      False, True, False, "top_left"),
                     (q[0], k[0], v[0], None, 0.0, False, 0.3, False, "HND", "int8", "none", False,
                      ":false", True, False, False, "bottom_right")):
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
