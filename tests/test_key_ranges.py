"""Key-padding masks on the quantized kernels (sageattention2/_key_ranges.py): which masks
qualify, and a masked call run as unmasked kernel calls on each batch item's range of keys. On
the CPU the kernel is a stand-in (exact attention on what it is given, recorded): the test is the
split and the reassembly, against SDPA with the mask; the kernels are tested on the GPU."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from helpers import ORIGINAL_SDPA, fallback_warnings, meta, qkv, stand_in_kernel
from sageattention2 import _key_ranges, sageattn
from sageattention2 import reference as ref
from sageattention2.api import explain

NEG = -math.inf


def key_mask(ranges: list[tuple[int, int]], n_k: int, kind: str = "bool") -> torch.Tensor:
    """A [B, 1, 1, n_k] mask keeping each item's range."""
    index = torch.arange(n_k)
    keep = torch.stack([(index >= s) & (index < e) for s, e in ranges])[:, None, None]
    if kind == "bool":
        return keep
    low = NEG if kind == "-inf" else torch.finfo(torch.float16).min
    return torch.zeros(keep.shape, dtype=torch.float16).masked_fill(~keep, low)


@pytest.mark.parametrize("kind", ["bool", "-inf", "finfo.min"])
def test_key_ranges_found(kind: str) -> None:
    ranges = [(0, 5), (3, 9), (0, 9)]  # right padding, left padding, none
    assert _key_ranges.key_ranges(key_mask(ranges, 9, kind), 3, 9) == tuple(ranges)
    one = key_mask([(0, 4)], 9, kind)  # broadcast over the batch
    assert _key_ranges.key_ranges(one, 3, 9) == ((0, 4),) * 3
    assert _key_ranges.key_ranges(one[0, 0], 3, 9) == ((0, 4),) * 3  # [1, N_kv] broadcasting
    assert _key_ranges.key_ranges(one[0, 0, 0], 3, 9) == ((0, 4),) * 3  # [N_kv]


def test_other_masks_do_not_qualify() -> None:
    keep = key_mask([(0, 5), (2, 9)], 9)
    holes = keep.clone()
    holes[0, 0, 0, 2] = False
    assert _key_ranges.key_ranges(holes, 2, 9) is None  # not contiguous
    assert _key_ranges.key_ranges(key_mask([(0, 5), (4, 4)], 9), 2, 9) is None  # no key left
    assert _key_ranges.key_ranges(keep.expand(2, 1, 7, 9), 2, 9) is None  # rows for 1 query
    per_query = keep.expand(2, 1, 7, 9).clone()
    assert _key_ranges.key_ranges(per_query, 2, 9, 7) == ((0, 5), (2, 9))  # equal rows
    per_query[1, 0, 6, 2] = False
    assert _key_ranges.key_ranges(per_query, 2, 9, 7) is None  # rows that differ
    assert _key_ranges.key_ranges(keep.expand(2, 3, 1, 9), 2, 9) is None  # per head
    assert _key_ranges.key_ranges(keep, 2, 10) is None  # other keys
    additive = key_mask([(0, 5), (2, 9)], 9, "-inf")
    additive[0, 0, 0, 0] = -1.0  # a bias, not a mask
    assert _key_ranges.key_ranges(additive, 2, 9) is None
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    assert _key_ranges.key_ranges(causal, 2, 9) is None


def test_examined_once_per_mask_until_modified(monkeypatch: pytest.MonkeyPatch) -> None:
    examined: list[int] = []
    real = _key_ranges._examine
    monkeypatch.setattr(_key_ranges, "_examine",
                        lambda *a: examined.append(1) or real(*a))
    mask = key_mask([(0, 5)], 9)
    assert _key_ranges.key_ranges(mask, 1, 9) == ((0, 5),)
    assert _key_ranges.key_ranges(mask, 1, 9) == ((0, 5),) and len(examined) == 1
    mask[..., 5] = True  # in place: a new version
    assert _key_ranges.key_ranges(mask, 1, 9) == ((0, 6),) and len(examined) == 2
    assert _key_ranges.key_ranges(mask.clone(), 1, 9) == ((0, 6),) and len(examined) == 3


