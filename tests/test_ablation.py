"""The paper's ablations (sageattention2/ablation.py and the simulator's switches): quantizers at
every granularity, and the accuracy orderings of the paper's ablation tables and of the idealised
simulation of docs/PROTOCOL.md#idealised-simulation on synthetic inputs with fixed seeds."""
from __future__ import annotations

import pytest
import torch

from helpers import gen, input_family, simulated_l1, smoothed_input
from sageattention2 import ablation
from sageattention2 import reference as ref
from sageattention2.testing import cosine_similarity, relative_l1


@pytest.mark.parametrize("qk_dtype", ["int8", "int4"])
@pytest.mark.parametrize("granularity", ["thread", "token", "block", "tensor"])
@pytest.mark.parametrize("role", ["q", "k"])
def test_quantize_dequantize_within_half_step(qk_dtype, granularity, role):
    x = smoothed_input((2, 3, 200, 32), seed=1)
    block = 128 if role == "q" else 64
    codes, scales = ablation.quantize_rows(x, qk_dtype, granularity, role, block, warps=4)
    qmax = ref.INT_QMAX[qk_dtype]
    scales = scales.expand(2, 3, 200)[..., None]
    assert codes.abs().max() <= qmax and torch.equal(codes, codes.round())
    err = (codes * scales - x.double()).abs()
    # Round to nearest: at most half a step (plus float32 rounding of x * inv).
    assert torch.all(err <= scales * (0.5 + 1e-5))
    # The group maximum maps onto +-qmax, so the step really is amax / qmax.
    if granularity == "token":
        assert torch.all(codes.abs().amax(dim=-1) == qmax)

# ------------------------------------------------------------------------------------------
# Accuracy orderings of the paper's ablations (synthetic inputs, fixed seeds)
# ------------------------------------------------------------------------------------------

_SHAPE = (1, 4, 1024, 128)


@pytest.fixture(scope="module")
def bias4():
    q, k, v = input_family("bias4", _SHAPE, seed=0)
    return q, k, v, ref.exact_attention(q, k, v)


def test_smoothing_order_4bit(bias4):
    """Paper Table 4: Smooth Q+K > Smooth K > none (INT4 Q, K)."""
    q, k, v, want = bias4
    none = simulated_l1(q, k, v, want, qk_dtype="int4", smooth_k=False)
    only_k = simulated_l1(q, k, v, want, qk_dtype="int4", smooth_k=True)
    q_and_k = simulated_l1(q, k, v, want, qk_dtype="int4", smooth_k=True, smooth_q="block")
    assert none > 1.5 * only_k
    assert only_k > 1.5 * q_and_k


def test_head_and_block_q_smoothing_similar(bias4):
    """docs/DECISIONS.md#d4: the head mean of Q does as well as the paper's block means on bias4."""
    q, k, v, want = bias4
    block = simulated_l1(q, k, v, want, qk_dtype="int4", smooth_q="block")
    head = simulated_l1(q, k, v, want, qk_dtype="int4", smooth_q="head")
    only_k = simulated_l1(q, k, v, want, qk_dtype="int4")
    assert abs(head - block) < 0.1 * block
    assert head < 0.6 * only_k


def test_granularity_order_4bit():
    """Paper Table 6: per-thread close to per-token, better than per-block and per-tensor."""
    q, k, v = input_family("bias4", _SHAPE, seed=1)
    g = gen(21)  # tokens of different magnitude, so the granularity matters
    q = (q.float() * torch.exp(0.5 * torch.randn(*_SHAPE[:3], 1, generator=g))).half()
    k = (k.float() * torch.exp(0.5 * torch.randn(*_SHAPE[:3], 1, generator=g))).half()
    want = ref.exact_attention(q, k, v)
    err = {gr: relative_l1(ablation.sage_attention_ablation(
               q, k, v, qk_dtype="int4", smooth_q="block", granularity=gr), want)
           for gr in ablation.GRANULARITIES}
    assert err["token"] < err["thread"]
    assert err["block"] > 1.3 * err["thread"] and err["tensor"] > 1.3 * err["thread"]
    # closer to per-token than to per-block
    assert err["thread"] - err["token"] < 0.5 * (err["block"] - err["token"])


def test_e4m3_beats_e5m2(bias4):
    """Paper Table 7: E4M3 P~, V is more accurate than E5M2, and FP16 better still."""
    q, k, v, want = bias4
    e4m3 = simulated_l1(q, k, v, want, pv_dtype="e4m3")
    e5m2 = simulated_l1(q, k, v, want, pv_dtype="e5m2")
    fp16 = simulated_l1(q, k, v, want, pv_dtype="fp16")
    assert e5m2 > 1.5 * e4m3 and e4m3 > 1.5 * fp16


def test_two_level_beats_one_level():
    """Paper 3.4: with the FP22 accumulator, two-level accumulation is clearly more accurate on
    a long sequence whose V has a channel bias (uniform-ish attention, output far from 0)."""
    q, k, v = input_family("bias0", (1, 1, 4096, 128), seed=2)
    v = (v.float() + 8).half()
    want = ref.exact_attention(q, k, v)
    two = simulated_l1(q, k, v, want, two_level=True, fp22=True)
    one = simulated_l1(q, k, v, want, two_level=False, fp22=True)
    fp32 = simulated_l1(q, k, v, want, two_level=True, fp22=False)
    assert one > 2 * two
    assert two < 1.1 * fp32  # two levels recover nearly all of FP32 accumulation
    # smoothing V (paper A.3) also removes most of the FP22 loss of the one-level form
    assert simulated_l1(q, k, v, want, two_level=False, fp22=True, smooth_v=True) < 0.5 * one


def test_anchor_figures_loosely(bias4):
    """The idealised simulation of docs/PROTOCOL.md#idealised-simulation (8-bit bias4 0.9999 /
    0.012, 4-bit 0.99868 / 0.046, 4-bit + smooth Q 0.9998 / 0.018) at a quarter of the sequence
    length."""
    q, k, v, want = bias4
    kw = dict(fp22=False)
    o8 = ref.sage_attention_reference(q, k, v, qk_dtype="int8", **kw)
    o4 = ref.sage_attention_reference(q, k, v, qk_dtype="int4", **kw)
    o4s = ref.sage_attention_reference(q, k, v, qk_dtype="int4", smooth_q="block", **kw)
    assert cosine_similarity(o8, want) > 0.999 and relative_l1(o8, want) < 0.02
    assert 0.995 < cosine_similarity(o4, want) < 0.9995
    assert 0.03 < relative_l1(o4, want) < 0.07
    assert cosine_similarity(o4s, want) > 0.999 and relative_l1(o4s, want) < 0.03
    q0, k0, v0 = input_family("bias0", (1, 2, 1024, 128), seed=3)
    o = ref.sage_attention_reference(q0, k0, v0)
    assert cosine_similarity(o, ref.exact_attention(q0, k0, v0)) > 0.998
