"""sageattn_varlen (sageattention2/_varlen.py): packed sequences, each its own sageattn call on
views. On the CPU every sequence is exact SDPA: the result must equal SDPA per sequence bit for
bit; on the GPU, sageattn per sequence bit for bit (the definition) and float64 within the 8-bit
bound."""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import pytest
import torch

from sageattention2 import _varlen, sageattn, sageattn_varlen
from sageattention2 import reference as ref


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def packed(lengths_q: list[int], lengths_k: list[int], hq: int, hkv: int, d: int,
           dtype: torch.dtype = torch.float32, device: str = "cpu",
           seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g, device=device).to(dtype)
    k, v = (torch.randn(sum(lengths_k), hkv, d, generator=g, device=device).to(dtype)
            for _ in range(2))
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention and LSE of each sequence alone, packed."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        qi = q[bq[i]:bq[i + 1]].transpose(0, 1)[None]
        ki, vi = (t[bk[i]:bk[i + 1]].transpose(0, 1)[None] for t in (k, v))
        if qi.shape[2] == 0:
            continue
        if ki.shape[2] == 0:
            outs.append(torch.zeros(qi.shape[2], qi.shape[1], vi.shape[-1], dtype=torch.float64))
            lses.append(torch.full((qi.shape[1], qi.shape[2]), -math.inf, dtype=torch.float64))
            continue
        out, lse = ref.exact_attention(qi, ki, vi, is_causal=is_causal, enable_gqa=True,
                                       return_lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen_is_attention_per_sequence(is_causal: bool) -> None:
    lengths_q, lengths_k = [5, 1, 0, 13, 7], [5, 3, 4, 13, 0]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, hq=4, hkv=2, d=16)
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 13, 13, is_causal=is_causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    want, want_lse = per_sequence(q, k, v, cu_q, cu_k, is_causal)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    alone = sageattn(q[None, 6:19], k[None, 12:25], v[None, 12:25], is_causal=is_causal,
                     tensor_layout="NHD", enable_gqa=True)
    assert torch.equal(out[6:19], alone[0])  # sequence 3: its own call, bit for bit


def test_boundaries_are_read_once_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    real_tolist = torch.Tensor.tolist
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8)
    _varlen._bounds_cache.clear()
    sageattn_varlen(q, k, v, cu_q, cu_k, 4, 4)
    assert len(_varlen._bounds_cache) == 2
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    sageattn_varlen(q, k, v, cu_q, cu_k, 4, 4)
    assert not reads
    monkeypatch.undo()
    cu_q[1] = 2  # in place: read again (and now it describes other sequences)
    out = sageattn_varlen(q, k, v, cu_q, cu_k, 5, 4)
    torch.testing.assert_close(out.double(), per_sequence(q, k, v, cu_q, cu_k, False)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("change, error, match", [
    (dict(q=torch.zeros(2, 7, 2, 8)), ValueError, "q must be 3-D"),
    (dict(cu_seqlens_q=torch.tensor([1, 7], dtype=torch.int32)), ValueError, "rise from 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 5, 7], dtype=torch.int32)), ValueError, "same number"),
    (dict(cu_seqlens_k=torch.tensor([0, 8, 6], dtype=torch.int32)), ValueError, "rise from 0"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 7.0])), TypeError, "int32 or int64"),
    (dict(cu_seqlens_q=[0, 7]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (dict(max_seqlen_q=3), ValueError, "max_seqlen_q must be an int at least the longest"),
    (dict(max_seqlen_k=True), ValueError, "max_seqlen_k"),
    (dict(k=torch.zeros(7, 3, 8), v=torch.zeros(7, 3, 8)), ValueError, "multiple"),
    (dict(qk_quant="int2"), ValueError, "qk_quant"),
])
def test_bad_arguments(change: dict, error: type, match: str) -> None:
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                max_seqlen_k=4)
    options = {name: change.pop(name) for name in list(change) if name in ("qk_quant",)}
    args.update(change)
    with pytest.raises(error, match=match):
        sageattn_varlen(**args, **options)


def test_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = packed([3, 9, 4], [3, 9, 4], 4, 2, 16)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 9, 9, is_causal=True, return_lse=True)
        return out * 2 + lse.sum()

    want = f(q, k, v)
    got = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(got, want)
    graph = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(graph, want)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_varlen_on_the_gpu(attention_kernel: None, d: int, is_causal: bool) -> None:
    """Lengths from 1 to 8K: each sequence bit for bit its own sageattn call (the kernel forced),
    every output finite, and the shorter ones within the 8-bit bound of float64 attention."""
    from sageattention2.testing import relative_l1

    g = torch.Generator().manual_seed(d + is_causal)
    lengths = [1, 8192, 3, 1000, 4097, 77, 2, 513]
    lengths += torch.randint(1, 8193, (4,), generator=g).tolist()
    q, k, v, cu_q, cu_k = packed(lengths, lengths, 8, 2, d, torch.bfloat16, "cuda", seed=d)
    out = sageattn_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths), is_causal=is_causal,
                          qk_quant="int8")
    assert torch.isfinite(out).all()
    bounds = cu_q.tolist()
    for i in (0, 1, 3, 4, 7):
        s, e = bounds[i], bounds[i + 1]
        alone = sageattn(q[None, s:e], k[None, s:e], v[None, s:e], is_causal=is_causal,
                         tensor_layout="NHD", enable_gqa=True, qk_quant="int8")
        assert torch.equal(out[s:e], alone[0]), i
    for i in (2, 3, 5, 7):  # the shorter ones against float64 (the long ones: their own calls)
        s, e = bounds[i], bounds[i + 1]
        want = ref.exact_attention(*(t[None, s:e].transpose(1, 2) for t in (q, k, v)),
                                   is_causal=is_causal, enable_gqa=True)
        assert relative_l1(out[None, s:e].transpose(1, 2), want) < 0.06, i


def test_capture_needs_boundaries_read_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph capture forbids reading the GPU's boundaries: a clear error, unless the same
    tensors were read before (then nothing is read)."""
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8)
    _varlen._bounds_cache.clear()
    sageattn_varlen(q, k, v, cu_q, cu_k, 4, 4)  # read before the "capture"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    sageattn_varlen(q, k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(RuntimeError, match="before capturing"):
        sageattn_varlen(q, k, v, cu_q.clone(), cu_k, 4, 4)


def test_inference_boundaries_are_read_on_every_call() -> None:
    """Inference tensors have no version counter: their boundaries are read each call, so an
    in-place change is seen (and nothing crashes on the missing counter)."""
    with torch.inference_mode():
        q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8)
        sageattn_varlen(q, k, v, cu_q, cu_k, 4, 4)
        cu_q[1] = 2
        out = sageattn_varlen(q, k, v, cu_q, cu_k, 5, 4)
    torch.testing.assert_close(out.double(), per_sequence(q, k, v, cu_q, cu_k, False)[0], atol=1e-6, rtol=0)