def test_an_inference_mask_is_examined_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.inference_mode a tensor has no version counter, so an in-place change
    could not be seen: such masks are examined each time (the model suite runs this way)."""
    examined: list[int] = []
    real = _key_ranges._examine
    monkeypatch.setattr(_key_ranges, "_examine",
                        lambda *a: examined.append(1) or real(*a))
    with torch.inference_mode():
        mask = key_mask([(0, 5)], 9)
        assert _key_ranges.key_ranges(mask, 1, 9) == ((0, 5),)
        mask[..., 5] = True
        assert _key_ranges.key_ranges(mask, 1, 9) == ((0, 6),) and len(examined) == 2
        q = torch.randn(1, 2, 4, 8)
        k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
        out = sageattn(q, k, v, attn_mask=mask)  # the call path too (it crashed on _version)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_not_examined_during_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    mask = key_mask([(0, 5)], 9)
    assert _key_ranges.key_ranges(mask, 1, 9) == ((0, 5),)  # before the "capture"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert _key_ranges.key_ranges(mask, 1, 9) == ((0, 5),)  # remembered
    other = mask.clone()
    assert _key_ranges.key_ranges(other, 1, 9) is None  # not read now ...
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert _key_ranges.key_ranges(other, 1, 9) == ((0, 5),)  # ... nor remembered as None


def test_runs() -> None:
    assert _key_ranges.runs(((0, 4), (0, 4), (1, 5), (0, 4))) == [
        (0, 2, 0, 4), (2, 3, 1, 5), (3, 4, 0, 4)]


@pytest.fixture
def kernel_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Each kernel call's K shape (the calls are exact attention on their views: helpers)."""
    return stand_in_kernel(monkeypatch, lambda call, q, k: tuple(k.shape))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("ranges", [[(0, 37), (0, 37)], [(0, 20), (5, 40), (5, 40)], [(3, 40)]],
                         ids=["one range", "three items, two runs", "one item"])
def test_masked_call_runs_on_each_items_key_range(kernel_stand_in: list[tuple[int, ...]], layout: str,
                                        ranges: list[tuple[int, int]]) -> None:
    b = len(ranges)
    q, k, v = qkv(b=b, hq=4, hkv=2, nq=23, nk=40, d=64, dtype=torch.float32, layout=layout)
    q, k, v = (t.to(torch.float16) for t in (q, k, v))
    mask = key_mask(ranges, 40)
    nhd = layout == "NHD"
    hnd = (lambda t: t.transpose(1, 2)) if nhd else (lambda t: t)
    want = hnd(ORIGINAL_SDPA(hnd(q).float(), hnd(k).float(), hnd(v).float(), attn_mask=mask,
                             enable_gqa=True))
    assert explain(q, k, v, mask, enable_gqa=True, tensor_layout=layout).quantized
    for _ in range(2):  # decided, then through the call cache
        kernel_stand_in.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = sageattn(q, k, v, mask, enable_gqa=True, tensor_layout=layout, return_lse=True)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=0)
        assert out.shape == q.shape and out.is_contiguous()
        assert kernel_stand_in == [(b, 2, 40, 64)]  # the Hopper kernel takes the ranges: one launch
        scores = torch.einsum("bhnd,bhmd->bhnm", hnd(q).double(), hnd(k).double().repeat_interleave(2, 1)) / 8
        scores = scores.masked_fill(~mask, -math.inf)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float(), atol=1e-3, rtol=0)


def test_a_new_mask_of_the_same_shape_is_examined(kernel_stand_in: list[tuple[int, ...]]) -> None:
    """The call cache remembers a kind of call, not its mask: each call's mask decides."""
    q, k, v = qkv(b=2, hq=2, nq=8, nk=16, d=64, dtype=torch.float16)
    first, second = key_mask([(0, 10), (0, 16)], 16), key_mask([(2, 16), (0, 7)], 16)
    holes = first.clone()
    holes[0, 0, 0, 3] = False
    for mask in (first, second, holes):
        kernel_stand_in.clear()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = sageattn(q, k, v, mask)
        want = ORIGINAL_SDPA(q.float(), k.float(), v.float(), attn_mask=mask)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=0)
        if mask is holes:  # not a key-padding mask: exact SDPA, the mask rule's warning
            assert kernel_stand_in == [] and torch.equal(out, ORIGINAL_SDPA(q, k, v, attn_mask=mask))
            assert any("key-padding mask" in m for m in fallback_warnings(record))
        else:  # one launch (the Hopper kernel takes the items' ranges)
            assert len(kernel_stand_in) == 1 and not fallback_warnings(record)
    with pytest.raises(NotImplementedError, match="key-padding mask"):
        sageattn(q, k, v, holes, strict=True)


