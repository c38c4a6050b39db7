"""sageattn_varlen (sageattention2/_varlen.py): packed sequences, each its own attention. On the
CPU every sequence is exact SDPA: the result must equal SDPA per sequence bit for bit; on the GPU,
sageattn per sequence bit for bit (the definition) and float64 within the 8-bit bound; the one
launch of the Hopper path (ops.sageattn_wgmma_varlen) bit for bit its chain of per-sequence ops."""
from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from helpers import meta, stand_in_kernel
from sageattention2 import _execute, _varlen, ops, sageattn, sageattn_varlen
from sageattention2 import reference as ref
from sageattention2.testing import cosine_similarity


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
                 cu_k: torch.Tensor, is_causal: bool, bottom_right: bool = False,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention and LSE of each sequence alone, packed (``bottom_right``: causal under
    FlashAttention's rule, query i seeing keys j <= i + n_k - n_q; a row that sees none 0, -inf;
    ``scale``: the softmax scale, None for 1 / sqrt(D))."""
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
        if bottom_right:
            n_q, n_k = qi.shape[2], ki.shape[2]
            mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
            out, lse = ref.exact_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True,
                                           scale=scale, return_lse=True)
        else:
            out, lse = ref.exact_attention(qi, ki, vi, is_causal=is_causal, enable_gqa=True,
                                           scale=scale, return_lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def assert_each_sequence_alone(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                               options: dict, context: object = None) -> None:
    """Each sequence with queries: sageattn_varlen's output and LSE rows bit for bit its own
    sageattn call's (``options`` sageattn_varlen's, with return_lse)."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        if bq[i + 1] > bq[i]:
            alone, alone_lse = sageattn(q[None, bq[i]:bq[i + 1]], k[None, bk[i]:bk[i + 1]],
                                        v[None, bk[i]:bk[i + 1]], tensor_layout="NHD",
                                        enable_gqa=True, **options)
            assert torch.equal(out[bq[i]:bq[i + 1]], alone[0]), (i, context, options)
            assert torch.equal(lse[:, bq[i]:bq[i + 1]], alone_lse[0]), (i, context, options)


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
    """Lengths from 1 to 8K, inputs with channel offsets and an outlier channel (as real Q, K, V:
    _drawn), on poisoned memory: every output element written and finite, each sequence bit for
    bit its own sageattn call (the kernel forced), and the shorter ones within the documented
    8-bit bound of float64 attention for the kernel that serves them (gpu_helpers.EXACT_L1_OF:
    rel. L1 0.05 with FP8 PV; the emulation of the Hopper kernel gives 0.019-0.034 on these
    inputs)."""
    from gpu_helpers import exact_l1_bound, sageattn_kernel
    from sageattention2.testing import poison_cuda_allocator, relative_l1

    g = torch.Generator().manual_seed(d + is_causal)
    lengths = [1, 8192, 3, 1000, 4097, 77, 2, 513]
    lengths += torch.randint(1, 8193, (4,), generator=g).tolist()
    gen = torch.Generator(device="cuda").manual_seed(d)
    q = _drawn(sum(lengths), 8, d, torch.bfloat16, gen)
    k, v = (_drawn(sum(lengths), 2, d, torch.bfloat16, gen) for _ in range(2))
    cu_q = cu_k = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    poison_cuda_allocator()
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
        q4, k4, v4 = (t[None, s:e].transpose(1, 2) for t in (q, k, v))
        want = ref.exact_attention(q4, k4, v4, is_causal=is_causal, enable_gqa=True)
        kernel = sageattn_kernel(q4, k4, v4, is_causal=is_causal, enable_gqa=True, qk_quant="int8")
        error = relative_l1(out[None, s:e].transpose(1, 2), want)
        assert error <= exact_l1_bound(kernel, None, want, out.dtype), (i, kernel, error)


@pytest.mark.gpu
@pytest.mark.parametrize("d,pv_quant,alignment", [
    (128, "auto", "bottom_right"), (96, "auto", "top_left"), (160, "auto", "bottom_right"),
    (80, "none", "bottom_right"), (64, "none", "top_left")])
def test_one_launch_padded_and_bottom_right(wgmma_kernel: None, d: int, pv_quant: str,
                                            alignment: str) -> None:
    """The one launch where it pads the head_dim (96 -> 128, 160 -> 256; the accurate tier 80
    -> 128) and for causal attention aligned to the bottom-right with queries and keys of
    different lengths (more queries than keys, fewer, as many, none): each sequence's output
    and LSE bit for bit its own sageattn call's (the kernel, qk_quant="int8"), every element
    finite, the rows that see no key 0 and -inf; on poisoned memory."""
    from sageattention2.testing import poison_cuda_allocator

    lengths_q = [1, 2000, 300, 5, 129, 77, 0]
    lengths_k = [3, 2000, 257, 0, 1000, 77, 9]
    g = torch.Generator(device="cuda").manual_seed(d)
    q = _drawn(sum(lengths_q), 4, d, torch.bfloat16, g)
    k, v = (_drawn(sum(lengths_k), 2, d, torch.bfloat16, g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    options = dict(is_causal=True, causal_alignment=alignment, qk_quant="int8", pv_quant=pv_quant,
                   return_lse=True)
    poison_cuda_allocator()
    calls = []
    run_packed = _varlen._run_packed
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_varlen, "_run_packed", lambda *a, **kw: calls.append(a[4]) or run_packed(*a, **kw))
        out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 2000, 2000, **options)
    # (causal spans; bottom-right also the unmasked keys of the sequences with n_q < n_k)
    assert calls == ([True, False] if alignment == "bottom_right" else [True])
    assert out.shape == q.shape and out.is_contiguous()
    bq = cu_q.tolist()
    assert_each_sequence_alone(out, lse, q, k, v, cu_q, cu_k, options)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    blind = lengths_q[3] if alignment == "top_left" else lengths_q[2] - lengths_k[2]
    rows = slice(bq[2], bq[2] + blind) if alignment == "bottom_right" else slice(bq[3], bq[4])
    assert (out[rows] == 0).all() and (lse[:, rows] == -math.inf).all()


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


