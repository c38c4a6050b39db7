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
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from sageattention2 import _backward, _compile, ops, sageattn
from sageattention2.testing import cosine_similarity, make_input_family, poison_cuda_allocator


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

    def training_call(call: Any) -> Any:
        seen.append(call)
        return call if _backward.refusal(call) is None else None

    monkeypatch.setattr(_compile, "training_call", training_call)
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


def test_compiled_training_step_on_the_cpu(routed_to_the_op: list[Any]) -> None:
    """torch.compile(fullgraph=True) of a step through sageattn: the graph op and its backward
    traced without a break, gradients equal to float64 autograd's."""
    torch.manual_seed(10)
    q, k, v = (torch.randn(1, 2, 23, 8) for _ in range(3))
    dout = torch.randn(1, 2, 23, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    step = torch.compile(lambda a, b, c: (sageattn(a, b, c, is_causal=True) * dout).sum(),
                         fullgraph=True)
    step(*leaves).backward()
    assert routed_to_the_op
    for leaf, want in zip(leaves, float64_grads(q, k, v, dout, True)):
        close(leaf.grad, want, 1e-5)


def test_opcheck_of_the_backward_op() -> None:
    """torch.library.opcheck of sageattention2::attention_backward (the autograd formula's one
    opaque op under torch.compile), and its real outputs in its fake's strides (which opcheck
    does not compare; inductor reads the outputs in them)."""
    torch.manual_seed(12)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    out, lse = (torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9))
    nhd = torch.randn(1, 9, 2, 8).transpose(1, 2)
    # GQA with K and V in NHD memory: the summed groups come out contiguous, K's strides differ
    q4, out4, lse4 = torch.randn(1, 4, 9, 8), torch.randn(1, 4, 9, 8), torch.randn(1, 4, 9)
    k_nhd, v_nhd = (torch.randn(1, 9, 2, 8).transpose(1, 2) for _ in range(2))
    for args in ((torch.randn_like(out), q, k, v, out, lse, None, None, True, None),
                 (torch.randn_like(out), nhd, k, v, out, lse, torch.randn(1, 2, 9),
                  torch.rand(1, 1, 1, 9) > 0.2, False, 0.5),
                 (torch.randn_like(out4), q4, k_nhd, v_nhd, out4, lse4, None, None, False, None)):
        torch.library.opcheck(torch.ops.sageattention2.attention_backward.default, args)
        grads = torch.ops.sageattention2.attention_backward(*args)
        assert [g.stride() for g in grads] == [torch.empty_like(t).stride() for t in args[1:4]]


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
    assert _backward.training_mode() == "exact" and _compile.training_call(call) is None
    monkeypatch.setenv("SAGEATTN_TRAINING", "fast")
    with pytest.raises(ValueError, match="SAGEATTN_TRAINING must be one of exact, quantized, got 'fast'"):
        _compile.training_call(call)


def guard_call(family: str, dtype: torch.dtype = torch.float32) -> Any:
    from sageattention2._call import validate

    torch.manual_seed(3)
    q, k, v = make_input_family(family, (2, 4, 1029, 64), dtype, "cpu")
    q.requires_grad_()
    return validate(q, k, v, None, 0.0, False, None, False, "HND", "int8", "auto", True, "auto",
                    "auto", False, False)