def test_per_query_masks(kernel_stand_in: list[tuple[int, ...]]) -> None:
    """A [B, 1, N_q, N_kv] mask whose rows are equal (transformers' padded encoders) runs the
    kernel on each item's keys; one whose rows differ falls back."""
    q, k, v = qkv(b=2, hq=2, nq=8, nk=16, d=64, dtype=torch.float16)
    mask = key_mask([(0, 10), (0, 16)], 16).expand(2, 1, 8, 16).contiguous()
    assert explain(q, k, v, mask).quantized
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sageattn(q, k, v, mask)
    torch.testing.assert_close(out.float(), ORIGINAL_SDPA(q.float(), k.float(), v.float(), attn_mask=mask),
                               atol=2e-3, rtol=0)
    assert kernel_stand_in == [(2, 2, 16, 64)]  # one launch on the items' ranges
    mask[0, 0, 3, 12] = True
    reason = explain(q, k, v, mask).reason
    assert reason is not None and "key-padding mask" in reason


def test_masks_are_not_examined_where_exact_wins_at_full_length(
        kernel_stand_in: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    """qk_quant="auto" where the crossover sends the unmasked call to exact SDPA: the calls of
    that kind run exact SDPA with their masks, none examined after the first (no
    synchronisation per call), no warning; qk_quant="int8" still examines each."""
    from sageattention2 import _crossover

    monkeypatch.setattr(_crossover, "exact_is_faster",
                        lambda call, choice, capability: "slower" if call.qk_quant_auto else None)
    examined: list[int] = []
    real = _key_ranges._examine
    monkeypatch.setattr(_key_ranges, "_examine", lambda *a: examined.append(1) or real(*a))
    q, k, v = qkv(b=2, hq=2, nq=8, nk=16, d=64, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            mask = key_mask([(0, 10), (0, 16)], 16)  # a new mask tensor per call, as under inference_mode
            out = sageattn(q, k, v, mask)
            assert torch.equal(out, ORIGINAL_SDPA(q, k, v, attn_mask=mask))
    assert len(examined) == 1 and kernel_stand_in == []  # the first call's decision only
    examined.clear()
    for _ in range(2):
        sageattn(q, k, v, key_mask([(0, 10), (0, 16)], 16), qk_quant="int8")
    assert len(examined) == 2 and len(kernel_stand_in) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("d,pv_quant,dtype", [(64, "auto", torch.bfloat16), (128, "auto", torch.float16),
                                              (256, "auto", torch.bfloat16), (64, "none", torch.float16),
                                              (128, "none", torch.bfloat16)])
@pytest.mark.parametrize("per_query", [False, True], ids=["[B,1,1,Nk]", "[B,1,Nq,Nk]"])
def test_key_padding_mask_on_the_gpu(attention_kernel: None, monkeypatch: pytest.MonkeyPatch, layout: str,
                                     d: int, pv_quant: str, dtype: torch.dtype, per_query: bool) -> None:
    """On the GPU a key-padding mask (also as equal rows per query) runs the kernel: on the
    Hopper kernel in one launch over every item's range (on poisoned memory), each item's output
    bit for bit the unmasked call on its range of keys, and within the 8-bit bound of float64
    masked attention; the padding's values (here huge) never reach an output."""
    from sageattention2 import ops
    from sageattention2.testing import poison_cuda_allocator, relative_l1

    g = torch.Generator(device="cuda").manual_seed(d)
    ranges = [(0, 1000), (0, 1000), (37, 1537), (0, 1537), (1400, 1401)]
    b = len(ranges)
    shape = (b, 300, 8, d) if layout == "NHD" else (b, 8, 300, d)
    kv_shape = (b, 1537, 2, d) if layout == "NHD" else (b, 2, 1537, d)
    q = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    mask = key_mask(ranges, 1537).cuda()
    n_axis = 1 if layout == "NHD" else 2
    for t in (k, v):  # the padding: huge values that would dominate any mean or scale they joined
        for i, (s, e) in enumerate(ranges):
            t[i].narrow(n_axis - 1, 0, s).fill_(3e4)
            t[i].narrow(n_axis - 1, e, 1537 - e).fill_(-3e4)
    if per_query:
        mask = mask.expand(b, 1, 300, 1537).contiguous()
    kw = dict(enable_gqa=True, tensor_layout=layout, qk_quant="int8", pv_quant=pv_quant)
    decision = explain(q, k, v, mask, **kw)
    if not decision.quantized:
        pytest.skip(f"not on this GPU: {decision.reason}")
    launches: list[int] = []
    real = ops.sageattn_wgmma
    monkeypatch.setattr(ops, "sageattn_wgmma", lambda *a, **kwa: launches.append(1) or real(*a, **kwa))
    poison_cuda_allocator()
    out = sageattn(q, k, v, mask, **kw)
    if decision.kernel == "attention_wgmma":
        assert len(launches) == 1
    for i, (s, e) in enumerate(ranges):
        alone = sageattn(q[i:i + 1], k[i:i + 1].narrow(n_axis, s, e - s),
                         v[i:i + 1].narrow(n_axis, s, e - s), **kw)
        assert torch.equal(out[i:i + 1], alone), i
    hnd = (lambda t: t.transpose(1, 2)) if layout == "NHD" else (lambda t: t)
    want = ref.exact_attention(hnd(q), hnd(k), hnd(v), attn_mask=mask, enable_gqa=True)
    assert torch.isfinite(out).all() and relative_l1(hnd(out), want) < (0.05 if pv_quant == "auto" else 0.02)


def test_hunyuan_video_masks_run_the_kernel(kernel_stand_in: list[tuple[int, ...]]) -> None:
    """HunyuanVideo (tiny, real class) passes a [B, 1, 1, N] key mask to its joint attention:
    those calls run the (stand-in) kernel on the unpadded keys, and the output is SDPA's."""
    pytest.importorskip("diffusers")
    from sageattention2 import _model_suite
    from sageattention2.integrations import patch_sdpa

    torch.manual_seed(0)
    model, inputs = _model_suite.hunyuan_video(torch.device("cpu"), torch.bfloat16, tiny=True)
    inputs["encoder_attention_mask"][:, 5:] = 0  # text padding
    with torch.no_grad():
        want = model(**inputs)[0]
        with warnings.catch_warnings(), patch_sdpa():
            warnings.simplefilter("ignore")
            got = model(**inputs)[0]
    assert len(kernel_stand_in) >= 2  # the joint calls
    assert torch.nn.functional.cosine_similarity(got.flatten().float(), want.flatten().float(), 0) > 0.999


def test_an_inference_mask_seen_before_is_read_on_the_gpu(kernel_stand_in: list[tuple[int, ...]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.inference_mode a mask tensor has no version counter: the first call examines
    it (one synchronisation), the next calls with the same tensor hand it to the Hopper kernel's
    launch, which reads the key ranges again on the GPU (none); a mask changed in place since
    into one that is not a key-padding mask gives NaN rows to the items it breaks, never
    another mask's attention."""
    examined: list[int] = []
    real = _key_ranges._examine
    monkeypatch.setattr(_key_ranges, "_examine", lambda *a: examined.append(1) or real(*a))
    q, k, v = qkv(b=2, hq=2, nq=8, nk=16, d=64, dtype=torch.float16)
    with torch.inference_mode():
        mask = key_mask([(0, 10), (3, 16)], 16).expand(2, 1, 8, 16).contiguous()
        for call in range(3):
            out = sageattn(q, k, v, mask)
            want = ORIGINAL_SDPA(q.float(), k.float(), v.float(), attn_mask=mask)
            torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=0)
        assert len(examined) == 2  # the first call's route and decision
        assert kernel_stand_in == [(2, 2, 16, 64)] + [("key_mask", 2, 2, 16, 64)] * 2
        mask[1, 0, :, 12:14] = False  # now a hole in item 1's keys
        out = sageattn(q, k, v, mask)
    assert len(examined) == 2
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    torch.testing.assert_close(out[0].float(), want[0], atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("aligned_rows", [False, True])
@pytest.mark.parametrize("dtype,mask_dtype,one_row", [
    (torch.float16, torch.bool, False), (torch.bfloat16, torch.float32, False),
    (torch.float16, torch.float16, True), (torch.bfloat16, torch.bfloat16, False)])
def test_key_ranges_read_from_the_mask_on_the_gpu(wgmma_kernel: None, dtype: torch.dtype,
                                                  mask_dtype: torch.dtype, one_row: bool,
                                                  aligned_rows: bool) -> None:
    """sageattn_wgmma with key_mask reads each item's key range from the mask on the GPU: the
    same output and LSE, bit for bit, as with the ranges given (on poisoned memory); an item
    whose mask is not a key-padding mask (a row that differs, a hole) gets NaN rows and LSE,
    the others are unchanged. aligned_rows: the mask a view of 1537 keys of rows 1552 wide
    (16-byte aligned: the reader's vector loads, and one key past the last whole vector), else
    rows of 1537 (its loads one by one)."""
    from sageattention2 import _execute, ops
    from sageattention2.testing import poison_cuda_allocator

    g = torch.Generator(device="cuda").manual_seed(7)
    ranges = [(0, 1000), (37, 1537), (0, 1537), (1400, 1401)]
    b, n_q, n_k = len(ranges), 1 if one_row else 300, 1537
    q = torch.randn(b, 8, 300, 128, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, 2, n_k, 128, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    width = 1552 if aligned_rows else n_k
    keep = key_mask(ranges, width).cuda().expand(b, 1, n_q, width).contiguous()
    if mask_dtype == torch.bool:
        full = keep
    else:
        low = -math.inf if mask_dtype == torch.float32 else torch.finfo(mask_dtype).min
        full = torch.zeros(keep.shape, device="cuda", dtype=mask_dtype).masked_fill(~keep, low)
    mask = full[..., :n_k]
    stride = _execute.smoothing_sample_stride
    given = torch.tensor([(s, e, stride(e - s)) for s, e in ranges], dtype=torch.int32, device="cuda")
    args = (q, k, v, "fp8", True, False, 1, 128 ** -0.5, False, False, True)
    poison_cuda_allocator()
    want, want_lse = ops.sageattn_wgmma(*args, key_ranges=given)
    poison_cuda_allocator()
    got, got_lse = ops.sageattn_wgmma(*args, key_mask=mask, sample_tokens=_execute.SMOOTHING_SAMPLE_TOKENS)
    assert torch.isfinite(want).all() and torch.equal(got, want) and torch.equal(got_lse, want_lse)
    broken = full.clone()
    # a hole in item 1's range; or one query row of item 1 and one of item 2 that differ from
    # their first (key 40: in a whole vector of aligned rows; key 1536: past the last one)
    changes = [(1, 0, 500)] if one_row else [(1, 5, 40), (2, 7, 1536)]
    for item, row, key in changes:
        broken[item, 0, row, key] = ~broken[item, 0, row, key] if mask_dtype == torch.bool else low
    broken = broken[..., :n_k]
    bad = sorted({item for item, _, _ in changes})
    got, got_lse = ops.sageattn_wgmma(*args, key_mask=broken, sample_tokens=_execute.SMOOTHING_SAMPLE_TOKENS)
    assert torch.isnan(got[bad]).all() and torch.isnan(got_lse[bad]).all()
    others = [i for i in range(b) if i not in bad]
    assert torch.equal(got[others], want[others]) and torch.equal(got_lse[others], want_lse[others])
    # A [B, 1, 1, N] mask expanded over the queries (stride 0): its rows are not compared.
    got, got_lse = ops.sageattn_wgmma(*args, key_mask=mask[:, :, :1].expand(mask.shape),
                                      sample_tokens=_execute.SMOOTHING_SAMPLE_TOKENS)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


def test_sageattn_wgmma_checks_its_key_range_arguments() -> None:
    """The op names the argument and what it allows (its Meta implementation validates as the
    CUDA one does)."""
    from sageattention2 import ops

    if not ops.has_op("sageattn_wgmma"):
        pytest.skip("no extension")
    op = torch.ops.sageattention2.sageattn_wgmma
    q, k, v = meta(2, 4, 8, 64), meta(2, 2, 16, 64), meta(2, 2, 16, 64)
    args = [q, k, v, "fp8", True, False, 1, 0.125, False, False, False]
    ranges, mask = meta(2, 3, dtype=torch.int32), meta(2, 1, 8, 16, dtype=torch.bool)
    out, _ = op(*args, key_ranges=ranges)
    assert out.shape == q.shape
    out, _ = op(*args, key_mask=mask, sample_tokens=256)
    assert out.shape == q.shape
    bad = [
        (dict(key_ranges=meta(2, 2, dtype=torch.int32)), r"key_ranges must be an int32 \[batch, 3\]"),
        (dict(key_ranges=meta(2, 3, dtype=torch.int64)), r"key_ranges must be an int32"),
        (dict(key_mask=meta(2, 1, 3, 16, dtype=torch.bool), sample_tokens=256), r"key_mask must be \[1 or batch"),
        (dict(key_mask=meta(2, 1, 8, 16, dtype=torch.int64), sample_tokens=256), "key_mask must be bool, float16"),
        (dict(key_mask=mask, key_ranges=ranges, sample_tokens=256), "cannot both be given"),
        (dict(key_mask=mask), "sample_tokens must be >= 1"),
    ]
    for kwargs, message in bad:
        with pytest.raises(RuntimeError, match=message):
            op(*args, **kwargs)
    with pytest.raises(RuntimeError, match="sample_stride must be 1"):
        op(*args[:6], 3, *args[7:], key_ranges=ranges)
    with pytest.raises(RuntimeError, match="cannot be combined with is_causal"):
        op(*args[:8], True, *args[9:], key_ranges=ranges)