def test_packed_items() -> None:
    """The one launch's tables: each sequence's key range and sample stride, its queries, and its
    first code row (the earlier sequences' keys rounded up to 128); each block of 128 queries."""
    table, blocks, code_rows = ops.packed_items(
        [(0, 5, 0, 130), (5, 262, 130, 131), (262, 266, 131, 400)], lambda n: n | 1)
    assert code_rows == 256 + 128 + 384
    assert table.dtype == torch.int32 and table.tolist() == [
        [[0, 130, 131], [130, 131, 1], [131, 400, 269]], [[0, 5, 0], [5, 262, 256], [262, 266, 384]]]
    assert blocks.dtype == torch.int32 and blocks.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0]]
    rows = ops.packed_v_rows(table, 410, code_rows)  # each key's row, then the pad rows
    assert rows.dtype == torch.int64 and rows.tolist() == [
        *range(130), 256, *range(384, 384 + 269), *[code_rows] * 10,
        *range(130, 256), *range(257, 384), *range(384 + 269, code_rows)]


def hopper_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_quant: str, pv_quant: str,
                  smooth_q: object) -> object:
    """_varlen._one_launch as on the H100, for any head_dim."""
    return _varlen._Launch("wgmma", q.shape[-1], "input" if pv_quant == "none" else "fp8")


