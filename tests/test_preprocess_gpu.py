"""GPU tests of the preprocessing kernels against the bit-level reference
(docs/DESIGN.md#smoothing_stats and #quantize_kv).

Exactness contract:
- Means and Delta-S are float32 sums in another order than the float64 reference: compared with
  a tolerance.
- Everything downstream of a mean (codes, scales, V's FP8 bytes) is compared bit for bit, with
  the kernel's own means fed to the reference quantizers, so both quantize the same numbers.
- Block-mode Q smoothing computes its mean inside the kernel, so there the codes may differ by
  one step where the float32 and float64 means straddle a rounding tie: at most 1e-4 of them.

Every op allocates its outputs itself, so each call is preceded by freeing blocks of 0xFF bytes
to both pools of the caching allocator (``testing.poison_cuda_allocator``: the large pool, and
the small one, <= 1 MB, where the scales, means and Delta-S of small shapes land): the outputs
then land on poisoned memory (NaN in float32), and an element the kernel forgot to write fails
the bit-exact comparison.
"""
from __future__ import annotations

import pytest
import torch

from sageattention2 import reference as ref
from sageattention2.testing import poison_cuda_allocator

pytestmark = pytest.mark.gpu

ops = pytest.importorskip("sageattention2.ops")
if not getattr(ops, "HAS_EXTENSION", False):
    pytest.skip("compiled extension not available", allow_module_level=True)

LOG2E = 1.4426950408889634