def test_training_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training guard (D52): a call the kernel would run is measured once (a statistics pass
    over q and one over k; on the CPU read at once); with outliers' wide channels it runs exact
    SDPA, and the fallback's reason (explain, the warning) names the spread; bias0 and bias4 keep
    the kernel; a kind of call stays exact once tripped, without measuring again; the threshold
    is the environment's, "off" turns it off, and a bad value is refused by name."""
    from sageattention2._plan import CALL_RULES

    monkeypatch.setenv("SAGEATTN_TRAINING", "quantized")
    monkeypatch.delenv("SAGEATTN_TRAINING_GUARD", raising=False)
    monkeypatch.setattr(_compile, "decide", lambda call: SimpleNamespace(quantized=True))  # GPU's
    measured: list[int] = []
    real_spread = ops.head_channel_spread
    monkeypatch.setattr(ops, "head_channel_spread", lambda *a: measured.append(1) or real_spread(*a))
    for family in ("bias0", "bias4"):
        call = guard_call(family)
        assert _compile.training_call(call) is not None and _backward.guard_verdict(call) is None
    outliers = guard_call("outliers")
    assert _compile.training_call(outliers) is None
    verdict = _backward.guard_verdict(outliers)
    assert verdict is not None and verdict.startswith(
        "q or k with a channel spread above the training guard's 3.5 (")
    assert real_spread(outliers.q).amax() > 5.0
    assert len(measured) == 6  # q and k of each call, once: the verdict is kept
    assert _backward.guard(outliers) == verdict and len(measured) == 6
    assert _backward.guard_verdict(guard_call("outliers")) is None  # another call: not asked
    assert _compile.training_call(guard_call("bias0")) is None and len(measured) == 6  # tripped
    (grad_rule,) = [rule for rule in CALL_RULES if "training guard" in rule.when]
    assert verdict in grad_rule.message(outliers)
    _backward.reset_guard()
    wide_q = guard_call("bias0")
    with torch.no_grad():
        wide_q.q[..., :3] *= 12  # q's channels alone
    assert _compile.training_call(wide_q) is None and _backward.guard_verdict(wide_q)
    monkeypatch.setenv("SAGEATTN_TRAINING_GUARD", "20")
    assert _compile.training_call(guard_call("outliers")) is not None
    monkeypatch.setenv("SAGEATTN_TRAINING_GUARD", "off")
    assert _backward.training_guard() == 0.0
    assert _compile.training_call(guard_call("outliers")) is not None
    monkeypatch.setenv("SAGEATTN_TRAINING_GUARD", "0.5")
    with pytest.raises(ValueError, match="SAGEATTN_TRAINING_GUARD must be 'off' or a number >= 1"):
        _compile.training_call(guard_call("bias0"))


class InFlightSpread:
    """A stand-in for _backward._Spread on a GPU: its copy lands when the test says so."""

    landed = False
    waited: list[float] = []

    def __init__(self, q: torch.Tensor, k: torch.Tensor) -> None:
        with torch.no_grad():
            self.spread = float(torch.stack([ops.head_channel_spread(x).amax() for x in (q, k)]).amax())

    def ready(self) -> bool:
        return InFlightSpread.landed

    def value(self) -> float:
        if not InFlightSpread.landed:
            InFlightSpread.waited.append(self.spread)
        return self.spread


