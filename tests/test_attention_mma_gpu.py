"""GPU tests of the warp-level attention op, ``attention_mma``, in its three variants, against
the emulation of the same algorithm (the acceptance criterion), and of ``sageattn_mma``, the
one-op path sageattn runs for it (helpers, bounds and references: gpu_helpers.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_helpers import (EMULATION_L1, LOG2E, MMA_INT4_FP8, MMA_INT8_FP8, MMA_INT8_INPUT,
                         OP_LSE_ATOL, assert_finite, emulate, exact, exact_l1_bound, make_qkv,
                         q_view, rel_l1, require_kernel, run_op)
from sageattention2 import api, ops
from sageattention2._plan import KernelChoice
from sageattention2.testing import poison_cuda_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("attention_kernel")]

if not ops.HAS_EXTENSION:
    pytest.skip(f"compiled extension not available: {ops.EXTENSION_ERROR}", allow_module_level=True)
if not ops.has_op("attention_mma"):
    pytest.skip("this build has no attention_mma op", allow_module_level=True)


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
            poison_cuda_allocator()
            want, want_lse = ops.sageattn_mma_chain(*args)
            poison_cuda_allocator()
            out, lse = ops.sageattn_mma(*args)
            assert out.shape == (b, hq, nq, d) and out.dtype == dtype
            assert (out.transpose(1, 2) if out_nhd else out).is_contiguous()
            assert_finite(out, lse)
            assert torch.equal(out, want) and torch.equal(lse, want_lse)
            assert lse.shape == ((b, hq, nq) if return_lse else (0,))


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


def test_sageattn_mma_int4_guard_is_its_chain() -> None:
    """The INT4 guard in C++ (sageattn_mma with int4_guard: the statistics with Q's and K's
    channel ranges, the flags, quantize_kv and attention_mma twice into one output, docs/
    DECISIONS.md#d38) gives its chain's output and LSE bit for bit (ops.sageattn_mma_chain: the
    INT4 chain and the INT8 chain merged per head by ops.int8_heads), on poisoned memory, with
    GQA and an odd length; KV head 1 is flagged for its K, KV head 2 for one of its Q heads."""
    require_kernel(MMA_INT4_FP8)
    b, hq, hkv, n, d = 2, 8, 4, 1000, 128
    q, k, v = make_qkv(b, hq, hkv, n, n, d, torch.float16, seed=38, bias=(1.0, 4.0, 1.0))
    k[:, 1, :, 8:12] *= 8
    q[:, 4, :, 20:24] *= 8
    stats = ops.smoothing_stats(q, k, v, False)
    assert ops.int8_heads(q, k, stats.q_mean, stats.k_mean, 2.0).tolist() == [[0, 1, 1, 0]] * b
    for causal, return_lse in ((False, True), (True, False)):
        args = (q, k, v, "int4", "fp8", True, True, False, 1, 0.07, causal, False, return_lse, 2.0)
        poison_cuda_allocator()
        want, want_lse = ops.sageattn_mma_chain(*args)
        poison_cuda_allocator()
        out, lse = ops.sageattn_mma(*args)
        assert_finite(out, lse)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        unguarded, _ = ops.sageattn_mma(*args[:-1], 0.0)
        for h in range(hq):  # the heads of KV heads 1 and 2 ran INT8, the others INT4 as before
            assert torch.equal(out[:, h], unguarded[:, h]) == (h // 2 in (0, 3)), h