def test_one_launch_runs_the_sequences_with_queries_and_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routed to the one launch (the op stood in for by exact attention per item of its table):
    the op sees every sequence with queries and keys once, with its own sample stride; a
    sequence with queries and no keys gets zeros and LSE -inf; the result is attention per
    sequence."""
    seen: list[tuple[object, ...]] = []
    rows_seen: list[list[int] | None] = []

    def stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: torch.Tensor,
                 blocks: torch.Tensor, max_k: int, code_rows: int, smooth_k: bool, smooth_v: bool,
                 sm_scale: float, is_causal: bool, return_lse: bool,
                 v_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append((items.tolist(), blocks.tolist(), code_rows, max_k, smooth_k, smooth_v, is_causal))
        rows_seen.append(None if v_rows is None else v_rows.tolist())
        return exact_items(q, k, v, items, sm_scale, is_causal, return_lse)

    monkeypatch.setattr(_varlen, "_one_launch", hopper_launch)
    monkeypatch.setattr(ops, "sageattn_wgmma_varlen", stand_in)
    _varlen._packed_items.cache_clear()
    lengths_q, lengths_k = [5, 1, 0, 13, 7, 300], [5, 3, 4, 13, 0, 260]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 8)
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 300, 260, return_lse=True)
    stride = _execute.smoothing_sample_stride
    assert seen == [([[[0, 5, stride(5)], [5, 8, stride(3)], [12, 25, stride(13)], [25, 285, stride(260)]],
                      [[0, 5, 0], [5, 6, 128], [6, 19, 256], [26, 326, 384]]],
                     [[0, 0], [1, 0], [2, 0], [3, 0], [3, 1], [3, 2]], 384 + 384, 260, True, False, False)]
    want, want_lse = per_sequence(q, k, v, cu_q, cu_k, False)
    want_top_left = want
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    assert (out[19:26] == 0).all() and (lse[:, 19:26] == -math.inf).all()
    out = sageattn_varlen(q, k, v, cu_q, cu_k, 300, 260)  # the same boundaries: the table is kept
    assert _varlen._packed_items.cache_info().hits == 1 and out.shape == q.shape
    # Causal, top-left per sequence (SDPA's rule), in the one launch.
    out = sageattn_varlen(q, k, v, cu_q, cu_k, 300, 260, is_causal=True)
    assert seen[-1][-1] is True
    torch.testing.assert_close(out.double(), per_sequence(q, k, v, cu_q, cu_k, True)[0], atol=1e-6, rtol=0)
    # Bottom-right (flash-attn's rule): each sequence's last min(n_q, n_k) queries over its last
    # as many keys, causal; then the queries of the one with fewer queries than keys (1 of 3)
    # over its other keys, unmasked, merged by the LSE; the first 40 queries of 300 over 260
    # keys, and the 7 queries without keys, see none.
    calls = len(seen)
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 300, 260, is_causal=True, return_lse=True,
                               causal_alignment="bottom_right")
    assert [(s[0][1], s[-1]) for s in seen[calls:]] == [
        ([[0, 5, 0], [5, 6, 128], [6, 19, 256], [66, 326, 384]], True), ([[5, 6, 0]], False)]
    want, want_lse = per_sequence(q, k, v, cu_q, cu_k, True, bottom_right=True)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    assert (out[19:66] == 0).all() and (lse[:, 19:66] == -math.inf).all()
    assert torch.equal(sageattn_varlen(q, k, v, cu_q, cu_k, 300, 260, is_causal=True,
                                       causal_alignment="bottom_right"), out)
    calls = len(seen)
    sageattn_varlen(q, q, q, cu_q, cu_q, 300, 300, is_causal=True, causal_alignment="bottom_right")
    assert len(seen) == calls + 1  # (equal lengths: the two rules agree, one launch)
    # A head_dim the kernel is not built for: zero-padded (here 8 -> 24), the true one's scale,
    # the output cut back.
    monkeypatch.setattr(_varlen, "_one_launch", lambda *_: _varlen._Launch("wgmma", 24, "fp8"))
    out = sageattn_varlen(q, k, v, cu_q, cu_k, 300, 260)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), want_top_left, atol=1e-6, rtol=0)
    monkeypatch.setattr(_varlen, "_one_launch", hopper_launch)
    # The accurate tier: the same launch with each key's row in V's zero-padded copy (the keys
    # of the sequence without queries, 25..29, to the scratch row after the copy).
    assert rows_seen[-1] is None
    out = sageattn_varlen(q, k, v, cu_q, cu_k, 300, 260, pv_quant="none")
    assert rows_seen[-1] == [*range(5), *range(128, 131), *[768] * 4, *range(256, 269), *range(384, 644),
                             *range(5, 128), *range(131, 256), *range(269, 384), *range(644, 768)]
    torch.testing.assert_close(out.double(), want_top_left, atol=1e-6, rtol=0)


@pytest.mark.parametrize("capability,wgmma", [((8, 9), False), ((8, 0), False), ((9, 0), True)])
def test_one_launch_follows_the_routes(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                       wgmma: bool) -> None:
    """_one_launch takes sageattn's routes for INT8 QK without Q smoothing: the Hopper kernel's
    tiers on sm_90; elsewhere the warp-level kernel, FP8 PV where it is native (sm_89) or asked
    for, else 16-bit, up to head_dim 128 (smaller multiples of 8 padded); INT4, Q smoothing,
    other dtypes and head dims the kernels do not run: one call per sequence (None)."""
    from types import SimpleNamespace

    from sageattention2 import _plan

    target = _plan.Target("cuda", capability, True, True, mma_code=True, wgmma=wgmma, mma_fp8=True,
                          native_fp8=_plan.native_fp8_mma(capability))
    monkeypatch.setattr(_plan, "target_of", lambda device: target)
    monkeypatch.setattr(_plan, "device_reason", lambda device: None)
    monkeypatch.setattr(ops, "has_op", lambda name: True)

    def launch(d: int, qk: str = "auto", pv: str = "auto", smooth_q: object = "auto",
               dtype: torch.dtype = torch.float16, requires_grad: bool = False) -> object:
        t = SimpleNamespace(shape=(10, 4, d), dtype=dtype, is_cuda=True, device=None,
                            requires_grad=requires_grad)
        return _varlen._one_launch(t, t, t, qk, pv, smooth_q)

    Launch = _varlen._Launch
    # Inputs that require grad: the packed launch has no backward (it would cut the gradients).
    assert launch(128, requires_grad=True) is None
    with torch.no_grad():
        assert launch(128, requires_grad=True) is not None
    if wgmma:
        assert launch(128) == Launch("wgmma", 128, "fp8")
        assert launch(160) == Launch("wgmma", 256, "fp8")
        assert launch(96, pv="none") == Launch("wgmma", 128, "input")
        assert launch(160, pv="none") is None
    else:
        auto_pv = "fp8" if capability == (8, 9) else "input"
        assert launch(128) == Launch("mma", 128, auto_pv)
        assert launch(40) == Launch("mma", 64, auto_pv)
        assert launch(64, pv="none") == Launch("mma", 64, "input")
        assert launch(64, pv="fp8") == Launch("mma", 64, "fp8")
        assert launch(160) is None
    assert launch(128, qk="int4") is None and launch(128, smooth_q=True) is None
    assert launch(128, dtype=torch.float32) is None and launch(100) is None
    # The warp-level kernel's FP8 PV takes its statistics over every key (sample stride 1).
    spans = ((0, 5, 0, 300), (5, 9, 300, 301))
    assert [r[2] for r in _varlen._packed_tables(spans, True)[0][0][0].tolist()] == [1, 1]
    assert _varlen._packed_tables(spans)[0][0][0].tolist()[0][2] == _execute.smoothing_sample_stride(300)


# ------------------------------------------------------------------------------------------------
# The options of sageattn_varlen reach what runs: each sequence's sageattn call, or the one launch
# ------------------------------------------------------------------------------------------------


def kernel_fields(call: _execute.KernelCall) -> dict[str, object]:
    """What of a sequence's kernel call the options decide."""
    return dict(sm_scale=call.sm_scale, smooth_k=call.smooth_k, smooth_q=call.smooth_q,
                smooth_v=call.smooth_v, kernel=call.choice.kernel, qk=call.choice.qk)


