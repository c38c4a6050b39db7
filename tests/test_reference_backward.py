"""The 8-bit backward's reference (sageattention2/reference_backward.py): its exact path equals
_backward's formulas, its INT8 products keep the gradients on the input families at the tier's
bar, and its scales have the granularity the kernel will use (CPU)."""
from __future__ import annotations

import pytest
import torch

from sageattention2 import _backward
from sageattention2.reference_backward import (BLOCK_Q, backward_8bit_reference,
                                               product_int8_per_block, scores_int8)
from sageattention2.testing import cosine_similarity, make_input_family

SCALE = 128 ** -0.5


def exact_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Exact attention in float64: O (a graph whose backward fills the leaves' gradients), the
    LSE, and the leaves (q, k, v in float64)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) * SCALE
    if is_causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    out = torch.softmax(scores, -1) @ leaves[2]
    return out, scores.logsumexp(-1).detach(), leaves


def centered(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K minus its mean and the LSE shifted, as _backward hands them to a kernel."""
    mean = k.mean(dim=2, keepdim=True, dtype=torch.float32).to(k.dtype)
    return k - mean, lse - SCALE * (q.double() @ mean.double().transpose(-1, -2)).squeeze(-1)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_exact_path_is_the_backward_formulas(is_causal: bool) -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 150, 128, dtype=torch.float64) for _ in range(3))
    dout = torch.randn_like(q)
    out, lse, _ = exact_forward(q, k, v, is_causal)
    got = backward_8bit_reference(dout, q, k, v, out.detach(), lse, is_causal, SCALE,
                                  scores=False, dv=False, dk=False)
    want = _backward._chunked(dout, q, k, v, out.detach(), lse, is_causal, SCALE, None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


# CosSim against float64 autograd, from the exact O (rounded to bf16) and LSE, all three products
# in INT8 (session 43, B1 H4 N1029: bias0 0.99996 / 0.99987 / 0.99988, bias4 0.99988 / 0.99979 /
# 0.99992; outliers 0.935 / 0.963 / 0.963 from S^T alone: the training guard's family, D52;
# session 44's per-head channel scales for dO and Q: dK and dV within 2e-5 of those).
@pytest.mark.parametrize("family", ["bias0", "bias4"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_int8_products_on_the_families(family: str, is_causal: bool) -> None:
    torch.manual_seed(2)
    q, k, v = make_input_family(family, (1, 2, 333, 128), torch.bfloat16, "cpu")
    dout = torch.randn_like(q)
    out, lse, leaves = exact_forward(q, k, v, is_causal)
    out.backward(dout.double())
    k_centered, lse_centered = centered(q, k, lse)
    got = backward_8bit_reference(dout, q, k_centered, v, out.detach().to(q.dtype), lse_centered,
                                  is_causal, SCALE)
    for name, g, leaf in zip("qkv", got, leaves):
        assert cosine_similarity(g, leaf.grad) >= 0.9995, (name, cosine_similarity(g, leaf.grad))


def test_the_block_scales_keep_a_key_small_in_one_block() -> None:
    """One scale per key and 64-query block: a key whose P is 1e-4 in one block and 1 in another
    keeps its small block (a scale per key over all queries would round it to zero). The right
    operand's second block is its first negated: one channel scale serves each block alone and
    both together, so the product of both is the sum of the blocks'."""
    torch.manual_seed(3)
    n_q, n_k = 2 * BLOCK_Q, 8
    left = torch.rand(1, 1, n_q, n_k, dtype=torch.float64)
    left[:, :, :BLOCK_Q] *= 1e-4
    right = torch.randn(1, 1, BLOCK_Q, 16, dtype=torch.float64)
    right = torch.cat([right, -right], dim=2)
    first = product_int8_per_block(left[:, :, :BLOCK_Q], right[:, :, :BLOCK_Q])
    want = left[:, :, :BLOCK_Q].transpose(-1, -2) @ right[:, :, :BLOCK_Q]
    assert cosine_similarity(first, want) >= 0.9999
    both = product_int8_per_block(left, right)
    assert torch.allclose(both, first + product_int8_per_block(left[:, :, BLOCK_Q:], right[:, :, BLOCK_Q:]))


def test_the_channel_scales_span_all_tokens() -> None:
    """dO's (and Q's) scale per channel is over every token, not per block: a channel whose values
    are 1e-3 in one block and 1 in another is quantized at the large block's scale (one scale per
    block would keep the small block's 1e-3 exactly)."""
    left = torch.ones(1, 1, 2 * BLOCK_Q, 1, dtype=torch.float64)
    right = torch.full((1, 1, 2 * BLOCK_Q, 1), 1e-3, dtype=torch.float64)
    right[:, :, BLOCK_Q:] = 1.0
    # 1e-3 at the scale 1/127 is code 0: the small block adds nothing (per-block scales: 64.064)
    assert float(product_int8_per_block(left, right)) == pytest.approx(BLOCK_Q * 1.0, rel=1e-6)


def test_the_scores_are_smoothed() -> None:
    """Q with a large common offset: the INT8 scores stay close, since the offset's scores are
    exact (measured: 0.0009 of the scores' spread; without the smoothing 0.014)."""
    torch.manual_seed(4)
    q = torch.randn(1, 1, 200, 128) + 20.0 * torch.randn(1, 1, 1, 128)
    k = torch.randn(1, 1, 90, 128)
    exact = q.double() @ k.double().transpose(-1, -2)
    error = (scores_int8(q, k) - exact).abs().max() / (exact - exact.mean(-1, keepdim=True)).abs().max()
    assert error < 0.003, float(error)
