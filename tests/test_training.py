"""Training through sageattn (issue 51, tier 1): the quantized forward with the exact backward
from its O and LSE (sageattention2._backward, registered on the graph op in _compile).

CPU (CI): the backward's formulas against float64 autograd (chunks, causal, GQA, a gradient
on the LSE), the op's autograd in every layout and rank through sageattn (its routing pretended:
the CPU runs the op's exact path, so the backward is ours on exact O and LSE), opcheck with
autograd, double backward refusing, and the calls it does not serve keeping the exact fallback.
GPU (with SAGEATTN_TRAINING=quantized, the opt-in): gradients of the quantized forward against
float64 on the protocol's input families, odd lengths, GQA, both layouts; PyTorch's kernels
against the float32 formulas.
"""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from sageattention2 import _backward, _compile, sageattn
from sageattention2.testing import cosine_similarity, make_input_family


def float64_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                  is_causal: bool = False, layout: str = "HND", dlse: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of exact attention in float64 (``dlse``: a gradient on its natural-log LSE)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(-3, -2) if layout == "NHD" else t for t in leaves)
    group = qh.shape[-3] // kh.shape[-3]
    kh, vh = kh.repeat_interleave(group, -3), vh.repeat_interleave(group, -3)
    scores = qh @ kh.transpose(-1, -2) * qh.shape[-1] ** -0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool,
                                               device=q.device).triu(1), -torch.inf)
    out = torch.softmax(scores, -1) @ vh
    out = out.transpose(-3, -2) if layout == "NHD" else out
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (scores.logsumexp(-1) * dlse.double()).sum()
    loss.backward()
    return tuple(t.grad for t in leaves)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), (err, want.abs().max().item())


