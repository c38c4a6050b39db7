"""The quantized path's wiring, on CPU: what sageattn gives each kernel's op and what it does
with the result. The preprocessing ops run their reference CPU implementations; attention_mma is
replaced by a float64 stand-in written from docs/DESIGN.md#attention-mma, attention_wgmma by a
recording one."""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers import fallback_warnings, qkv, skip_device_rules
from sageattention2 import _execute, _plan, ops, sageattn
from sageattention2 import reference as ref
from sageattention2.api import smoothing_sample_stride

BF16 = torch.bfloat16  # (the kernels' inputs)


def test_smoothing_sample_stride() -> None:
    """The Hopper path's smoothing means: every token up to SMOOTHING_SAMPLE_TOKENS, then an odd
    stride (coprime with power-of-two periods of the token order) that keeps between a third of
    SMOOTHING_SAMPLE_TOKENS and all of it (csrc/common/geometry.h reduces up to that many rows per head
    in one launch); the lengths of docs/PROTOCOL.md#speed-inputs sample 205 (1K), 241 (4K) and
    253 (16K) tokens."""
    target = _execute.SMOOTHING_SAMPLE_TOKENS
    for n in [*range(1, 2 * target), *range(2 * target, 300_000, 97), 2**20]:
        stride = smoothing_sample_stride(n)
        samples = -(-n // stride)
        if n <= target:
            assert stride == 1, n
        else:
            assert stride % 2 == 1 and target // 3 <= samples <= target, (n, stride)
    assert [smoothing_sample_stride(n) for n in (1024, 4096, 16384)] == [5, 17, 65]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 4, 9, 64, dtype=BF16),
        lambda: torch.randn(2, 9, 4, 64, dtype=BF16).transpose(1, 2),
        lambda: torch.randn(2, 9, 3, 4, 64, dtype=BF16)[:, :, 1].transpose(1, 2),  # packed qkv
        lambda: torch.randn(2, 4, 64, 9, dtype=BF16).transpose(2, 3),  # last dim not contiguous
        lambda: torch.randn(2, 4, 9, 68, dtype=BF16)[..., :64],  # rows of 136 bytes
        lambda: torch.randn(2 * 4 * 9 * 64 + 1, dtype=BF16)[1:].view(2, 4, 9, 64),  # 2-byte misaligned
        lambda: torch.randn(2, 4, 9, 68)[..., :64],  # float32 rows of 272 bytes: in place
    ],
    ids=["contiguous", "nhd", "packed", "transposed", "row-stride-68", "misaligned", "float32-rows"],
)
def test_kernel_view(make: Any) -> None:
    t = make()
    view = _execute._kernel_view(t)
    assert torch.equal(view, t)
    size = t.element_size()  # (the ops move 16-byte vectors)
    readable = (t.stride(-1) == 1 and all(s * size % 16 == 0 for s in t.stride()[:-1])
                and t.data_ptr() % 16 == 0)
    if readable:
        assert view.data_ptr() == t.data_ptr()
    else:
        assert view.is_contiguous() and view.data_ptr() % 16 == 0
        assert all(s * size % 16 == 0 for s in view.stride()[:-1])


# ------------------------------------------------------------------------------------------------
# The quantized path's wiring on CPU: the preprocessing ops run their reference CPU
# implementations, attention_mma is replaced by a float64 stand-in written from
# docs/DESIGN.md#attention-mma
# ------------------------------------------------------------------------------------------------

LOG2E = math.log2(math.e)
# attention_mma's argument names (the op schema, docs/DESIGN.md#attention-mma), for recording
# its calls.
MMA_ARG_NAMES = ("q", "q_mean", "k_codes", "k_scale", "delta_s", "v", "v_scale", "v_mean",
                 "k_mean", "qk_dtype", "kv_len", "sm_scale", "is_causal", "out_nhd", "return_lse")