def test_training_guard_waits_only_for_a_kinds_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the guard reads a call's statistic without waiting for the queue (D52, session
    45): the first call of a kind waits for its own; later ones are decided by what has landed,
    so an outliers call after bias0 runs the kernel until its measurement lands, and from then
    on the kind runs exact SDPA; more than _MAX_PENDING unread measurements wait for the oldest."""
    monkeypatch.setenv("SAGEATTN_TRAINING", "quantized")
    monkeypatch.delenv("SAGEATTN_TRAINING_GUARD", raising=False)
    monkeypatch.setattr(_compile, "decide", lambda call: SimpleNamespace(quantized=True))  # GPU's
    monkeypatch.setattr(_backward, "_Spread", InFlightSpread)
    monkeypatch.setattr(InFlightSpread, "landed", False)
    monkeypatch.setattr(InFlightSpread, "waited", [])
    assert _compile.training_call(guard_call("bias0")) is not None
    assert len(InFlightSpread.waited) == 1  # the kind's first call waited for its own
    assert _compile.training_call(guard_call("outliers")) is not None  # in flight: not waited for
    assert len(InFlightSpread.waited) == 1
    monkeypatch.setattr(InFlightSpread, "landed", True)
    late = guard_call("bias0")
    assert _compile.training_call(late) is None and _backward.guard_verdict(late)  # the kind tripped
    _backward.reset_guard()
    monkeypatch.setattr(InFlightSpread, "landed", False)
    for _ in range(1 + _backward._MAX_PENDING + 2):  # the first, a full queue, two more
        assert _compile.training_call(guard_call("bias0")) is not None
    assert len(InFlightSpread.waited) == 1 + 1 + 1  # the first call, then the oldest beyond the cap


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_op_gradients_with_a_mask(routed_to_the_op: list[Any], kind: str) -> None:
    """Key-padding masks (one batch row's last keys, and a query row that sees no key: zero
    gradients, not NaN) and an additive float mask, through the op's backward; dropout stays
    exact."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 3, 13, 8) for _ in range(3))
    if kind == "bool":
        mask = torch.ones(2, 1, 13, 13, dtype=torch.bool)
        mask[1, :, :, 9:] = False
        mask[0, :, 4] = False
    else:
        mask = torch.randn(2, 3, 13, 13)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sageattn(*leaves, attn_mask=mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert _backward.refusal(routed_to_the_op[-1]) is None
    want = [t.clone().double().requires_grad_() for t in (q, k, v)]
    # (the float64 reference takes the mask in float64: PyTorch's CPU kernel gets a float32 mask
    # beside float64 inputs wrong on AVX2 hosts)
    exact = F.scaled_dot_product_attention(*want, attn_mask=mask.double() if kind == "float" else mask)
    (exact.nan_to_num() * dout.double()).sum().backward()
    for leaf, w in zip(leaves, want):
        assert torch.isfinite(leaf.grad).all()
        close(leaf.grad, w.grad.nan_to_num(), 1e-5)


def test_calls_it_does_not_serve_stay_exact(routed_to_the_op: list[Any]) -> None:
    """A float mask that requires grad: the exact fallback (differentiable, the mask's gradient
    too), with the reason named."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    mask = torch.randn(1, 1, 9, 9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = sageattn(*leaves[:3], attn_mask=leaves[3])
    out.sum().backward()
    want = [t.clone().double().requires_grad_() for t in (q, k, v, mask)]
    F.scaled_dot_product_attention(*want[:3], attn_mask=want[3]).sum().backward()
    for leaf, w in zip(leaves, want):
        close(leaf.grad, w.grad, 1e-5)
    assert _backward.refusal(routed_to_the_op[-1]) == (
        "an attn_mask that requires grad (the backward gives no mask gradient)")


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
    # The outliers family's wide channels trip the training guard (D52): exact SDPA, unless off.
    guarded = family == "outliers" and _backward.training_guard() != 0.0
    assert bool(quantized) != guarded, (family, "the quantized kernel ran" if quantized else
                                        "the quantized kernel did not run")
    cos = {}
    for name, leaf, want in zip("qkv", leaves, float64_grads(q, k, v, dout, is_causal)):
        assert leaf.grad.dtype == dtype and torch.isfinite(leaf.grad).all()
        cos[name] = cosine_similarity(leaf.grad, want)
    print(f"{family} causal={is_causal} {dtype}: " + ", ".join(f"d{n} CosSim {c:.6f}" for n, c in cos.items()))
    return cos


# The open gap of issue 51 (session 41, H200, this shape, non-causal; CosSim dq / dk / dv):
# training runs PV in 16 bits (D51), which lifts bias4 over the bar (0.99908 / 0.99928 / 0.99946;
# FP8 PV 0.991 / 0.997 / 0.9995; SDPA's own bf16 gradients 0.9956 / 0.99998 / 1.0). On outliers
# INT8 QK's LSE error (it scales P in the backward: dV 0.954) and O's error give 0.90 / 0.94 /
# 0.954 where SDPA's own give 0.99984 / 0.99998 / 1.0. Session 42's float64 emulation: the LSE
# corrected at each row's top keys (or the exact LSE) lifts dV to 1.0 but leaves dQ at 0.85 and dK
# at 0.98, since D = rowsum(dO * O) carries O's error and a peaked row's dS is as small as that
# error; only an exact pass (exact LSE and D) meets the bar. The training guard (D52) sends that
# family to exact SDPA; with the guard off the kernel's gap shows (strict: a fix must lift it).
SHORT = pytest.mark.xfail(strict=True, reason="issue 51's open gap: the kernel on the outliers "
                                             "family (the training guard sends it to exact SDPA)")
OFFSET_FAMILIES = ["bias0", "bias4", "outliers"]


@pytest.mark.parametrize("is_causal", [False, True])
@SHORT
def test_the_kernel_alone_on_outliers(attention_kernel: None, quantized_training: list[int],
                                      monkeypatch: pytest.MonkeyPatch, is_causal: bool) -> None:
    """With the training guard off the quantized forward runs on the outliers family, whose
    gradients miss the bar (0.90 / 0.94 / 0.95)."""
    monkeypatch.setenv("SAGEATTN_TRAINING_GUARD", "off")
    cos = family_gradients("outliers", is_causal, torch.bfloat16, quantized_training)
    assert min(cos.values()) >= 0.999, cos


@pytest.mark.parametrize("family", OFFSET_FAMILIES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dk_dv_on_the_families(attention_kernel: None, quantized_training: list[int],
                               family: str, is_causal: bool, dtype: torch.dtype) -> None:
    """dK and dV against float64 attention's: CosSim >= 0.999 (the issue's bar), through the
    quantized forward on bias0 and bias4, through exact SDPA on outliers (the training guard)."""
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


def test_gradients_with_a_key_padding_mask(attention_kernel: None,
                                           quantized_training: list[int]) -> None:
    """A key-padding mask (batch items with 1500, 777 and 1 key, odd lengths): the quantized
    forward, cuDNN's backward with the mask as its bias; keys a mask hides get zero dK and dV.
    (A query that sees no key: the CPU test; the quantized kernel does not take such a mask.)"""
    torch.manual_seed(9)
    n = 1537
    q, k, v = (torch.randn(3, 8, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lengths = torch.tensor([1500, 777, 1], device="cuda")
    mask = (torch.arange(n, device="cuda") < lengths[:, None])[:, None, None, :]
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sageattn(*leaves, attn_mask=mask).backward(dout)
    assert quantized_training
    want = [t.clone().double().requires_grad_() for t in (q, k, v)]
    exact = F.scaled_dot_product_attention(*want, attn_mask=mask)
    (exact * dout.double()).sum().backward()
    for leaf, w in zip(leaves, want):
        assert torch.isfinite(leaf.grad).all()
        assert cosine_similarity(leaf.grad, w.grad) >= 0.999
    hidden = ~mask[:, 0, 0, :, None].expand(3, n, 128)
    for leaf in leaves[1:]:
        assert not leaf.grad.transpose(0, 1)[:, hidden].any()


def test_training_runs_pv_in_16_bits(attention_kernel: None, quantized_training: list[int]) -> None:
    """pv_quant="auto" trains with PV in the input dtype (D51: FP8 PV's O error reaches every
    gradient through D = rowsum(dO * O)); an explicit "fp8" is kept."""
    from sageattention2 import explain

    q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert explain(q, q, q, qk_quant="int8").pv == "input"
    assert explain(q, q, q, qk_quant="int8", pv_quant="fp8").pv == "fp8"
    with torch.no_grad():
        assert explain(q, q, q, qk_quant="int8").pv == "fp8"


@pytest.mark.parametrize("is_causal", [False, True])
def test_compiled_training_step(attention_kernel: None, quantized_training: list[int],
                                is_causal: bool) -> None:
    """A compiled step (inductor, fullgraph) through sageattn: the quantized forward ran and the
    gradients are eager's (session 40 saw NaN here before the backward's rewrite)."""
    torch.manual_seed(11)
    q, k, v = (torch.randn(2, 4, 1037, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    dout = torch.randn_like(q)

    def step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (sageattn(a, b, c, is_causal=is_causal, qk_quant="int8").float() * dout).sum()

    eager = grads_of(step, q, k, v)
    assert quantized_training
    torch._dynamo.reset()
    compiled = grads_of(torch.compile(step, fullgraph=True), q, k, v)
    for got, want in zip(compiled, eager):
        assert torch.isfinite(got).all()
        assert cosine_similarity(got, want.double()) >= 0.99999


def test_compiled_training_step_with_a_mask(attention_kernel: None,
                                            quantized_training: list[int]) -> None:
    """Under torch.compile a training call with a mask keeps the exact fallback
    (``_compile.training_call``: the op's exact path would take the LSE in float64): the compiled
    step (fullgraph) traces, the kernel does not run, and the gradients are SDPA's."""
    torch.manual_seed(12)
    q, k, v = (torch.randn(2, 4, 1037, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    mask = torch.ones(2, 1, 1, 1037, device="cuda", dtype=torch.bool)
    mask[0, ..., 700:] = False
    dout = torch.randn_like(q)
    want = grads_of(lambda a, b, c: (F.scaled_dot_product_attention(a, b, c, attn_mask=mask)
                                     .float() * dout).sum(), q, k, v)
    torch._dynamo.reset()
    got = grads_of(torch.compile(lambda a, b, c: (sageattn(a, b, c, attn_mask=mask, qk_quant="int8")
                                                  .float() * dout).sum(), fullgraph=True), q, k, v)
    assert not quantized_training
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert cosine_similarity(g, w.double()) >= 0.99999


def grads_of(step: Any, *inputs: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    step(*leaves).backward()
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pytorch_kernels_match_the_formulas(attention_kernel: None, head_dim: int) -> None:
    """cuDNN's (head_dim <= 128) or FlashAttention-2's backward kernel on our O and LSE gives
    the float32 formulas' gradients (the LSE's convention and the operands' layouts agree)."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 4, 777, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    out, lse = sageattn(q, k, v, is_causal=True, return_lse=True)
    dout = torch.randn_like(out)
    kernel = _backward._pytorch_kernel(q, None, None)
    assert kernel == ("cudnn" if head_dim <= 128 else "flash")
    got = _backward._pytorch_kernels(kernel, dout, q, k, v, out, lse, True, head_dim ** -0.5)
    want = _backward._chunked(dout, q, k, v, out, lse, True, head_dim ** -0.5, None)
    for g, w in zip(got, want):
        assert cosine_similarity(g, w.double()) >= 0.9999


def pytorch_centering(monkeypatch: pytest.MonkeyPatch, *args: Any) -> tuple[torch.Tensor, ...]:
    """_backward._center_keys in PyTorch's ops (its path where the center_keys op is absent)."""
    real = ops.has_op
    with monkeypatch.context() as patch:
        patch.setattr(ops, "has_op", lambda name: name != "center_keys" and real(name))
        return _backward._center_keys(*args)


@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_center_keys_op_matches_pytorch(attention_kernel: None, monkeypatch: pytest.MonkeyPatch,
                                        head_dim: int, dtype: torch.dtype) -> None:
    """The center_keys op (the inputs of PyTorch's backward kernels, D51): K - mean bit for bit
    as PyTorch's ops round it, the LSE within float32 rounding of theirs and +inf where it was
    -inf; GQA, odd lengths, q in NHD memory, every element written (NaN-poisoned memory)."""
    if not ops.has_op("center_keys"):
        pytest.skip("this build has no center_keys")
    torch.manual_seed(head_dim)
    q, k, _ = make_input_family("bias4", (2, 4, 1000 + head_dim, head_dim), dtype, "cuda")
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # NHD memory, as diffusers passes it
    k = k[:, :2, :-301]  # GQA (two query heads per key head), fewer keys than queries
    lse = torch.randn(q.shape[:3], device="cuda") * 4
    lse[0, 1, :7] = -torch.inf  # rows that see no key
    scale = head_dim ** -0.5
    want_k, want_lse, want_mean = pytorch_centering(monkeypatch, q, k, lse, scale)
    poison_cuda_allocator()
    got_k, got_lse, got_mean = _backward._center_keys(q, k, lse, scale)
    assert got_k.dtype == dtype and got_k.shape == k.shape and torch.equal(got_k, want_k)
    assert torch.equal(got_mean, want_mean) and got_lse.dtype == torch.float32
    assert torch.equal(got_lse == torch.inf, lse == -torch.inf) and not got_lse.isnan().any()
    seen = lse > -torch.inf
    bound = 1e-6 * (lse.abs() + scale * (q.float().abs() * want_mean.abs()).sum(-1)) + 1e-6
    assert ((got_lse - want_lse).abs() <= bound)[seen].all(), (got_lse - want_lse)[seen].abs().max()
    mean = k.mean(dim=2, dtype=torch.float32)
    torch.library.opcheck(torch.ops.sageattention2.center_keys, (q, k, lse, mean, scale))


def test_center_keys_shapes_and_refusals() -> None:
    """center_keys' Meta implementation (what FakeTensor and torch.compile trace): K's shape and
    dtype, the LSE's shape in float32; operands of the wrong shape refused by name."""
    if not ops.has_op("center_keys"):
        pytest.skip("this build has no center_keys")
    center = torch.ops.sageattention2.center_keys

    def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, device="meta", dtype=dtype)

    q, k = meta(2, 4, 100, 64, dtype=torch.bfloat16), meta(2, 2, 80, 64, dtype=torch.bfloat16)
    lse, mean = meta(2, 4, 100), meta(2, 2, 64)
    k_centered, lse_centered = center(q, k, lse, mean, 0.125)
    assert k_centered.shape == k.shape and k_centered.dtype == torch.bfloat16
    assert lse_centered.shape == lse.shape and lse_centered.dtype == torch.float32
    with pytest.raises(RuntimeError, match="k's heads"):
        center(q, meta(2, 3, 80, 64, dtype=torch.bfloat16), lse, meta(2, 3, 64), 0.125)
    with pytest.raises(RuntimeError, match="k_mean must have shape"):
        center(q, k, lse, meta(2, 2, 32), 0.125)
    with pytest.raises(RuntimeError, match="lse must be"):
        center(q, k, meta(2, 4, 99), mean, 0.125)
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        center(q, meta(2, 2, 80, 64, dtype=torch.float16), lse, mean, 0.125)


def test_head_channel_spread_is_channel_spread(attention_kernel: None) -> None:
    """The training guard's statistic from one smoothing_stats pass equals channel_spread's from
    aminmax and a mean (up to the two means' summation orders), q in NHD memory."""
    torch.manual_seed(9)
    for family in ("bias0", "outliers"):
        q, k, _ = make_input_family(family, (2, 4, 3000, 128), torch.bfloat16, "cuda")
        for x in (q.transpose(1, 2).contiguous().transpose(1, 2), k):
            want = ops.channel_spread(x, x.mean(dim=2, dtype=torch.float32))
            torch.testing.assert_close(ops.head_channel_spread(x), want, rtol=1e-5, atol=0)