# ------------------------------------------------------------------------------------------------
# CPU: the exact path
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_backward_formulas_match_float64(monkeypatch: pytest.MonkeyPatch, is_causal: bool,
                                         group: int, with_dlse: bool) -> None:
    """_backward's float32 formulas from exact O and LSE, a few queries per chunk (so the
    chunks' seams are crossed), against float64 autograd; odd lengths, channel offsets."""
    monkeypatch.setattr(_backward, "_MATH_CHUNK", 16)
    torch.manual_seed(1)
    b, h, n, d = 2, 6, 37, 24
    q = torch.randn(b, h, n, d) + 2 * torch.randn(b, h, 1, d)
    k = torch.randn(b, h // group, n, d) + 3 * torch.randn(b, h // group, 1, d)
    v = torch.randn(b, h // group, n, d)
    dout = torch.randn(b, h, n, d)
    dlse = torch.randn(b, h, n) if with_dlse else None
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q.double() @ kk.double().transpose(-1, -2)) * d ** -0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    out, lse = (torch.softmax(scores, -1) @ vv.double()).float(), scores.logsumexp(-1).float()
    got = _backward.attention_backward(dout, q, k, v, out, lse, is_causal, None, dlse)
    for g, w in zip(got, float64_grads(q, k, v, dout, is_causal, dlse=dlse)):
        assert g.shape == w.shape and g.dtype == torch.float32
        close(g, w, 1e-5)


@pytest.fixture
def routed_to_the_op(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """sageattn sends training calls to the graph op as it does where the quantized kernel runs
    (on the CPU the op computes exact attention: O and LSE exact, the backward ours)."""
    seen: list[Any] = []

    def trainable(call: Any) -> bool:
        seen.append(call)
        return _backward.refusal(call) is None

    monkeypatch.setattr(_compile, "trainable", trainable)
    return seen


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("is_causal", [False, True])
def test_op_gradients_on_the_cpu(routed_to_the_op: list[Any], layout: str, rank: int,
                                 is_causal: bool) -> None:
    torch.manual_seed(2)
    shape = (2, 4, 21, 16) if layout == "HND" else (2, 21, 4, 16)
    q, k, v = (torch.randn(shape) for _ in range(3))
    if rank == 3:
        q, k, v = q[0], k[0], v[0]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sageattn(*leaves, is_causal=is_causal, tensor_layout=layout)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert routed_to_the_op, "sageattn did not route the training call"
    for leaf, want in zip(leaves, float64_grads(q, k, v, dout, is_causal, layout)):
        close(leaf.grad, want, 1e-5)


def test_op_gradients_with_gqa_and_the_lse(routed_to_the_op: list[Any]) -> None:
    """enable_gqa (dK, dV summed over each group) and a loss that uses the returned LSE."""
    torch.manual_seed(3)
    q = torch.randn(1, 6, 19, 8)
    k, v = torch.randn(1, 2, 19, 8), torch.randn(1, 2, 19, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = sageattn(*leaves, enable_gqa=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    for leaf, want in zip(leaves, float64_grads(q, k, v, dout, dlse=dlse)):
        close(leaf.grad, want, 1e-5)


def test_opcheck_with_autograd() -> None:
    """torch.library.opcheck of the graph op on inputs that require grad: the autograd
    registration, the fake, and AOT dispatch."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.sageattention2.sageattn.default,
                          (q, k, v, None, 0.0, True, None, False, "HND", "auto", "auto", True,
                           "auto", False, True, False, "top_left"))


def test_double_backward_refuses(routed_to_the_op: list[Any]) -> None:
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    out = sageattn(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


def test_training_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SAGEATTN_TRAINING=quantized, calls that require grad run exact SDPA (the bar on
    every family is not met yet); a value it does not know is refused by name."""
    from sageattention2._call import validate

    q = torch.randn(1, 2, 9, 8, requires_grad=True)
    call = validate(q, q, q, None, 0.0, False, None, False, "HND", "auto", "auto", True, "auto",
                    "auto", False, False)
    monkeypatch.delenv("SAGEATTN_TRAINING", raising=False)
    assert _backward.training_mode() == "exact" and not _compile.trainable(call)
    monkeypatch.setenv("SAGEATTN_TRAINING", "fast")
    with pytest.raises(ValueError, match="SAGEATTN_TRAINING must be one of exact, quantized, got 'fast'"):
        _compile.trainable(call)


def test_calls_it_does_not_serve_stay_exact(routed_to_the_op: list[Any]) -> None:
    """A key mask under grad: the exact fallback (differentiable), with the reason named."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    mask = torch.rand(1, 1, 1, 9) > 0.3
    mask[..., 0] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = sageattn(*leaves, attn_mask=mask)
    out.sum().backward()
    want = [t.clone().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*want, attn_mask=mask).sum().backward()
    for leaf, w in zip(leaves, want):
        close(leaf.grad, w.grad, 1e-5)
    assert _backward.refusal(routed_to_the_op[-1]) == "an attn_mask (the backward takes no mask yet)"


# ------------------------------------------------------------------------------------------------
# GPU: the quantized forward, PyTorch's backward kernels
# ------------------------------------------------------------------------------------------------

def counted_quantized_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from sageattention2 import _execute

    calls: list[int] = []
    real = _execute.quantized

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_execute, "quantized", counted)
    return calls


@pytest.fixture
def quantized_training(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SAGEATTN_TRAINING=quantized, and a count of the quantized kernel's calls."""
    monkeypatch.setenv("SAGEATTN_TRAINING", "quantized")
    return counted_quantized_calls(monkeypatch)


def family_gradients(family: str, is_causal: bool, dtype: torch.dtype,
                     quantized: list[int]) -> dict[str, float]:
    torch.manual_seed(6)
    q, k, v = make_input_family(family, (1, 8, 2048 + 37, 128), dtype, "cuda")
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sageattn(*leaves, is_causal=is_causal).backward(dout)
    assert quantized, "the forward did not run the quantized kernel"
    cos = {}
    for name, leaf, want in zip("qkv", leaves, float64_grads(q, k, v, dout, is_causal)):
        assert leaf.grad.dtype == dtype and torch.isfinite(leaf.grad).all()
        cos[name] = cosine_similarity(leaf.grad, want)
    print(f"{family} causal={is_causal} {dtype}: " + ", ".join(f"d{n} CosSim {c:.6f}" for n, c in cos.items()))
    return cos


# The open gap of issue 51 (session 40, H200): D = rowsum(dO * O) from the FP8-PV forward's O
# carries its error into dS, and K's channel offsets amplify it in dQ (the backward's K-centering
# took dQ from 0.78 to 0.99 on bias4). Measured CosSim dq / dk / dv: bias4 0.991 / 0.995-0.998 /
# 0.9995, outliers 0.88-0.90 / 0.93-0.94 / 0.95-0.96. With the forward's PV in 16 bits bias4
# reaches 0.99906 / 0.99930 / 0.99949; on outliers even exact O and LSE in bf16 give 0.987 /
# 0.993 / 0.992 through the same kernels (SDPA's own precision). Strict: a fix must lift them.
SHORT = pytest.mark.xfail(strict=True, reason="issue 51's open gap: K-offset families")
OFFSET_FAMILIES = ["bias0", pytest.param("bias4", marks=SHORT), pytest.param("outliers", marks=SHORT)]


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dk_dv_on_the_families(attention_kernel: None, quantized_training: list[int],
                               family: str, is_causal: bool, dtype: torch.dtype) -> None:
    """dK and dV through the quantized forward against float64 attention's: CosSim >= 0.999 (the
    issue's bar; met on bias0, short on the K-offset families: SHORT); the forward ran the
    quantized kernel."""
    cos = family_gradients(family, is_causal, dtype, quantized_training)
    assert cos["k"] >= 0.999 and cos["v"] >= 0.999, cos


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dq_on_the_families(attention_kernel: None, quantized_training: list[int],
                            family: str, is_causal: bool, dtype: torch.dtype) -> None:
    cos = family_gradients(family, is_causal, dtype, quantized_training)
    assert cos["q"] >= 0.999, cos


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gradients_with_gqa_and_head_dim_64(attention_kernel: None, quantized_training: list[int],
                                           layout: str) -> None:
    torch.manual_seed(7)
    shape_q, shape_kv = (2, 8, 1000, 64), (2, 2, 1000, 64)
    if layout == "NHD":
        shape_q, shape_kv = (2, 1000, 8, 64), (2, 1000, 2, 64)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sageattn(*leaves, enable_gqa=True, tensor_layout=layout).backward(dout)
    assert quantized_training
    for leaf, want in zip(leaves, float64_grads(q, k, v, dout, layout=layout)):
        assert cosine_similarity(leaf.grad, want) >= 0.999


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pytorch_kernels_match_the_formulas(attention_kernel: None, head_dim: int) -> None:
    """cuDNN's (head_dim <= 128) or FlashAttention-2's backward kernel on our O and LSE gives
    the float32 formulas' gradients (the LSE's convention and the operands' layouts agree)."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 4, 777, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    out, lse = sageattn(q, k, v, is_causal=True, return_lse=True)
    dout = torch.randn_like(out)
    got = _backward._pytorch_kernels(dout, q, k, v, out, lse, True, head_dim ** -0.5)
    want = _backward._chunked(dout, q, k, v, out, lse, True, head_dim ** -0.5, None)
    for g, w in zip(got, want):
        assert cosine_similarity(g, w.double()) >= 0.9999