# A sequence's kernel call with sageattn_varlen's defaults at head_dim 16 on an H100: the scale
# 1 / sqrt(16), K smoothed, Q and V not (INT8 QK; smooth_v "auto" is off up to 128), the Hopper
# kernel.
DEFAULT_KERNEL_CALL = dict(sm_scale=0.25, smooth_k=True, smooth_q=False, smooth_v=False,
                           kernel="wgmma", qk="int8")


@pytest.mark.parametrize("option, changed", [
    pytest.param(dict(scale=0.3), dict(sm_scale=0.3), id="scale"),
    pytest.param(dict(smooth_k=False), dict(smooth_k=False), id="smooth_k"),
    # (Q smoothing runs on the warp-level kernel: the Hopper kernel does not smooth Q)
    pytest.param(dict(smooth_q=True), dict(smooth_q=True, kernel="mma"), id="smooth_q"),
    pytest.param(dict(smooth_v=True), dict(smooth_v=True), id="smooth_v"),
    # (INT4 QK: the warp-level kernel, Q smoothed by smooth_q="auto")
    pytest.param(dict(qk_quant="int4"), dict(qk="int4", kernel="mma", smooth_q=True), id="int4"),
])
def test_options_reach_each_sequences_call(monkeypatch: pytest.MonkeyPatch,
                                           option: dict[str, object],
                                           changed: dict[str, object]) -> None:
    """Where each sequence runs as its own sageattn call (CPU tensors: no one launch; routed as
    on an H100, each kernel call stood in for by exact attention with its scale), the option
    reaches every sequence's kernel call, which differs from the default call in what the
    option changes and nothing else; each sequence's output and LSE are its own sageattn call's
    with the option, bit for bit; with ``scale``, float64 attention at that scale."""
    calls = stand_in_kernel(monkeypatch, lambda call, q, k: (call,))
    lengths_q, lengths_k = [5, 0, 13, 7, 2], [9, 4, 13, 1, 0]  # no queries; no keys (no call)
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 16, torch.float16)
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 13, 13, return_lse=True, **option)
    assert [kernel_fields(c) for (c,) in calls] == [{**DEFAULT_KERNEL_CALL, **changed}] * 3
    assert_each_sequence_alone(out, lse, q, k, v, cu_q, cu_k, {**option, "return_lse": True})
    if "scale" in option:
        want, want_lse = per_sequence(q, k, v, cu_q, cu_k, False, scale=0.3)
        torch.testing.assert_close(out.double(), want, atol=1e-3, rtol=0)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
        assert not torch.equal(out, sageattn_varlen(q, k, v, cu_q, cu_k, 13, 13))


def test_strict_reaches_each_sequences_call() -> None:
    """strict=True raises where a sequence's call would fall back to exact attention (on the CPU
    every call does: no GPU), naming the reason, as sageattn does; without it the fallback
    warns and computes."""
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8)
    with pytest.raises(NotImplementedError, match="strict=True"):
        sageattn_varlen(q, k, v, cu_q, cu_k, 4, 4, strict=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = sageattn_varlen(q, k, v, cu_q, cu_k, 4, 4)
    assert any("exact" in str(w.message) for w in record)
    torch.testing.assert_close(out.double(), per_sequence(q, k, v, cu_q, cu_k, False)[0], atol=1e-6, rtol=0)


def exact_items(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: torch.Tensor,
                sm_scale: float, is_causal: bool, return_lse: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What a one-launch op computes, in float64 per item of its table: its queries over its keys
    at ``sm_scale`` (rows of no item NaN)."""
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), math.nan, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan)
    for (k0, k1, _), (q0, q1, _) in zip(*items.tolist()):
        o, l = ref.exact_attention(*(t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                                   is_causal=is_causal, scale=sm_scale, enable_gqa=True,
                                   return_lse=True)
        out[q0:q1] = o[0].transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = l[0].float()
    return out, lse if return_lse else q.new_empty(0)


@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
def test_options_reach_the_one_launch(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Routed to the one launch of either kernel (its op stood in for by exact attention per item
    at the scale it is given): ``scale``, ``smooth_k`` and ``smooth_v`` reach the op (the
    defaults: 1 / sqrt(D) of the true head_dim, K smoothed, V not at head_dim 128 and below, on
    above), and the output is attention per sequence at that scale."""
    seen: list[tuple[object, ...]] = []

    def wgmma_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: torch.Tensor,
                 blocks: torch.Tensor, max_k: int, code_rows: int, smooth_k: bool, smooth_v: bool,
                 sm_scale: float, is_causal: bool, return_lse: bool,
                 v_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(("wgmma", smooth_k, smooth_v, sm_scale))
        return exact_items(q, k, v, items, sm_scale, is_causal, return_lse)

    def mma_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: torch.Tensor,
               blocks: torch.Tensor, max_k: int, code_rows: int, pv: str, smooth_k: bool,
               smooth_v: bool, sm_scale: float, is_causal: bool, return_lse: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(("mma", smooth_k, smooth_v, sm_scale))
        return exact_items(q, k, v, items, sm_scale, is_causal, return_lse)

    monkeypatch.setattr(_varlen, "_one_launch",
                        lambda q, *_: _varlen._Launch(kernel, q.shape[-1], "fp8"))
    monkeypatch.setattr(ops, "sageattn_wgmma_varlen", wgmma_op)
    monkeypatch.setattr(ops, "sageattn_mma_varlen", mma_op)
    lengths_q, lengths_k = [5, 1, 13, 7], [5, 3, 13, 20]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 16)
    default = sageattn_varlen(q, k, v, cu_q, cu_k, 13, 20)
    assert seen == [(kernel, True, False, 0.25)]
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 13, 20, scale=0.3, smooth_k=False,
                               smooth_v=True, return_lse=True)
    assert seen[1:] == [(kernel, False, True, 0.3)]
    want, want_lse = per_sequence(q, k, v, cu_q, cu_k, False, scale=0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=0)
    assert not torch.equal(out, default)
    # smooth_v="auto" turns V's smoothing on above head_dim 128 (as sageattn).
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 2, 2, 136)
    sageattn_varlen(q, k, v, cu_q, cu_k, 13, 20)
    assert seen[2:] == [(kernel, True, True, 1.0 / math.sqrt(136))]


