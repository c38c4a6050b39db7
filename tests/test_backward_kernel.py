"""Our exact attention backward kernel (csrc/hopper/backward, opt-in: SAGEATTN_BACKWARD_KERNEL=wgmma)
against _backward's float32 formulas on the same O and LSE (odd lengths, causal, both dtypes,
offsets), a training call through it against float64 autograd, its refusals."""
from __future__ import annotations

import math

import pytest
import torch

from sageattention2 import _backward, ops
from sageattention2.testing import cosine_similarity, make_input_family, poison_cuda_allocator

from sageattention2 import sageattn

GPU = pytest.mark.gpu


def own_kernel_built() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the backward kernel runs on sm_90 only")
    if not ops.has_op("attention_backward_wgmma"):
        pytest.skip("the build has no attention_backward_wgmma")


def exact_out_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if is_causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -torch.inf)
    return (torch.softmax(scores, -1) @ v.double()).to(q.dtype), scores.logsumexp(-1).float()


@GPU
@pytest.mark.parametrize("n", [128, 1000, 2085])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["bias0", "bias4"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_kernel_matches_the_formulas(wgmma_kernel: None, n: int, is_causal: bool,
                                     dtype: torch.dtype, family: str, kv_heads: int) -> None:
    """dQ, dK, dV of the kernel against the formulas in float32 on the same O, LSE and centered
    K; with kv_heads 2, GQA (dK and dV summed over each group of 2 query heads)."""
    own_kernel_built()
    torch.manual_seed(n + kv_heads)
    q, k, v = make_input_family(family, (2, 4, n, 128), dtype, "cuda")
    k, v = k[:, :kv_heads].contiguous(), v[:, :kv_heads].contiguous()
    dout = torch.randn_like(q)
    k_all, v_all = (t.repeat_interleave(4 // kv_heads, dim=1) for t in (k, v))
    out, lse = exact_out_lse(q, k_all, v_all, is_causal)
    scale = 128 ** -0.5
    # The op subtracts the float32 k_mean from K (each difference rounded once to the dtype:
    # dQ's operand) and shifts the LSE to match: the formulas run on the same centered K and
    # shifted LSE.
    k_mean = k.mean(2, keepdim=True, dtype=torch.float32)
    mean_all = k_mean.repeat_interleave(4 // kv_heads, dim=1)
    lse_centered = lse - scale * (q.float() @ mean_all.transpose(-1, -2)).squeeze(-1)
    k_centered = (k_all.float() - mean_all).to(dtype)
    want = list(_backward._chunked(dout, q, k_centered, v_all, out, lse_centered, is_causal, scale,
                                   None, None))
    want[1:] = [w.float().view(2, kv_heads, 4 // kv_heads, *w.shape[2:]).sum(2) for w in want[1:]]
    poison_cuda_allocator()  # an element the kernels leave unwritten comes out NaN
    got = _backward._wgmma_kernel(dout, q, k, v, out, lse, k_mean, is_causal, scale)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype and g.shape == w.shape and torch.isfinite(g).all(), name
        assert cosine_similarity(g, w) >= 0.9999, (name, cosine_similarity(g, w))


def float64_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                      is_causal: bool) -> list[torch.Tensor]:
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(groups, dim=1) for t in leaves[1:])
    scores = (leaves[0] @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if is_causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -torch.inf)
    (torch.softmax(scores, -1) @ vv).backward(dout.double())
    return [t.grad for t in leaves]


@GPU
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("family", ["bias0", "bias4"])
def test_training_through_the_own_kernel(wgmma_kernel: None, monkeypatch: pytest.MonkeyPatch,
                                         family: str, is_causal: bool) -> None:
    """SAGEATTN_BACKWARD_KERNEL=wgmma: a training call (GQA, odd length) takes its gradients from
    our kernel, CosSim >= 0.999 against float64 autograd."""
    own_kernel_built()
    monkeypatch.setenv("SAGEATTN_TRAINING", "quantized")
    monkeypatch.setenv(_backward._OWN_KERNEL_ENVIRONMENT, "wgmma")
    calls: list[int] = []
    real = _backward._wgmma_kernel

    def counted(*args: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_backward, "_wgmma_kernel", counted)
    torch.manual_seed(11)
    q, k, v = make_input_family(family, (2, 8, 1531, 128), torch.bfloat16, "cuda")
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sageattn(*leaves, is_causal=is_causal, enable_gqa=True).backward(dout)
    assert calls, "the own kernel did not run"
    for name, leaf, want in zip("qkv", leaves, float64_gradients(q, k, v, dout, is_causal)):
        assert leaf.grad.shape == want.shape and torch.isfinite(leaf.grad).all(), name
        assert cosine_similarity(leaf.grad, want) >= 0.999, (name, cosine_similarity(leaf.grad, want))


@GPU
def test_the_op_refuses_what_it_does_not_serve(wgmma_kernel: None) -> None:
    own_kernel_built()
    q = torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.zeros(1, 4, 64, device="cuda")
    mean = q[:, :, :1].float()
    op = torch.ops.sageattention2.attention_backward_wgmma
    with pytest.raises(RuntimeError, match="k must be .* 128"):
        op(q, q[..., :64].contiguous(), q[..., :64].contiguous(), q, q, lse, mean, 0.1, False)
    with pytest.raises(RuntimeError, match="dout must have q's dtype"):
        op(q, q, q, q, q.half(), lse, mean, 0.1, False)
    with pytest.raises(RuntimeError, match="k's heads .3. must divide q's .4."):
        op(q, q[:, :3].contiguous(), q[:, :3].contiguous(), q, q, lse, mean, 0.1, False)
    with pytest.raises(RuntimeError, match="is_causal needs as many queries as keys"):
        op(q, q[:, :, :32].contiguous(), q[:, :, :32].contiguous(), q, q, lse, mean, 0.1, True)
    with pytest.raises(RuntimeError, match="lse must be a contiguous float32"):
        op(q, q, q, q, q, lse[..., :32], mean, 0.1, False)
    with pytest.raises(RuntimeError, match=r"k_mean must be a contiguous \[1, 4, 1, 128\] float32 tensor"):
        op(q, q, q, q, q, lse, mean.to(q.dtype), 0.1, False)
    with pytest.raises(RuntimeError, match=r"k_mean must be a contiguous \[1, 4, 1, 128\]"):
        op(q, q, q, q, q, lse, q[:, :, :2].float(), 0.1, False)


def test_the_own_kernel_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only with SAGEATTN_BACKWARD_KERNEL=wgmma, on an sm_90 GPU, and on the calls it serves does
    our kernel run the backward (else PyTorch's kernel or the formulas do)."""
    q = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 16, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(_backward, "_own_kernel_runs_on", lambda device: True)
    monkeypatch.delenv(_backward._OWN_KERNEL_ENVIRONMENT, raising=False)
    assert not _backward._own_kernel(q, k, None, None, False)
    monkeypatch.setenv(_backward._OWN_KERNEL_ENVIRONMENT, "wgmma")
    assert _backward._own_kernel(q, k, None, None, False)
    assert not _backward._own_kernel(q, k, None, None, True)  # causal, lengths differ
    assert not _backward._own_kernel(q[..., :64], k[..., :64], None, None, False)
    assert not _backward._own_kernel(q.float(), k.float(), None, None, False)
    assert not _backward._own_kernel(q, k, torch.zeros(8, 16), None, False)
    assert not _backward._own_kernel(q, k, None, torch.zeros(1, 2, 8), False)
    monkeypatch.setattr(_backward, "_own_kernel_runs_on", lambda device: False)
    assert not _backward._own_kernel(q, k, None, None, False)
    monkeypatch.undo()
    monkeypatch.setenv(_backward._OWN_KERNEL_ENVIRONMENT, "wgmma")
    assert not _backward._own_kernel_runs_on(q.device)  # a CPU tensor