def attention_mma_stand_in(q: torch.Tensor, q_mean: torch.Tensor | None, k_codes: torch.Tensor,
                           k_scale: torch.Tensor, delta_s: torch.Tensor | None, v: torch.Tensor,
                           v_scale: torch.Tensor | None, v_mean: torch.Tensor | None,
                           k_mean: torch.Tensor | None, qk_dtype: str, kv_len: int,
                           sm_scale: float, is_causal: bool, out_nhd: bool,
                           return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's contract (docs/DESIGN.md#attention-mma) in float64: Q (minus q_mean) quantized as
    reference.quantize_q_reference(block_q=MMA_BLOCK_Q, warps=MMA_WARPS,
    scale_multiplier=sm_scale*log2(e)) does, the per-thread groups dequantized (INT8, or INT4 unpacked from
    its nibbles), Delta-S added, exact base-2 softmax, top-left causal mask; V as given
    (fp16/bf16) or dequantized from FP8 (keys un-permuted, code * v_scale, plus v_mean); output
    in q's dtype and the requested memory layout, natural-log LSE of the scores the kernel sees
    plus the row constant sm_scale * q_i . k_mean of K smoothing. P is not rounded (to the input
    dtype or E4M3) as the kernel does."""
    b, hq, q_len, d = q.shape
    hkv, nk_pad = k_codes.shape[1], k_codes.shape[2]
    assert q.dtype in (torch.float16, torch.bfloat16) and q.stride(-1) == 1
    assert all(s % 8 == 0 for s in q.stride()[:-1])
    assert d in ops.MMA_HEAD_DIMS and q_len > 0
    assert k_codes.dtype == torch.int8
    assert k_codes.shape[-1] == (d // 2 if qk_dtype == "int4" else d)
    # Q smoothed per head needs the Delta-S of that mean, and only then.
    assert (q_mean is None) == (delta_s is None)
    if q_mean is not None:
        assert q_mean.dtype == torch.float32 and q_mean.shape == (b, hq, d)
        assert delta_s.dtype == torch.float32 and delta_s.shape == (b, hq, nk_pad)
    if k_mean is not None:
        assert k_mean.dtype == torch.float32 and k_mean.shape == (b, hkv, d)
    q_codes, q_scale, _ = ref.quantize_q_reference(q, q_mean, ops.MMA_BLOCK_Q, ops.MMA_WARPS,
                                                   qk_dtype, False, sm_scale * LOG2E)
    nq_pad = q_codes.shape[2]
    if qk_dtype == "int4":
        q_codes, k_codes = ref.unpack_int4(q_codes), ref.unpack_int4(k_codes)
    else:
        assert qk_dtype == "int8"
    assert q_codes.shape[-1] == k_codes.shape[-1] == d
    assert nq_pad % ops.MMA_BLOCK_Q == 0 and nk_pad % ops.MMA_BLOCK_K == 0
    assert nq_pad - ops.MMA_BLOCK_Q < q_len <= nq_pad
    assert nk_pad - ops.MMA_BLOCK_K < kv_len <= nk_pad
    assert q_scale.shape == (b, hq, nq_pad // ops.MMA_BLOCK_Q, ops.MMA_WARPS * 8)
    if v.dtype == torch.float8_e4m3fn:
        assert v.shape == (b, hkv, d, nk_pad) and v.is_contiguous()
        assert v_scale is not None and v_scale.shape == (b, hkv, d)
        # Stored key s of transposed V is key perm[s] (docs/DESIGN.md#v-layout): un-permute,
        # transpose back, and scale: code * v_scale (= P~ * 448 * code / 448 * v_scale).
        v_t = torch.empty(v.shape, dtype=torch.float64)
        v_t[..., ref.v_key_permutation(nk_pad)] = v.double()
        values = v_t.transpose(-1, -2)[:, :, :kv_len] * v_scale.double()[:, :, None, :]
        if v_mean is not None:
            assert v_mean.shape == (b, hkv, d)
            values = values + v_mean.double()[:, :, None, :]
    else:
        assert qk_dtype == "int8" and v_scale is None and v_mean is None
        assert v.dtype == q.dtype and v.shape == (b, hkv, kv_len, d) and v.stride(-1) == 1
        values = v.double()
    r = torch.arange(nq_pad)
    qs = q_scale[:, :, r // ops.MMA_BLOCK_Q,
                 ref.q_group_index(ops.MMA_BLOCK_Q, ops.MMA_WARPS)[r % ops.MMA_BLOCK_Q]]
    j = torch.arange(nk_pad)
    k_group = ref.k_group_index(ops.MMA_BLOCK_K)[j % ops.MMA_BLOCK_K]
    ks = k_scale[:, :, j // ops.MMA_BLOCK_K, k_group]
    qd = q_codes.double() * qs.double()[..., None]
    kd = (k_codes.double() * ks.double()[..., None]).repeat_interleave(hq // hkv, dim=1)
    s2 = qd @ kd.transpose(-1, -2)  # log2 units (sm_scale * log2(e) is in the Q scales)
    if delta_s is not None:
        s2 = s2 + delta_s.double()[:, :, None, :]
    s = s2[:, :, :q_len, :kv_len] / LOG2E
    if is_causal:
        s = s.masked_fill(torch.ones(q_len, kv_len, dtype=torch.bool).tril().logical_not(),
                          -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    if k_mean is not None:  # the row constant K smoothing drops (of the raw q)
        k_mean_q = k_mean.double().repeat_interleave(hq // hkv, dim=1)  # [B, Hq, D]
        lse = lse + sm_scale * (q.double() @ k_mean_q[..., None]).squeeze(-1)
    out = torch.softmax(s, dim=-1) @ values.repeat_interleave(hq // hkv, dim=1)
    out = out.to(q.dtype)
    if out_nhd:
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        out = out.contiguous()
    return out, (lse.float() if return_lse else torch.empty(0))


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Route sageattn's CPU fp16/bf16 calls to the quantized path, with the stand-in registered
    as attention_mma's CPU kernel (unless the build has one of its own); yields the list of
    the op's calls, which go through the real ops.attention_mma wrapper and the dispatcher."""
    if not ops.has_op("attention_mma"):
        pytest.skip("this build has no attention_mma op")
    calls: list[dict[str, Any]] = []
    qualname = f"{ops.NAMESPACE}::attention_mma"
    lib = None
    if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"):
        def cpu_kernel(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(dict(zip(MMA_ARG_NAMES, args)))
            return attention_mma_stand_in(*args)

        lib = torch.library.Library(ops.NAMESPACE, "IMPL")
        lib.impl("attention_mma", cpu_kernel, "CPU")
    else:  # record the calls at the wrapper instead
        real = ops.attention_mma

        def recording(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(dict(zip(MMA_ARG_NAMES, args)))
            return real(*args)

        monkeypatch.setattr(ops, "attention_mma", recording)
    skip_device_rules(monkeypatch)
    try:
        yield calls
    finally:
        if lib is not None:
            lib._destroy()


def rel_l1(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want).abs().sum() / want.abs().sum())


def dequantized_v(v4: torch.Tensor, smooth_v: bool) -> torch.Tensor:
    """V as FP8 PV sees it (float64), written from the reference's per-channel quantizer in the
    natural key order (independent of the transposed, permuted op format): E4M3 code times
    v_scale, plus V's mean with smooth_v."""
    v_mean = ref.smoothing_stats_reference(None, None, v4, True)[2] if smooth_v else None
    codes, scale = ref.quantize_v_per_channel(v4, v_mean)
    values = codes.double() * scale.double()[:, :, None, :]
    return values + v_mean.double()[:, :, None, :] if smooth_v else values


def case_arguments(case: dict[str, Any], q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The [B, H, N, D] views (slices of one [B, N, 3, H, D] tensor when ``case["packed"]``) and
    sageattn's q, k, v arguments for a wiring case: in ``case["layout"]``, 3-D when
    ``case["b"]`` is None."""
    if case.get("packed"):
        packed = torch.stack([t.transpose(1, 2) for t in (q4, k4, v4)], dim=2)  # [B,N,3,H,D]
        q4, k4, v4 = (packed[:, :, i].transpose(1, 2) for i in range(3))
    layout = case.get("layout", "HND")
    args = [t if layout == "HND" else t.transpose(1, 2) for t in (q4, k4, v4)]
    if case.get("b", 2) is None:
        args = [t[0] for t in args]
    return q4, k4, v4, args


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(layout="NHD", dtype=torch.bfloat16),
        dict(b=None),
        dict(b=None, layout="NHD"),
        dict(hkv=1, gqa=True, causal=True),
        dict(hkv=2, gqa=True, nq=7, nk=150, causal=True, layout="NHD"),
        dict(nq=150, nk=7, causal=True),
        dict(d=128, smooth_q=False),
        dict(smooth_k=False),
        dict(smooth_q=False, smooth_k=False, scale=0.3),
        dict(packed=True, layout="NHD"),
        dict(pv="fp8"),
        dict(pv="fp8", layout="NHD", dtype=torch.bfloat16, causal=True, smooth_v=True),
        dict(pv="fp8", hkv=2, gqa=True, nq=7, nk=150, smooth_q=False, smooth_v=True),
        dict(pv="fp8", b=None, smooth_k=False, d=128),
        dict(pv="fp8", packed=True, layout="NHD", smooth_v=True),
        dict(qk="int4"),
        dict(qk="int4", layout="NHD", dtype=torch.bfloat16, causal=True, smooth_v=True, d=128),
        dict(qk="int4", hkv=1, gqa=True, nq=150, nk=7, causal=True, smooth_q=False),
        dict(d=96, layout="NHD"),
        dict(d=32, pv="fp8", smooth_v=True),
        dict(d=80, qk="int4", b=None, layout="NHD", causal=True),
        dict(smooth_q="head", hkv=2, gqa=True, layout="NHD"),
        dict(smooth_q=True, pv="fp8", causal=True, smooth_v=True, d=128),
        dict(smooth_q="head", smooth_k=False, b=None, dtype=torch.bfloat16),
        dict(qk="int4", smooth_q="head", packed=True, layout="NHD"),
        dict(nq=20, nk=1100, causal=True, hkv=2, gqa=True),
        dict(nq=20, nk=1100, smooth_q="head", layout="NHD", d=96),
        dict(pv="fp8", nq=20, nk=1100, smooth_v=True),
    ],
    ids=["hnd", "nhd-bf16", "3d", "3d-nhd", "mqa-causal", "gqa-causal-nq<nk", "causal-nq>nk",
         "d128-no-smooth-q", "no-smooth-k", "no-smoothing-scale", "packed-nhd",
         "fp8", "fp8-nhd-bf16-causal-smooth-v", "fp8-gqa-no-smooth-q-smooth-v",
         "fp8-3d-no-smooth-k-d128", "fp8-packed-smooth-v", "int4", "int4-nhd-bf16-causal-smooth-v",
         "int4-mqa-causal-nq>nk-no-smooth-q", "d96-nhd", "d32-fp8-smooth-v", "d80-int4-3d-nhd",
         "smooth-q-head-gqa-nhd", "smooth-q-true-fp8-causal-smooth-v-d128",
         "smooth-q-head-no-smooth-k-3d-bf16", "int4-smooth-q-head-packed-nhd",
         "sampled-k-mean-gqa-causal", "sampled-k-mean-smooth-q-d96-nhd",
         "fp8-all-token-means-smooth-v"],
)
def test_quantized_path_wiring(stand_in: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """What sageattn gives attention_mma (its CPU stand-in) for each variant, and that the
    result is the emulation of the same quantization: the caller's q (read in place, or
    zero-padded to the kernel's head_dim) with its per-head mean only when Q is smoothed
    ("head"/True, or "auto" with INT4 QK) and then Delta-S; INT8 or INT4 K codes, K's mean
    (over smoothing_sample_stride's token sample, or all tokens with FP8 PV) only with
    smooth_k; V in the input dtype (read in place) or FP8 with its scale and (smooth_v) mean,
    the true kv length, the softmax scale of the true head_dim, the layout, and the LSE with the
    row constant of K smoothing (added by the op)."""
    layout = case.get("layout", "HND")
    dtype = case.get("dtype", torch.float16)
    causal, gqa = case.get("causal", False), case.get("gqa", False)
    smooth_q, smooth_k = case.get("smooth_q", "auto"), case.get("smooth_k", True)
    smooth_v, qk = case.get("smooth_v", False), case.get("qk", "int8")
    # On CPU "auto" is the input dtype (no FP8 tensor cores to ask about); INT4 implies FP8.
    fp8 = case.get("pv") == "fp8" or qk == "int4"
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv = case.get("b", 2), 4, case.get("hkv", 4)
    nq, nk, d = case.get("nq", 70), case.get("nk", case.get("nq", 70)), case.get("d", 64)
    d_kernel = 64 if d <= 64 else 128

    def make(h: int, n: int, bias: float) -> torch.Tensor:  # [B, H, N, D], offsets per channel
        x = torch.randn(b or 1, h, n, d, generator=gen) + bias * torch.randn(b or 1, h, 1, d,
                                                                             generator=gen)
        return x.to(dtype)

    q4, k4, v4 = make(hq, nq, 2.0), make(hkv, nk, 4.0), make(hkv, nk, 1.0)
    q4, k4, v4, args = case_arguments(case, q4, k4, v4)
    kwargs = dict(is_causal=causal, enable_gqa=gqa, tensor_layout=layout, smooth_q=smooth_q,
                  smooth_k=smooth_k, smooth_v=smooth_v, scale=case.get("scale"), qk_quant=qk,
                  pv_quant=case.get("pv", "auto"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out, lse = sageattn(*args, return_lse=True, strict=True, **kwargs)
        out_only = sageattn(*args, **kwargs)
    assert not fallback_warnings(record)
    assert len(stand_in) == 2
    call = stand_in[0]
    assert call["qk_dtype"] == qk and call["kv_len"] == nk and call["is_causal"] is causal
    assert call["out_nhd"] is (layout == "NHD") and call["return_lse"] is True
    assert stand_in[1]["return_lse"] is False
    sm_scale = d ** -0.5 if case.get("scale") is None else case["scale"]
    assert call["sm_scale"] == pytest.approx(sm_scale, rel=1e-12)
    # The caller's q (q_len = nq, q's dtype), not quantized: the kernel quantizes it.
    assert call["q"].dtype == dtype and call["q"].shape == (b or 1, hq, nq, d_kernel)
    if d == d_kernel:
        assert call["q"].data_ptr() == q4.data_ptr()  # read in place, never copied
        assert torch.equal(call["q"], q4)
    else:  # zero-padded
        assert torch.equal(call["q"][..., :d], q4) and not call["q"][..., d:].any()
    # Q is smoothed (per head, with Delta-S) as asked, and with "auto" for INT4 QK only.
    smoothed_q = smooth_q in (True, "head") or (smooth_q == "auto" and qk == "int4")
    assert (call["delta_s"] is not None) is smoothed_q
    assert (call["q_mean"] is not None) is smoothed_q
    q_kernel, k_kernel, v_kernel = (torch.nn.functional.pad(t, (0, d_kernel - d))
                                    for t in (q4, k4, v4))
    if smoothed_q:  # over all of Q's tokens
        torch.testing.assert_close(call["q_mean"],
                                   ref.smoothing_stats_reference(q_kernel, None, None, False)[0])
    k_pad = -(-nk // ops.MMA_BLOCK_K) * ops.MMA_BLOCK_K
    assert call["k_codes"].dtype == torch.int8
    assert call["k_codes"].shape == (b or 1, hkv, k_pad,
                                     d_kernel // 2 if qk == "int4" else d_kernel)
    assert call["k_scale"].shape == (b or 1, hkv, k_pad // ops.MMA_BLOCK_K, 4)
    # K's mean over every smoothing_sample_stride(nk)-th token with PV in the input dtype,
    # over all tokens with FP8 PV (whose V statistics read all of them in the same pass).
    stride = smoothing_sample_stride(nk) if not fp8 else 1
    assert smoothing_sample_stride(nk) == (5 if nk == 1100 else 1)
    assert (call["k_mean"] is not None) is smooth_k
    if smooth_k:
        torch.testing.assert_close(
            call["k_mean"],
            ref.smoothing_stats_reference(None, k_kernel[:, :, ::stride], None, False)[1])
    if fp8:
        assert call["v"].dtype == torch.float8_e4m3fn
        assert call["v"].shape == (b or 1, hkv, d_kernel, k_pad)
        stats = ref.smoothing_stats_reference(None, None, v_kernel, smooth_v)
        torch.testing.assert_close(call["v_scale"], stats[3], rtol=0, atol=0)
        if smooth_v:
            torch.testing.assert_close(call["v_mean"], stats[2], rtol=0, atol=0)
        else:
            assert call["v_mean"] is None
    else:
        assert call["v_scale"] is None and call["v_mean"] is None
        if d == d_kernel:
            assert call["v"].data_ptr() == v4.data_ptr()  # v is read in place, never copied

    assert out.shape == (*args[0].shape[:-1], d) and out.dtype == dtype
    assert torch.equal(out, out_only)
    if b is not None:  # the output is contiguous in the caller's layout
        assert out.is_contiguous()
    want, want_lse = ref.exact_attention(q4, k4, v4, is_causal=causal, scale=case.get("scale"),
                                         enable_gqa=gqa, return_lse=True)
    out4 = out if b is not None else out[None]
    out4 = out4 if layout == "HND" else out4.transpose(1, 2)
    lse4 = lse if b is not None else lse[None]
    assert lse4.dtype == torch.float32 and lse4.shape == want_lse.shape
    if smooth_k and qk == "int8":  # unsmoothed K with offsets of 4 quantizes coarsely: what
        # smoothing is for; INT4 is coarser still (compared with its emulation below). Q's
        # offsets of 2 unsmoothed (INT8 "auto") leave a coarser LSE (~0.05 here vs ~0.03).
        assert rel_l1(out4, want) < 0.03
        torch.testing.assert_close(lse4.double(), want_lse, rtol=0,
                                   atol=0.04 if smoothed_q else 0.065)
    # Against the emulation of the same quantization with exact PV on V as the kernel sees it
    # (what the stand-in does): the same output up to its final rounding, and the same LSE,
    # whose row constant sm_scale * q . k_mean (dropped by K smoothing) the op adds back (k's
    # offsets of 4 make it large, so forgetting it fails by far), with K's mean over the same
    # token sample. FP8 V is dequantized here from the natural key order, so a wrong V
    # permutation, scale or mean fails too.
    emu, emu_lse = ref.sage_attention_reference(
        q4, k4, dequantized_v(v4, smooth_v) if fp8 else v4, is_causal=causal,
        scale=case.get("scale"), qk_dtype=qk, granularity="thread",
        block_q=ops.MMA_BLOCK_Q, warps=ops.MMA_WARPS, block_k=ops.MMA_BLOCK_K,
        smooth_k=smooth_k, smooth_q=None if not smoothed_q else "head", smooth_v=False,
        mean_stride=smoothing_sample_stride(nk) if not fp8 else 1,
        pv_dtype="fp32", two_level=False, fp22=False, return_lse=True)
    assert rel_l1(out4, emu.double()) < 2e-3
    torch.testing.assert_close(lse4, emu_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize(
    ("d", "options"),
    [(96, {}), (32, {"pv_quant": "fp8", "smooth_v": True}), (96, {"qk_quant": "int4"}),
     (8, {"smooth_q": False, "is_causal": True}), (120, {"pv_quant": "fp8"})],
    ids=["d96", "d32-fp8-smooth-v", "d96-int4", "d8-causal", "d120-fp8"],
)
def test_head_dim_padding(stand_in: list[dict[str, Any]], layout: str, d: int,
                          options: dict[str, Any]) -> None:
    """A head_dim the kernels are not built for runs zero-padded to the next built one: exactly
    what sageattn computes on inputs padded by hand with the softmax scale of the true head_dim,
    cut back to d channels, contiguous in the caller's layout (as SDPA's output is); the padded
    output channels are zero."""
    gen = torch.Generator().manual_seed(d)
    d_kernel = 64 if d <= 64 else 128
    q4, k4, v4 = ((torch.randn(2, 4, 70, d, generator=gen)
                   + bias * torch.randn(2, 4, 1, d, generator=gen)).half()
                  for bias in (1.0, 3.0, 1.0))
    args = [t if layout == "HND" else t.transpose(1, 2).contiguous() for t in (q4, k4, v4)]
    out, lse = sageattn(*args, tensor_layout=layout, return_lse=True, strict=True, **options)
    codes_dim = d_kernel // 2 if options.get("qk_quant") == "int4" else d_kernel
    assert stand_in[0]["q"].shape[-1] == d_kernel
    assert stand_in[0]["k_codes"].shape[-1] == codes_dim
    assert out.shape == args[0].shape and out.dtype == torch.float16 and out.is_contiguous()
    padded = [torch.nn.functional.pad(t, (0, d_kernel - d)) for t in args]
    out_p, lse_p = sageattn(*padded, tensor_layout=layout, scale=d ** -0.5, return_lse=True,
                            strict=True, **options)
    assert torch.equal(out, out_p[..., :d]) and torch.equal(lse, lse_p)
    assert not out_p[..., d:].any()
    if options.get("qk_quant") != "int4":  # the 8-bit error level vs exact attention
        want = ref.exact_attention(q4, k4, v4, is_causal=options.get("is_causal", False))
        assert rel_l1(out if layout == "HND" else out.transpose(1, 2), want) < 0.03


def test_quantized_path_fallbacks(stand_in: list[dict[str, Any]]) -> None:
    q, k, v = qkv(d=64, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sageattn(q, k, v, qk_quant="int4", pv_quant="none")
        sageattn(q, k, v, smooth_q="block")
        sageattn(q, k, v, qk_quant="int4")
        sageattn(q, k, v)
    messages = fallback_warnings(record)
    assert len(messages) == 2
    assert messages[0].startswith("sageattn is computing exact F.scaled_dot_product_attention "
                                  "instead of quantized attention: INT4 QK runs with FP8 PV only")
    assert "per block" in messages[1]
    assert [call["qk_dtype"] for call in stand_in] == ["int4", "int8"]


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(layout="NHD", dtype=torch.bfloat16, causal=True, scale=0.3),
        dict(b=None, smooth_k=False, smooth_v=True),
        dict(hkv=1, gqa=True, nq=7, nk=150, d=64, smooth_q=False),
        dict(packed=True, layout="NHD", smooth_v=True),
        dict(d=96, layout="NHD", smooth_v=True),
        dict(d=40, b=None, causal=True),
        dict(nk=1100, nq=20, smooth_v=True),
    ],
    ids=["hnd", "nhd-bf16-causal-scale", "3d-no-smooth-k-smooth-v", "mqa-d64", "packed-nhd",
         "d96-nhd-smooth-v", "d40-3d-causal", "sampled-means"],
)
def test_wgmma_path_wiring(monkeypatch: pytest.MonkeyPatch, case: dict[str, Any]) -> None:
    """The arguments attention_wgmma gets when sageattn runs the Hopper path (where _plan.route
    picks it: one sageattn_wgmma op, whose CPU implementation is its chain of ops), from the real
    preprocessing ops (their CPU reference implementations): q read in place, K/V quantized for
    block_k=WGMMA_BLOCK_K, K's mean only with smooth_k, V's only with smooth_v (both over the
    strided token sample of smoothing_sample_stride), the kv length,
    softmax scale, mask, output layout and LSE flag; and what the op returns is what sageattn
    returns, in the caller's layout (a head_dim the kernel is not built for zero-padded to the
    next built one, with the softmax scale of the true head_dim, the output cut back)."""
    if not ops.HAS_EXTENSION:
        pytest.skip("the preprocessing ops need the compiled extension")
    layout = case.get("layout", "HND")
    dtype = case.get("dtype", torch.float16)
    b, hq, hkv = case.get("b", 2), 4, case.get("hkv", 4)
    nq, nk, d = case.get("nq", 70), case.get("nk", 70), case.get("d", 128)
    d_kernel = 64 if d <= 64 else 128
    smooth_k, smooth_v = case.get("smooth_k", True), case.get("smooth_v", False)
    gen = torch.Generator().manual_seed(3)
    q4, k4, v4 = (torch.randn(b or 1, h, n, d, generator=gen).to(dtype)
                  for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    q4, k4, v4, args = case_arguments(case, q4, k4, v4)

    calls: list[dict[str, Any]] = []
    names = ("q", "k_codes", "k_scale", "v_fp8", "v_tile_scale", "v_mean", "k_mean", "kv_len",
             "sm_scale", "is_causal", "out_nhd", "return_lse")

    def stand_in(*op_args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        call = dict(zip(names, op_args))
        calls.append(call)
        q = call["q"]
        memory = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if call["out_nhd"] else q.shape
        out = torch.arange(q.numel(), dtype=torch.float32).view(memory).to(q.dtype)
        out = out.transpose(1, 2) if call["out_nhd"] else out
        lse = torch.arange(q[..., 0].numel(), dtype=torch.float32).view(q.shape[:3]) \
            if call["return_lse"] else torch.empty(0)
        return out, lse

    monkeypatch.setattr(_plan, "route", lambda call: (_plan.KernelChoice("wgmma", "int8", "fp8"),
                                                     None))
    monkeypatch.setattr(ops, "attention_wgmma", stand_in)
    monkeypatch.setattr(ops, "attention_mma", None)  # must not run
    kwargs = dict(is_causal=case.get("causal", False), enable_gqa=case.get("gqa", False),
                  tensor_layout=layout, scale=case.get("scale"), smooth_k=smooth_k,
                  smooth_q=case.get("smooth_q", "auto"), smooth_v=smooth_v, strict=True)
    out, lse = sageattn(*args, return_lse=True, **kwargs)
    out_only = sageattn(*args, **kwargs)
    assert len(calls) == 2
    call = calls[0]
    assert call["q"].shape == (b or 1, hq, nq, d_kernel)
    if d == d_kernel:
        assert call["q"].data_ptr() == q4.data_ptr()
        assert torch.equal(call["q"], q4)  # the caller's q, not quantized nor copied
    else:  # zero-padded
        assert torch.equal(call["q"][..., :d], q4) and not call["q"][..., d:].any()
    k_pad = -(-nk // ops.WGMMA_BLOCK_K) * ops.WGMMA_BLOCK_K
    assert call["k_codes"].shape == (b or 1, hkv, k_pad, d_kernel)
    assert call["k_codes"].dtype == torch.int8
    assert call["k_scale"].shape == (b or 1, hkv, k_pad // ops.WGMMA_BLOCK_K, 4)
    assert call["v_fp8"].shape == (b or 1, hkv, d_kernel, k_pad)
    assert call["v_fp8"].dtype == torch.float8_e4m3fn
    k_kernel, v_kernel = (torch.nn.functional.pad(t, (0, d_kernel - d)) for t in (k4, v4))
    # The means are over every smoothing_sample_stride(nk)-th token (all up to 256 keys).
    stride = smoothing_sample_stride(nk)
    assert stride == (5 if nk == 1100 else 1)
    want_stats = ref.smoothing_stats_reference(None, k_kernel[:, :, ::stride],
                                               v_kernel[:, :, ::stride], smooth_v)
    # V with one FP8 scale per tile (quantize_kv without v_scale), of V minus its mean.
    _, want_tile_scale = ref.quantize_v_per_tile(v_kernel, want_stats[2] if smooth_v else None,
                                                 ops.WGMMA_BLOCK_K)
    assert call["v_tile_scale"].shape == (b or 1, hkv, k_pad // ops.WGMMA_BLOCK_K)
    torch.testing.assert_close(call["v_tile_scale"].cpu(), want_tile_scale)
    if smooth_k:
        torch.testing.assert_close(call["k_mean"], want_stats[1])
    else:
        assert call["k_mean"] is None
    if smooth_v:
        torch.testing.assert_close(call["v_mean"], want_stats[2])
    else:
        assert call["v_mean"] is None
    assert call["kv_len"] == nk and call["is_causal"] is kwargs["is_causal"]
    sm_scale = d ** -0.5 if case.get("scale") is None else case["scale"]
    assert call["sm_scale"] == pytest.approx(sm_scale, rel=1e-12)
    assert call["out_nhd"] is (layout == "NHD") and call["return_lse"] is True
    assert calls[1]["return_lse"] is False

    want_out, want_lse = stand_in(*[calls[0][n] for n in names])
    calls.pop()
    out4 = out if b is not None else out[None]
    out4 = out4 if layout == "HND" else out4.transpose(1, 2)
    assert torch.equal(out4, want_out[..., :d]) and torch.equal(out, out_only)
    assert torch.equal(lse if b is not None else lse[None], want_lse)
    if b is not None:  # the output is contiguous in the caller's layout
        assert out.is_contiguous()


def guard_inputs(outlier_heads: tuple[int, ...], d: int = 64, n: int = 256,
                 factor: float = 8.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B1, 4 Q heads on 2 KV heads: channel offsets (smoothing removes them), and in the KV groups
    of ``outlier_heads`` (KV head indices) 4 channels of Q and K ``factor`` times wider."""
    gen = torch.Generator().manual_seed(38)
    q = torch.randn(1, 4, n, d, generator=gen) + 2 * torch.randn(1, 4, 1, d, generator=gen)
    k = torch.randn(1, 2, n, d, generator=gen) + 4 * torch.randn(1, 2, 1, d, generator=gen)
    v = torch.randn(1, 2, n, d, generator=gen)
    for h in outlier_heads:
        k[:, h, :, :4] *= factor
        q[:, 2 * h, :, :4] *= factor  # one Q head of the group is enough
    return q.half(), k.half(), v.half()


def test_int4_guard_statistic() -> None:
    """ops.channel_spread is ~1 for even channels and ~the factor for a few wide ones; zero
    channels (a padded head_dim) do not count; int8_heads flags a KV head for its K or for any Q
    head of its group."""
    q, k, _ = guard_inputs((1,))
    q_mean, k_mean = q.float().mean(2), k.float().mean(2)
    k_spread = ops.channel_spread(k, k_mean)
    assert 1.0 < k_spread[0, 0] < 1.7 and 4.0 < k_spread[0, 1] < 10.0
    padded = torch.nn.functional.pad(k[:, :1], (0, 64))  # 64 zero channels
    assert torch.allclose(ops.channel_spread(padded, padded.float().mean(2)), k_spread[:, :1])
    assert ops.int8_heads(q, k, q_mean, k_mean, 2.0).tolist() == [[0, 1]]
    q_only = k.clone()
    q_only[:, 1, :, :4] /= 8  # K even again: Q head 2 alone flags KV head 1
    assert ops.int8_heads(q, q_only, q_mean, q_only.float().mean(2), 2.0).tolist() == [[0, 1]]
    assert ops.int8_heads(q, k, q_mean, k_mean, 20.0).tolist() == [[0, 0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_channel_spread_from_the_extremes_is_every_token_s(dtype: torch.dtype) -> None:
    """ops.channel_spread takes each channel's range from its extremes (no float32 copy of x):
    bit for bit the float32 max over tokens of |x_n - mean|, with offsets and wide channels, a
    mean that is not the tokens' own (K's sampled mean: every token may sit on one side), and a
    NaN token."""
    torch.manual_seed(5)
    x = (torch.randn(2, 3, 301, 64) * torch.rand(64) * 8 + torch.randn(2, 3, 1, 64) * 4).to(dtype)
    x[:, 1, :, :6] *= 12
    for mean in (x.float().mean(2), x.float()[:, :, ::7].mean(2), x.float().amax(2) + 1):
        want = (x.float() - mean.unsqueeze(2)).abs().amax(2) / 448.0
        want = want.amax(-1).mul(want.gt(0).sum(-1)).div(want.sum(-1))
        assert torch.equal(ops.channel_spread(x, mean), want)
    x[0, 2, 17, 5] = float("nan")
    assert ops.channel_spread(x, x.float().mean(2))[0, 2].isnan()


@pytest.mark.parametrize("outlier_heads", [(), (1,), (0, 1)], ids=["none", "one", "all"])
def test_int4_guard_routes_heads_to_int8(stand_in: list[dict[str, Any]],  # noqa: F811
                                         monkeypatch: pytest.MonkeyPatch,
                                         outlier_heads: tuple[int, ...]) -> None:
    """qk_quant="int4" with the guard (the default): the KV heads whose Q or K is too spread run
    INT8 inside the same call (INT8 K codes for them, the INT8 attention op); the output of each
    head is what the unguarded INT4 call (the guard off) or the INT8 call (FP8 PV, Q smoothed
    per head) gives for it, bit for bit, LSE too. (sageattn_mma's CPU implementation, the chain;
    the GPU test runs the C++ composite against it.)"""
    monkeypatch.delenv(_execute.INT4_GUARD_ENVIRONMENT)  # the default: on
    q, k, v = guard_inputs(outlier_heads)
    options = dict(enable_gqa=True, strict=True, return_lse=True)
    out, lse = sageattn(q, k, v, qk_quant="int4", **options)
    qk_run = [call["qk_dtype"] for call in stand_in]
    assert sorted(qk_run) == sorted(({"int4"} if len(outlier_heads) < 2 else set())
                                    | ({"int8"} if outlier_heads else set()))
    stand_in.clear()
    _execute.clear_call_cache()
    monkeypatch.setenv(_execute.INT4_GUARD_ENVIRONMENT, "off")
    out4, lse4 = sageattn(q, k, v, qk_quant="int4", **options)
    out8, lse8 = sageattn(q, k, v, qk_quant="int8", pv_quant="fp8", smooth_q="head", **options)
    for h in range(4):
        want, want_lse = (out8, lse8) if h // 2 in outlier_heads else (out4, lse4)
        assert torch.equal(out[:, h], want[:, h]) and torch.equal(lse[:, h], want_lse[:, h]), h


def test_int4_guard_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_execute.INT4_GUARD_ENVIRONMENT)
    assert _execute.int4_guard() == _execute.INT4_GUARD
    for value, threshold in (("off", 0.0), ("0", 0.0), ("3.5", 3.5), (" OFF ", 0.0)):
        monkeypatch.setenv(_execute.INT4_GUARD_ENVIRONMENT, value)
        assert _execute.int4_guard() == threshold
    for bad in ("0.5", "many", "nan"):
        monkeypatch.setenv(_execute.INT4_GUARD_ENVIRONMENT, bad)
        with pytest.raises(ValueError, match="SAGEATTN_INT4_GUARD"):
            _execute.int4_guard()