@pytest.mark.gpu
@pytest.mark.usefixtures("wgmma_kernel")
@pytest.mark.parametrize("option", ["scale", "smooth_k", "smooth_v", "smooth_q", "int4"])
def test_varlen_options_on_the_gpu(option: str) -> None:
    """Each option on the H100/H200's kernels (``scale``, ``smooth_k`` and ``smooth_v`` in the one
    launch of the Hopper kernel, FP8 PV; Q smoothing and INT4 QK one sageattn call per sequence
    on the warp-level kernel), inputs with channel offsets and an outlier channel, on poisoned
    memory: every element written and finite, each sequence bit for bit its own sageattn call
    with the option, and the option honoured: the output differs from the call without it, and
    with ``scale`` each sequence is within the documented FP8 bound of float64 attention at that
    scale (the emulation gives 0.021-0.036 on these inputs)."""
    from gpu_helpers import EXACT_L1_FP8, mma_fp8_on_device
    from sageattention2.testing import poison_cuda_allocator, relative_l1

    if option == "int4" and not mma_fp8_on_device():
        pytest.skip("INT4 QK needs FP8 PV (sm_89+)")
    base = dict(qk_quant="int8", pv_quant="fp8", return_lse=True)
    options = {**base, **{"scale": dict(scale=0.15), "smooth_k": dict(smooth_k=False),
                          "smooth_v": dict(smooth_v=True), "smooth_q": dict(smooth_q=True),
                          "int4": dict(qk_quant="int4")}[option]}
    lengths_q, lengths_k = [1, 300, 77, 1000, 129], [5, 300, 200, 1000, 1]
    g = torch.Generator(device="cuda").manual_seed(5)
    q = _drawn(sum(lengths_q), 4, 128, torch.float16, g)
    k, v = (_drawn(sum(lengths_k), 2, 128, torch.float16, g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    poison_cuda_allocator()
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 1000, 1000, **options)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_each_sequence_alone(out, lse, q, k, v, cu_q, cu_k, options, option)
    without, _ = sageattn_varlen(q, k, v, cu_q, cu_k, 1000, 1000, **base)
    assert not torch.equal(out, without)
    if option == "scale":
        want, _ = per_sequence(*(t.cpu() for t in (q, k, v, cu_q, cu_k)), False, scale=0.15)
        bq = cu_q.tolist()
        for i in range(len(lengths_q)):
            error = relative_l1(out[bq[i]:bq[i + 1]].cpu(), want[bq[i]:bq[i + 1]])
            assert error <= EXACT_L1_FP8, (i, error)


@pytest.mark.gpu
@pytest.mark.parametrize("d,alignment", [(128, "top_left"), (96, "bottom_right"), (64, "bottom_right")])
def test_varlen_as_on_a_gpu_without_the_hopper_kernel(attention_kernel: None,
                                                      monkeypatch: pytest.MonkeyPatch, d: int,
                                                      alignment: str) -> None:
    """sageattn_varlen routed as on Ampere (the warp-level kernel, 16-bit PV; here on the H100
    with the Hopper kernel hidden from the routes): one launch (or two, bottom-right with fewer
    queries than keys), each sequence bit for bit its own sageattn call under the same routes,
    head_dim 96 padded to 128, rows that see no key 0 and -inf, on poisoned memory."""
    from sageattention2 import _plan
    from sageattention2.testing import poison_cuda_allocator

    hopper = _plan.target_of(torch.device("cuda"))
    ampere = hopper._replace(wgmma=False, native_fp8=False)
    monkeypatch.setattr(_plan, "target_of", lambda device: ampere)
    launches: list[object] = []
    run_packed = _varlen._run_packed
    monkeypatch.setattr(_varlen, "_run_packed",
                        lambda *a, **kw: launches.append(kw["launch"]) or run_packed(*a, **kw))
    lengths_q, lengths_k = [1, 2000, 300, 5, 129, 0], [3, 2000, 257, 0, 1000, 9]
    g = torch.Generator(device="cuda").manual_seed(d)
    q = _drawn(sum(lengths_q), 4, d, torch.float16, g)
    k, v = (_drawn(sum(lengths_k), 2, d, torch.float16, g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    options = dict(is_causal=True, causal_alignment=alignment, qk_quant="int8", return_lse=True)
    poison_cuda_allocator()
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 2000, 2000, **options)
    assert launches and all(x == _varlen._Launch("mma", 128 if d > 64 else 64, "input") for x in launches)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_each_sequence_alone(out, lse, q, k, v, cu_q, cu_k, options)
    bq = cu_q.tolist()
    assert (out[bq[3]:bq[4]] == 0).all() and (lse[:, bq[3]:bq[4]] == -math.inf).all()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(24))
def test_varlen_random_configurations(attention_kernel: None, monkeypatch: pytest.MonkeyPatch,
                                      seed: int) -> None:
    """Random packed batches (1-6 sequences of 0 to 1,500 queries and keys, primes among them;
    grouped-query heads; head_dim 40-256, padded where the kernel is not built for it; fp16 or
    bf16; causal top-left or bottom-right or not; FP8 PV or the accurate tier; the Hopper routes
    or, every other seed, the warp-level kernel's as on Ampere): every sequence bit for bit its
    own sageattn call (qk_quant="int8"), on poisoned memory, every element finite."""
    import random

    from sageattention2 import _plan
    from sageattention2.testing import poison_cuda_allocator

    rng = random.Random(seed)
    if seed % 2:
        ampere = _plan.target_of(torch.device("cuda"))._replace(wgmma=False, native_fp8=False)
        monkeypatch.setattr(_plan, "target_of", lambda device: ampere)
    lengths = (0, 1, 2, 3, 7, 31, 127, 128, 129, 257, 500, 1021, 1500)
    sequences = rng.randint(1, 6)
    lengths_q = [rng.choice(lengths) for _ in range(sequences)]
    lengths_k = [rng.choice(lengths) for _ in range(sequences)]
    if sum(lengths_q) == 0:
        lengths_q[0] = 5
    hkv = rng.choice((1, 2))
    hq = hkv * rng.choice((1, 2))
    d = rng.choice((40, 64, 96, 128, 160, 256))
    dtype = rng.choice((torch.float16, torch.bfloat16))
    causal = rng.random() < 0.6
    options = dict(is_causal=causal, qk_quant="int8", return_lse=True,
                   causal_alignment=rng.choice(("top_left", "bottom_right")) if causal else "top_left",
                   pv_quant=rng.choice(("auto", "none")))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = _drawn(sum(lengths_q), hq, d, dtype, g)
    k, v = (_drawn(sum(lengths_k), hkv, d, dtype, g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    poison_cuda_allocator()
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **options)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_each_sequence_alone(out, lse, q, k, v, cu_q, cu_k, options, (lengths_q, lengths_k, d))


def test_mma_one_launch_op_checks_its_arguments() -> None:
    """sageattn_mma_varlen's Meta implementation: its shapes, and the argument it refuses."""
    if not ops.has_op("sageattn_mma_varlen"):
        pytest.skip("no extension")
    op = torch.ops.sageattention2.sageattn_mma_varlen
    q, k, items = meta(30, 4, 64), meta(20, 2, 64), meta(2, 3, 3, dtype=torch.int32)
    blocks = meta(3, 2, dtype=torch.int32)
    out, lse = op(q, k, k, items, blocks, 16, 384, "fp8", True, False, 0.125, False, True)
    assert out.shape == q.shape and lse.shape == (4, 30)
    for args, message in [
            ((meta(30, 4, 256), meta(20, 2, 256), meta(20, 2, 256), items, blocks, 16, 384, "fp8"),
             "head_dim 64 or 128"),
            ((q, k, k, items, blocks, 16, 384, "e5m2"), "pv_dtype must be 'fp8' or 'input'"),
            ((q, k, k, items, blocks, 16, 100, "input"), "code_rows must be a positive multiple of 128")]:
        with pytest.raises(RuntimeError, match=message):
            op(*args, True, False, 0.125, False, False)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,pv,smooth_k,smooth_v,causal", [
    (64, torch.float16, "input", True, False, False), (128, torch.bfloat16, "input", True, False, True),
    (128, torch.float16, "input", False, False, False), (64, torch.bfloat16, "input", True, False, True),
    (64, torch.float16, "fp8", True, True, False), (128, torch.bfloat16, "fp8", True, False, True),
    (128, torch.float16, "fp8", False, True, False), (64, torch.bfloat16, "fp8", True, True, True)])
