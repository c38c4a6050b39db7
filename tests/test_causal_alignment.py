"""causal_alignment="bottom_right": FlashAttention's causal rule (query i sees keys
j <= i + N_kv - N_q), on the exact path (SDPA with the lower-right bias) and on the kernels,
which run it as parts merged by their LSE. On the CPU the kernel is a stand-in (exact attention
with its LSE): the test is the split and the merge; the GPU test runs the kernels."""
from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from helpers import qkv, stand_in_kernel
from sageattention2 import sageattn
from sageattention2 import reference as ref
from sageattention2.api import explain


def bottom_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND",
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention and LSE under FlashAttention's rule; rows that see no key: 0, -inf."""
    hnd = (lambda t: t.transpose(1, 2)) if layout == "NHD" else (lambda t: t)
    q4, k4, v4 = hnd(q), hnd(k), hnd(v)
    n_q, n_k = q4.shape[2], k4.shape[2]
    mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    out, lse = ref.exact_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True, return_lse=True)
    return hnd(out), lse


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("n_q, n_k", [(7, 19), (19, 7), (1, 40), (300, 301)])
def test_exact_path(n_q: int, n_k: int) -> None:
    q, k, v = qkv(b=2, hq=4, hkv=2, nq=n_q, nk=n_k, d=16)
    out, lse = sageattn(q, k, v, is_causal=True, enable_gqa=True, causal_alignment="bottom_right",
                        return_lse=True)
    want, want_lse = bottom_right(q, k, v)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    plain = sageattn(q, k, v, is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
    torch.testing.assert_close(plain, out)


def test_square_is_top_left() -> None:
    q, k, v = qkv(b=1, hq=2, nq=9, nk=9, d=16)
    assert torch.equal(sageattn(q, k, v, is_causal=True, causal_alignment="bottom_right"),
                       sageattn(q, k, v, is_causal=True))
    with pytest.raises(ValueError, match="causal_alignment"):
        sageattn(q, k, v, is_causal=True, causal_alignment="diagonal")


@pytest.fixture
def kernel_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Each kernel call's query length, key length and causality."""
    return stand_in_kernel(monkeypatch, lambda call, q, k: (q.shape[2], k.shape[2], call.is_causal))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("n_q, n_k", [(37, 300), (300, 37), (1, 64)])
def test_kernel_path_merges_its_parts(kernel_stand_in: list[tuple[int, ...]], layout: str,
                                      n_q: int, n_k: int) -> None:
    q, k, v = qkv(b=2, hq=4, hkv=2, nq=n_q, nk=n_k, d=64, layout=layout)
    q, k, v = (t.to(torch.float16) for t in (q, k, v))
    kw = dict(is_causal=True, enable_gqa=True, tensor_layout=layout,
              causal_alignment="bottom_right")
    assert explain(q, k, v, **kw).quantized
    out, lse = sageattn(q, k, v, return_lse=True, **kw)
    want, want_lse = bottom_right(q.double(), k.double(), v.double(), layout)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=0)
    assert out.shape == q.shape and out.is_contiguous()
    if n_q < n_k:
        assert kernel_stand_in == [(n_q, n_k - n_q, False), (n_q, n_q, True)]
    else:
        assert kernel_stand_in == [(n_k, n_k, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("n_q, n_k", [(512, 4096), (4096, 1000), (1, 2048), (777, 778)])
def test_bottom_right_on_the_gpu(attention_kernel: None, n_q: int, n_k: int) -> None:
    """The kernel's parts merged, on inputs like real Q, K, V (channel offsets, an outlier
    channel of Q and K eight times the others) and poisoned memory: every element written and
    finite, within the documented 8-bit bound of float64 under FlashAttention's rule (FP8 PV:
    0.05, gpu_helpers.EXACT_L1_OF; the emulation of the merged parts gives 0.022-0.027 on these
    inputs), and the rows that see no key exactly 0."""
    from gpu_helpers import exact_l1_bound, make_qkv, sageattn_kernel
    from sageattention2.testing import poison_cuda_allocator, relative_l1

    q, k, v = make_qkv(1, 8, 2, n_q, n_k, 128, torch.bfloat16, seed=n_q, bias=(1.0, 4.0, 1.0),
                       outlier=8.0)
    options = dict(is_causal=True, enable_gqa=True, causal_alignment="bottom_right",
                   qk_quant="int8")
    kernel = sageattn_kernel(q, k, v, **options)
    poison_cuda_allocator()
    out = sageattn(q, k, v, **options)
    assert torch.isfinite(out).all()
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device="cuda").tril(n_k - n_q)
    want = ref.exact_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert relative_l1(out, want) <= exact_l1_bound(kernel, None, want, out.dtype)
    if n_q > n_k:
        assert (out[:, :, : n_q - n_k] == 0).all()