def make_qkv(batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int,
             dtype: torch.dtype, layout: str, seed: int):
    """Q/K/V like real activations: channel-wise offsets, a few outlier channels, and the
    requested memory layout ("hnd" contiguous, "nhd" permuted view, "strided" every other head
    of a larger tensor, "packed" slices of one [B, N, 3, H, D] tensor)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(heads: int, tokens: int, bias: float) -> torch.Tensor:
        x = torch.randn(batch, heads, tokens, head_dim, device="cuda", generator=g)
        x += bias * torch.randn(batch, heads, 1, head_dim, device="cuda", generator=g)
        x[..., : max(1, head_dim // 32)] *= 8.0
        return x

    q, k, v = draw(q_heads, q_len, 2.0), draw(kv_heads, kv_len, 4.0), draw(kv_heads, kv_len, 1.0)
    if layout == "hnd":
        return [t.to(dtype) for t in (q, k, v)]
    if layout == "nhd":
        return [t.transpose(1, 2).contiguous().to(dtype).transpose(1, 2) for t in (q, k, v)]
    if layout == "strided":
        out = []
        for t in (q, k, v):
            big = torch.empty(t.shape[0], 2 * t.shape[1], *t.shape[2:], device="cuda", dtype=dtype)
            big[:, ::2] = t.to(dtype)
            out.append(big[:, ::2])
        return out
    if layout == "packed":
        assert q_heads == kv_heads and q_len == kv_len
        packed = torch.stack([t.transpose(1, 2) for t in (q, k, v)], dim=2).to(dtype)  # [B,N,3,H,D]
        return [packed[:, :, i].transpose(1, 2) for i in range(3)]
    raise ValueError(layout)


def cpu(t):
    return None if t is None else t.detach().cpu()


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = actual.contiguous().view(torch.uint8)
    e = expected.contiguous().view(torch.uint8)
    bad = (a != e).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


SHAPES = [
    # batch, q_heads, kv_heads, q_len, kv_len, head_dim
    (1, 2, 2, 1, 1, 128),
    (2, 4, 4, 127, 127, 64),
    (1, 8, 2, 4097, 4097, 128),  # GQA 4:1, a tail of one token
    (2, 4, 1, 1000, 333, 96),     # MQA, q_len != kv_len, head_dim 96
    (1, 2, 2, 64, 200, 32),
    (1, 2, 2, 130, 130, 256),
]
LAYOUTS = ["hnd", "nhd", "strided"]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_smoothing_stats(shape, layout, dtype):
    q, k, v = make_qkv(*shape, dtype=dtype, layout=layout, seed=hash((shape, layout)) % 1000)
    for smooth_v in (False, True):
        poison_cuda_allocator()
        q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, smooth_v)
        rq, rk, rv, _ = ref.smoothing_stats_reference(cpu(q), cpu(k), cpu(v), smooth_v)
        for name, got, want in (("q_mean", q_mean, rq), ("k_mean", k_mean, rk)):
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=name)
        if smooth_v:
            torch.testing.assert_close(v_mean.cpu(), rv, rtol=1e-5, atol=1e-5)
            shift = v_mean.cpu()
        else:
            assert v_mean.numel() == 0
            shift = torch.zeros_like(v_scale.cpu())
        # The range is exact given the mean the kernel used.
        want_scale = (cpu(v).float() - shift[:, :, None, :]).abs().amax(dim=2) / 448.0
        assert_bits_equal(v_scale, want_scale, "v_scale")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("qk_dtype", ["int8", "int4"])
@pytest.mark.parametrize("block_k", [64, 128])
def test_quantize_kv_bit_exact(shape, layout, dtype, qk_dtype, block_k):
    q, k, v = make_qkv(*shape, dtype=dtype, layout=layout, seed=3)
    multiplier = shape[-1] ** -0.5 * LOG2E
    # V per channel (smoothing_stats' scales) and per tile (no v_scale: quantize_kv's own).
    for smooth_k, smooth_v, with_delta_s, per_tile in ((True, False, True, False), (False, True, False, False),
                                                       (True, True, True, False), (True, False, False, True),
                                                       (False, True, True, True)):
        q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, smooth_v)
        k_mean_arg = k_mean if smooth_k else None
        v_mean_arg = v_mean if smooth_v else None
        q_mean_arg = q_mean if with_delta_s else None
        v_scale_arg = None if per_tile else v_scale
        poison_cuda_allocator()
        out = ops.quantize_kv(k, v, k_mean_arg, v_mean_arg, v_scale_arg, q_mean_arg, block_k, qk_dtype, multiplier)
        want = ref.quantize_kv_reference(cpu(k), cpu(v), cpu(k_mean_arg), cpu(v_mean_arg), cpu(v_scale_arg),
                                         cpu(q_mean_arg), block_k, qk_dtype, multiplier)
        tag = f"smooth_k={smooth_k} smooth_v={smooth_v} per_tile={per_tile}"
        assert_bits_equal(out[0], want[0], f"k codes ({tag})")
        assert_bits_equal(out[1], want[1], f"k scales ({tag})")
        assert_bits_equal(out[2], want[2], f"v fp8 ({tag})")
        if per_tile:
            assert out[4].shape == (shape[0], shape[2], out[0].shape[2] // block_k)
            assert_bits_equal(out[4], want[4], f"v tile scales ({tag})")
        else:
            assert out[4].numel() == 0
        # K alone (the warp-level INT8 + FP16 PV path): the same codes and scales, written by
        # K's CTAs with no V tile staged (no shared-memory tile at all for K from registers).
        poison_cuda_allocator()
        k_only = ops.quantize_kv(k, None, k_mean_arg, None, None, q_mean_arg, block_k, qk_dtype, multiplier)
        assert_bits_equal(k_only[0], want[0], f"k codes, K only ({tag})")
        assert_bits_equal(k_only[1], want[1], f"k scales, K only ({tag})")
        assert k_only[2] is None or k_only[2].numel() == 0
        if with_delta_s:
            # float32 dot products of length D against the float64 reference.
            bound = 1e-5 * (q_mean.abs().amax().item() * (k.float() - k_mean[:, :, None]).abs().amax().item()
                            * shape[-1] * multiplier) + 1e-6
            torch.testing.assert_close(out[3].cpu(), want[3], rtol=1e-5, atol=bound)
        else:
            assert out[3].numel() == 0


def test_repeated_runs_identical():
    q, k, v = make_qkv(2, 8, 2, 3001, 3001, 128, dtype=torch.bfloat16, layout="nhd", seed=5)

    def run():
        q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, True)
        kvo = ops.quantize_kv(k, v, k_mean, v_mean, v_scale, q_mean, 64, "int4", 0.1)
        return [q_mean, k_mean, v_mean, v_scale, *kvo]

    first = run()
    for _ in range(3):
        for a, b in zip(first, run()):
            assert_bits_equal(a, b, "repeat")


def test_packed_qkv_layout():
    q, k, v = make_qkv(2, 4, 4, 300, 300, 128, dtype=torch.float16, layout="packed", seed=9)
    assert not q.is_contiguous()
    q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, True)
    out = ops.quantize_kv(k, v, k_mean, v_mean, v_scale, None, 64, "int8", 1.0)
    want = ref.quantize_kv_reference(cpu(k), cpu(v), cpu(k_mean), cpu(v_mean), cpu(v_scale), None, 64, "int8", 1.0)
    for i in range(3):
        assert_bits_equal(out[i], want[i], f"output {i}")
    tiled = ops.quantize_kv(k, v, k_mean, v_mean, None, None, 128, "int8", 1.0)
    want = ref.quantize_kv_reference(cpu(k), cpu(v), cpu(k_mean), cpu(v_mean), None, None, 128, "int8", 1.0)
    for i in (2, 4):
        assert_bits_equal(tiled[i], want[i], f"per-tile output {i}")


def test_launch_errors_are_clear():
    k = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.float16)
    flat = torch.empty(k.numel() + 4, device="cuda", dtype=torch.float16)
    misaligned = flat[4:].view(k.shape)  # starts 8 bytes into a 16-byte vector

    def quantize_kv(k: torch.Tensor, qk_dtype: str = "int8") -> None:
        ops.quantize_kv(k, None, None, None, None, None, 128, qk_dtype, 1.0)

    with pytest.raises(RuntimeError, match="16-byte aligned"):
        quantize_kv(misaligned)
    with pytest.raises(RuntimeError, match="head_dim"):
        quantize_kv(torch.randn(1, 2, 64, 100, device="cuda", dtype=torch.float16))
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        quantize_kv(k.float())
    with pytest.raises(RuntimeError, match="qk_dtype"):
        quantize_kv(k, "int2")


@pytest.mark.parametrize("op_name", ["smoothing_stats", "quantize_kv"])
def test_opcheck_cuda(op_name):
    q, k, v = make_qkv(1, 4, 2, 200, 130, 64, dtype=torch.float16, layout="hnd", seed=1)
    q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, True)
    args = {
        "smoothing_stats": (q, k, v, True),
        "quantize_kv": (k, v, k_mean, v_mean, v_scale, q_mean, 64, "int8", 0.125),
    }[op_name]
    torch.library.opcheck(getattr(torch.ops.sageattention2, op_name).default, args)


def test_dequantized_matches_input():
    """End-to-end sanity independent of the reference: codes * scale + mean reconstruct the
    input within half a quantization step."""
    q, k, v = make_qkv(1, 2, 2, 257, 257, 128, dtype=torch.float16, layout="hnd", seed=2)
    _, k_mean, v_mean, v_scale = ops.smoothing_stats(None, k, v, True)
    k_codes, k_scales, v_fp8, _, _ = ops.quantize_kv(k, v, k_mean, v_mean, v_scale, None, 64, "int8", 1.0)
    groups = torch.arange(k_codes.shape[2], device="cuda") % 8 // 2
    blocks = torch.arange(k_codes.shape[2], device="cuda") // 64
    scale = k_scales[:, :, blocks, groups][..., :257, None]
    k_hat = k_codes[:, :, :257].float() * scale + k_mean[:, :, None]
    assert ((k_hat - k.float()).abs() <= scale / 2 + 1e-5).all()
    # V: undo the key permutation of the PV MMA layout (docs/DESIGN.md#v-layout) and dequantize.
    slot = torch.arange(v_fp8.shape[-1], device="cuda")
    base, within = slot & ~15, slot & 15
    key = base + 2 * (within // 4) + (within % 4 & 1) + 8 * (within % 4 >> 1)
    v_hat = torch.empty_like(v_fp8, dtype=torch.float32)
    v_hat[..., key] = v_fp8.float()
    v_hat = v_hat[..., :257].transpose(2, 3) * v_scale[:, :, None] + v_mean[:, :, None]
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4, absolute <= 2^-10 near zero.
    bound = torch.maximum((v.float() - v_mean[:, :, None]).abs() * 2**-4, 2**-10 * v_scale[:, :, None])
    assert ((v_hat - v.float()).abs() <= bound * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_v_tile_codes_bit_exact_at_the_range_edges(dtype):
    """fp16 V without a mean under one scale per tile is quantized in packed fp16 arithmetic
    (quantize_v_tile), which must give the float path's codes bit for bit wherever it is taken,
    and fall back where 1 / s is no normal fp16: tiles whose scale is above 1 (products of the
    tile's tiny and signed-zero values in fp16's subnormal range), 1 / s = 2^14, 2^15 (the last
    packed one) and 2^16 (float), an all-zero tile, and a short last tile. bf16 takes the float
    path throughout: the same tiles, the same contract."""
    g = torch.Generator(device="cuda").manual_seed(23)
    _, k, _ = make_qkv(1, 2, 2, 680, 680, 128, dtype=dtype, layout="hnd", seed=6)
    v = torch.randn(1, 2, 680, 128, device="cuda", generator=g)
    tiles = list(v.split(128, dim=2))
    tiles[1].mul_(3000.0)  # amax ~1.4e4: scale 2^5, so v / s may land below fp16's normal range
    tiles[1][..., 0, :8] = torch.tensor([1e-5, -1e-5, 6e-8, -6e-8, 0.0, -0.0, 3e-4, -3e-4], device="cuda")
    for tile, amax in ((tiles[2], 0.02), (tiles[3], 0.0125), (tiles[4], 0.005)):  # 1 / s = 2^14, 2^15, 2^16
        tile.mul_(amax / tile.abs().amax(dim=(2, 3), keepdim=True))
    tiles[0][:, 1] = 0.0
    v = v.to(dtype)
    k_mean = ops.smoothing_stats(None, k, None, False).k_mean
    poison_cuda_allocator()
    out = ops.quantize_kv(k, v, k_mean, None, None, None, 128, "int8", 1.0)
    want = ref.quantize_kv_reference(cpu(k), cpu(v), cpu(k_mean), None, None, None, 128, "int8", 1.0)
    if dtype == torch.float16:
        inv = 1.0 / want[4][0, 0, :5]
        assert inv[1] < 1.0 and inv[2] == 2.0**14 and inv[3] == 2.0**15 and inv[4] == 2.0**16
    assert_bits_equal(out[4], want[4], "v tile scales")
    assert_bits_equal(out[2], want[2], "v fp8")


def test_v_tile_scales_dequantize():
    """quantize_kv without v_scale: one FP8 scale per 128-key tile (the Hopper kernel's V). The
    dequantized V is within E4M3's rounding of the input, tile by tile, including an all-zero
    tile (the floor scale, codes 0), a tile 10^4 times smaller than its neighbours, and the
    short last tile, whose padding keys must be zero codes."""
    _, k, v = make_qkv(1, 2, 2, 300, 300, 128, dtype=torch.float16, layout="hnd", seed=4)
    v = v.clone()
    v[:, :, 128:256] = 0
    v[:, 1, 128:256] = torch.randn(128, 128, device="cuda", dtype=torch.float16) * 1e-4
    k_mean = ops.smoothing_stats(None, k, None, False).k_mean
    poison_cuda_allocator()
    out = ops.quantize_kv(k, v, k_mean, None, None, None, 128, "int8", 1.0)
    v_fp8, tile_scale = out[2], out[4]
    assert tile_scale.shape == (1, 2, 3)
    assert tile_scale[0, 0, 1].item() == ref.V_TILE_SCALE_MIN  # the all-zero tile
    # max |V| / 448, floored, rounded up to a power of two (both checked by bound, not by bits).
    want = (v.float()[:, :, :256].unflatten(2, (2, 128)).abs().amax(dim=(3, 4)) / 448).clamp(min=ref.V_TILE_SCALE_MIN)
    got = tile_scale[:, :, :2]
    assert (got >= want).all() and (got < 2 * want).all()
    assert torch.equal(torch.exp2(torch.log2(tile_scale).round()), tile_scale)
    slot = torch.arange(v_fp8.shape[-1], device="cuda")
    base, within = slot & ~15, slot & 15
    key = base + 2 * (within // 4) + (within % 4 & 1) + 8 * (within % 4 >> 1)
    codes = torch.empty_like(v_fp8, dtype=torch.float32)
    codes[..., key] = v_fp8.float()
    assert (codes[..., 300:] == 0).all()  # padding keys of the last tile
    scale = tile_scale.repeat_interleave(128, dim=2)[:, :, :300, None]
    v_hat = codes[..., :300].transpose(2, 3) * scale
    bound = torch.maximum(v.float().abs() * 2**-4, 2**-10 * scale)
    assert ((v_hat - v.float()).abs() <= bound * (1 + 1e-5) + 1e-12).all()