def test_mma_one_launch_is_each_sequence_alone(attention_kernel: None, d: int, dtype: torch.dtype,
                                               pv: str, smooth_k: bool, smooth_v: bool,
                                               causal: bool) -> None:
    """ops.sageattn_mma_varlen (the warp-level kernel; on the H100 forced, as on Ada/Ampere it is
    sageattn_varlen's path): every sequence's output and LSE what sageattn_mma computes for it
    alone (its chain), on poisoned memory, lengths 1 to 4K, primes, queries and keys of different
    lengths, grouped-query heads; 16-bit PV bit for bit; FP8 PV, whose means over every key the
    one launch sums in another order (one CTA per sequence and head), within 1e-3; every element
    written and finite."""
    from sageattention2.testing import poison_cuda_allocator, relative_l1

    if pv == "fp8" and not ops.has_op("attention_mma"):
        pytest.skip("no attention_mma")
    g = torch.Generator(device="cuda").manual_seed(d + smooth_k + 2 * causal)
    lengths_q = [1, 4096, 3, 1000, 2049, 77, 2, 513, 131, 127]
    lengths_k = [1, 4096, 1, 999, 2049, 128, 300, 513, 2, 129]
    q = _drawn(sum(lengths_q), 8, d, dtype, g)
    k, v = (_drawn(sum(lengths_k), 2, d, dtype, g) for _ in range(2))
    bq, bk = [0, *itertools.accumulate(lengths_q)], [0, *itertools.accumulate(lengths_k)]
    stride = (lambda _: 1) if pv == "fp8" else _execute.smoothing_sample_stride
    items, blocks, code_rows = ops.packed_items(list(zip(bq, bq[1:], bk, bk[1:])), stride)
    args = (q, k, v, items.cuda(), blocks.cuda(), max(lengths_k), code_rows, pv, smooth_k, smooth_v,
            d ** -0.5, causal, True)
    poison_cuda_allocator()
    out, lse = ops.sageattn_mma_varlen(*args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want, want_lse = ops.sageattn_mma_varlen_chain(*args)
    if pv == "input" or not smooth_k and not smooth_v:
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    else:
        assert relative_l1(out.float(), want.float()) < 1e-3
        assert (lse - want_lse).abs().max().item() < 1e-3


def test_one_launch_op_checks_its_arguments() -> None:
    """The op names the argument and what it allows (its Meta implementation validates as the
    CUDA one does)."""
    if not ops.has_op("sageattn_wgmma_varlen"):
        pytest.skip("no extension")
    op = torch.ops.sageattention2.sageattn_wgmma_varlen
    q, k, items = meta(30, 4, 64), meta(20, 2, 64), meta(2, 3, 3, dtype=torch.int32)
    blocks = meta(3, 2, dtype=torch.int32)
    out, lse = op(q, k, k, items, blocks, 16, 384, True, False, 0.125, False, True)
    assert out.shape == q.shape and lse.shape == (4, 30)
    rows = meta(20, dtype=torch.int64)
    out, lse = op(q, k, k, items, blocks, 16, 384, True, False, 0.125, False, True, rows)
    assert out.shape == q.shape and lse.shape == (4, 30)
    for bad_rows, shape_args, message in [
            (rows.int(), (q, k, k), r"v_rows must be an int64 \[total_k"),
            (meta(19, dtype=torch.int64), (q, k, k), r"v_rows must be an int64 \[total_k"),
            (meta(20 + 385, dtype=torch.int64), (q, k, k), r"at most code_rows pad rows"),
            (rows, (meta(30, 4, 256), meta(20, 2, 256), meta(20, 2, 256)), "head_dim 64 or 128")]:
        with pytest.raises(RuntimeError, match=message):
            op(*shape_args, items, blocks, 16, 384, True, False, 0.125, False, False, bad_rows)
    bad = [
        ((meta(30, 4, 96), k, k, items, blocks, 16, 384), "head_dim 64, 128 or 256"),
        ((q, meta(20, 3, 64), meta(20, 3, 64), items, blocks, 16, 384), "multiple of kv_heads"),
        ((q, k, k, meta(3, 3, dtype=torch.int32), blocks, 16, 384), r"int32 \[2, sequences, 3\]"),
        ((q, k, k, items.long(), blocks, 16, 384), "int32"),
        ((q, k, k, items, meta(3, 3, dtype=torch.int32), 16, 384), r"blocks must be a contiguous int32"),
        ((q, k, k, items, blocks, 0, 384), "max_seqlen_k must be >= 1"),
        ((q, k, k, items, blocks, 16, 100), "code_rows must be a positive multiple of 128"),
        ((q.float(), k, k, items, blocks, 16, 384), "float16 or bfloat16"),
        ((meta(30, 4, 1, 64), k, k, items, blocks, 16, 384), "must be 3-D"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            op(*args, True, False, 0.125, False, False)


def _drawn(n: int, h: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Tokens with a channel-wise offset and one outlier channel, as real Q/K/V have."""
    x = torch.randn(n, h, d, device="cuda", generator=g)
    x = x + 3 * torch.randn(1, h, d, device="cuda", generator=g)
    x[:, :, 5] *= 20
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,smooth_k,smooth_v,causal,accurate", [
    (64, torch.float16, True, False, False, False), (128, torch.bfloat16, True, True, False, False),
    (128, torch.float16, False, False, False, False), (64, torch.bfloat16, False, True, False, False),
    (128, torch.bfloat16, True, False, True, False), (64, torch.float16, True, True, True, False),
    (256, torch.float16, True, True, False, False), (256, torch.bfloat16, True, True, True, False),
    (64, torch.float16, True, False, False, True), (128, torch.bfloat16, True, False, False, True),
    (64, torch.bfloat16, False, False, True, True), (128, torch.float16, True, True, True, True)])
def test_one_launch_is_each_sequence_alone(wgmma_kernel: None, d: int, dtype: torch.dtype,
                                           smooth_k: bool, smooth_v: bool, causal: bool,
                                           accurate: bool) -> None:
    """ops.sageattn_wgmma_varlen: every sequence's output and LSE bit for bit what the Hopper path
    computes for it alone (the chain: its own smoothing_stats, quantize_kv and attention_wgmma),
    on poisoned memory; lengths from 1 to 8K, primes, queries and keys of different lengths,
    grouped-query heads; causal: each sequence's diagonal top-left; FP8 PV or the accurate tier
    (V through its zero-padded copy); every element written and finite."""
    from sageattention2.testing import poison_cuda_allocator

    g = torch.Generator(device="cuda").manual_seed(d + smooth_k)
    lengths_q = [1, 8192, 3, 1000, 4097, 77, 2, 513, 131, 127]
    lengths_k = [1, 8192, 1, 999, 4097, 128, 300, 513, 2, 129]
    q = _drawn(sum(lengths_q), 8, d, dtype, g)
    k, v = (_drawn(sum(lengths_k), 2, d, dtype, g) for _ in range(2))
    bq, bk = [0, *itertools.accumulate(lengths_q)], [0, *itertools.accumulate(lengths_k)]
    items, blocks, code_rows = ops.packed_items(list(zip(bq, bq[1:], bk, bk[1:])),
                                                _execute.smoothing_sample_stride)
    v_rows = ops.packed_v_rows(items, k.shape[0], code_rows).cuda() if accurate else None
    args = (q, k, v, items.cuda(), blocks.cuda(), max(lengths_k), code_rows, smooth_k, smooth_v,
            d ** -0.5, causal, True, v_rows)
    poison_cuda_allocator()
    out, lse = ops.sageattn_wgmma_varlen(*args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want, want_lse = ops.sageattn_wgmma_varlen_chain(*args)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
def test_one_launch_sequences_without_keys_or_queries(wgmma_kernel: None) -> None:
    """sageattn_varlen's one launch on poisoned memory: a sequence with queries and no keys gets
    zeros and LSE -inf, one with no queries nothing; the others within the 8-bit bound of
    float64 attention per sequence."""
    from sageattention2.testing import poison_cuda_allocator, relative_l1

    lengths_q, lengths_k = [5, 0, 300, 7, 129, 1], [5, 4, 0, 200, 1, 77]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 64, torch.float16, "cuda", seed=3)
    poison_cuda_allocator()
    out, lse = sageattn_varlen(q, k, v, cu_q, cu_k, 300, 200, return_lse=True, qk_quant="int8")
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert (out[5:305] == 0).all() and (lse[:, 5:305] == -math.inf).all()
    want, want_lse = per_sequence(*(t.cpu() for t in (q, k, v, cu_q, cu_k)), False)
    assert relative_l1(out.cpu().double()[None], want[None]) < 0.05
    finite = torch.isfinite(want_lse)
    assert (lse.cpu().double()[finite] - want_lse[finite]).abs().max() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("accurate", [False, True])
def test_one_launch_keeps_a_nan_in_its_sequence(wgmma_kernel: None, accurate: bool) -> None:
    """A NaN in one sequence's V reaches that sequence's rows (as SDPA's) and no other's: the
    accurate tier reads V through a zero-padded copy, so a sequence's last tile of 128 keys never
    reaches the next sequence's keys; the other sequences' rows are their chain's, bit for bit."""
    lengths = [5, 7, 130, 3]
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (_drawn(sum(lengths), 2, 64, torch.float16, g) for _ in range(3))
    bounds = [0, *itertools.accumulate(lengths)]
    items, blocks, code_rows = ops.packed_items(list(zip(bounds, bounds[1:], bounds, bounds[1:])),
                                                _execute.smoothing_sample_stride)
    v_rows = ops.packed_v_rows(items, k.shape[0], code_rows).cuda() if accurate else None
    v[bounds[1]] = math.nan  # the second sequence's first key
    args = (q, k, v, items.cuda(), blocks.cuda(), max(lengths), code_rows, True, False, 0.125, False,
            True, v_rows)
    out, lse = ops.sageattn_wgmma_varlen(*args)
    want, _ = ops.sageattn_wgmma_varlen_chain(*args)
    second = slice(bounds[1], bounds[2])
    assert torch.isnan(out[second]).all()
    others = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    others[second] = False
    assert torch.isfinite(out[others]).all() and torch.equal(out[others], want[others])


def test_varlen_gradients_are_not_cut(attention_kernel: None) -> None:
    """Inputs that require grad do not take the packed launch (it has no backward): each
    sequence runs as its own sageattn call, and the gradients are exact SDPA's per sequence."""
    torch.manual_seed(11)
    lengths = (300, 77, 512)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = sageattn_varlen(*leaves, cu, cu, max(lengths), max(lengths), is_causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = [t.detach().double().requires_grad_() for t in (q, k, v)]
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        part = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in want), is_causal=True)
        (part.transpose(0, 1) * dout[a:b].double()).sum().backward()
    for leaf, w in zip(leaves, want):
        assert leaf.grad is not None and cosine_similarity(leaf.grad, w.grad) >= 0.9999
