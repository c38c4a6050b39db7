"""One rank of the context-parallel tests (tests/test_parallel.py starts WORLD of them).

``python3 parallel_worker.py RANK WORLD PORT BACKEND SCENARIO...``: joins the process group
(gloo on the CPU, nccl on the GPUs, one GPU per rank), runs each scenario and exits 0 when all
held; a failure prints ``FAILED <scenario>`` and its traceback and exits 1. Every rank draws the
whole q, k and v from the same seed, takes its shard and compares what
``context_parallel_attention`` returns for it with ``sageattn`` on the whole tensors in this
process.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

SCENARIOS: dict[str, Callable[[], None]] = {}
DEVICE = torch.device("cpu")


def scenario(function: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[function.__name__] = function
    return function


def draw(b: int, n: int, h: int, d: int, seed: int, dtype: torch.dtype = torch.float32,
         offset: float = 0.0) -> torch.Tensor:
    """NHD ``[b, n, h, d]``, the same on every rank; channel offsets like real K."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, h, d, generator=g) + offset * torch.randn(1, 1, h, d, generator=g)
    return x.to(dtype).to(DEVICE)


def shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[1] // world
    return x[:, rank * n:(rank + 1) * n]


def rows_of(tokens: list[int], rank: int) -> slice:
    """Rank ``rank``'s rows of the whole sequence when the ranks hold ``tokens`` tokens each."""
    return slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float) -> None:
    if want.numel() == 0:  # (a rank's empty shard)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        return
    err = float((got.double() - want.double()).abs().max())
    scale = float(want.double().abs().max()) or 1.0
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(got).all() or not torch.isfinite(want).all(), what
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:.1e} x {scale:.3e}"


def whole_and_shard(b: int, n: int, hq: int, hkv: int, d: int, seed: int, rank: int, world: int,
                    **kw: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    q = draw(b, n, hq, d, seed, **kw)
    k = draw(b, n, hkv, d, seed + 1, offset=3.0, **kw)
    v = draw(b, n, hkv, d, seed + 2, **kw)
    return (q, k, v), tuple(shard(t, rank, world) for t in (q, k, v))


def groups() -> dict[str, Any]:
    """The groups of the scenarios: the whole world, and for 4 ranks a 2 x 2 mesh (ulysses rank
    fastest: ranks {0,1} and {2,3} are Ulysses groups, {0,2} and {1,3} rings)."""
    world = dist.get_world_size()
    found: dict[str, Any] = {"world": dist.group.WORLD}
    if world == 4:
        rank = dist.get_rank()
        for members in ([0, 1], [2, 3]):
            g = dist.new_group(members)
            if rank in members:
                found["ulysses"] = g
        for members in ([0, 2], [1, 3]):
            g = dist.new_group(members)
            if rank in members:
                found["ring"] = g
    return found


GROUPS: dict[str, Any] = {}


def run(**kwargs: Any) -> Any:
    from sageattention2.parallel import context_parallel_attention

    return context_parallel_attention(*kwargs.pop("args"), **kwargs)


def whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
    from sageattention2 import sageattn

    return sageattn(q, k, v, tensor_layout="NHD", **kw)


def check_against_whole(mode: str, is_causal: bool, hkv: int = 4, n: int = 10,
                        mask: str | None = None, **options: Any) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    (q, k, v), local = whole_and_shard(2, n, 4, hkv, 16, 11, rank, world)
    kw: dict[str, Any] = dict(is_causal=is_causal, enable_gqa=hkv != 4, return_lse=True, **options)
    full_mask = local_mask = None
    if mask is not None:
        keep = torch.ones(2, n, dtype=torch.bool)
        keep[0, n - 3:] = False        # item 0: its last 3 keys padded
        keep[1, :n // world] = False   # item 1: every key of rank 0 padded (a shard it skips)
        full_mask = keep.to(DEVICE)
        local_mask = shard(keep[:, :, None, None], rank, world)[..., 0, 0].to(DEVICE)
        kw["attn_mask"] = full_mask[:, None, None, :]
    want_out, want_lse = whole(q, k, v, **kw)
    if mask == "local":
        kw["attn_mask"] = local_mask
    group = GROUPS["world"]
    got_out, got_lse = run(args=local, ring_group=group if mode == "ring" else None,
                           ulysses_group=group if mode == "ulysses" else None, **kw)
    n_local = n // world
    rows = slice(rank * n_local, (rank + 1) * n_local)
    close(got_out, want_out[:, rows], f"{mode} out", 1e-5)
    close(got_lse, want_lse[:, :, rows], f"{mode} lse", 1e-5)


@scenario
def ring_matches_one_process() -> None:
    check_against_whole("ring", False)


@scenario
def ring_causal_matches_one_process() -> None:
    check_against_whole("ring", True)


@scenario
def ulysses_matches_one_process() -> None:
    check_against_whole("ulysses", False, hkv=2)  # GQA: 2 key heads over 2 ranks


@scenario
def ulysses_causal_matches_one_process() -> None:
    check_against_whole("ulysses", True)


@scenario
def compiled_calls_run_eagerly() -> None:
    """Under torch.compile each call is one opaque eager step: Dynamo compiles only the code
    around it (two graphs over three calls: no recompiles on the peers' memory's signal counts,
    no pieces of the agreement) and the outputs are the eager call's bit for bit (traced into,
    the ring's merge was fused and moved by ~1e-7 on the CPU)."""
    import torch._dynamo

    from sageattention2.parallel import context_parallel_attention

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    _, local = whole_and_shard(1, 256 * world, 4, 4, 64, 31, rank, world, dtype=dtype)
    for mode in ("ring", "ulysses"):
        groups = {f"{mode}_group": GROUPS["world"]}

        def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return context_parallel_attention(q * 2, k, v, **groups) + 1

        eager = step(*local)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(step)
        for _ in range(3):
            got = compiled(*local)
            assert torch.equal(got, eager), f"{mode}: compiled output differs from eager"
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs <= 2, f"{mode}: Dynamo compiled {graphs} graphs (traced into the call)"


@scenario
def ring_key_mask_local_and_global() -> None:
    check_against_whole("ring", False, mask="local")
    check_against_whole("ring", False, mask="global")


@scenario
def ulysses_key_mask_local() -> None:
    check_against_whole("ulysses", False, mask="local")


@scenario
def shards_of_any_length() -> None:
    """Ulysses and the ring over token shards of different lengths (diffusers'
    ``ulysses_anything`` and ``ring_anything``; on 4 ranks one shard empty), Ulysses also over
    heads that do not divide among the ranks (5 heads; GQA 6 over 3; 4 over 1: a rank without
    heads, in batch 1 and 2): each rank's output and LSE are its rows of the one-process call's;
    a key mask there raises on every rank, as does the ring's quantized exchange."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = [7, 4] if world == 2 else [3, 0, 5, 2]
    rows = rows_of(tokens, rank)
    for mode in ("ulysses_group", "ring_group"):
        for b, hq, hkv, causal in ((2, 5, 5, False), (2, 6, 3, True), (1, 4, 1, False),
                                   (2, 4, 1, True)):
            q, k, v = (draw(b, sum(tokens), h, 16, seed, offset=2.0 * (seed == 22))
                       for h, seed in ((hq, 21), (hkv, 22), (hkv, 23)))
            options = dict(is_causal=causal, enable_gqa=hkv != hq, return_lse=True)
            want_out, want_lse = whole(q, k, v, **options)
            local = tuple(t[:, rows] for t in (q, k, v))
            got_out, got_lse = run(args=local, **{mode: GROUPS["world"]}, **options)
            what = f"{mode} hq={hq} hkv={hkv} causal={causal}"
            close(got_out, want_out[:, rows], f"out {what}", 1e-5)
            close(got_lse, want_lse[:, :, rows], f"lse {what}", 1e-5)
        keys = torch.ones(2, tokens[rank], dtype=torch.bool, device=DEVICE)  # (the last case's batch)
        expect_error("attn_mask needs shards of equal length", args=local, **{mode: GROUPS["world"]},
                     attn_mask=keys, enable_gqa=True)
    try:
        run(args=local, ring_group=GROUPS["world"], enable_gqa=True, exchange="quantized")
    except NotImplementedError as error:
        assert "shards of one length" in str(error), str(error)
    else:
        raise AssertionError(f"no error on rank {rank} for the quantized exchange")


@scenario
def ulysses_and_ring() -> None:
    """USP on a 2 x 2 mesh: tokens sharded over all 4 ranks, ulysses rank fastest."""
    rank, world = dist.get_rank(), dist.get_world_size()
    (q, k, v), local = whole_and_shard(1, 12, 4, 4, 8, 5, rank, world)
    want_out, want_lse = whole(q, k, v, return_lse=True)
    got_out, got_lse = run(args=local, ring_group=GROUPS["ring"], ulysses_group=GROUPS["ulysses"],
                           return_lse=True)
    rows = slice(rank * 3, rank * 3 + 3)
    close(got_out, want_out[:, rows], "usp out", 1e-5)
    close(got_lse, want_lse[:, :, rows], "usp lse", 1e-5)


@scenario
def quantized_exchange_plumbing() -> None:
    """The ring's quantized exchange on the CPU, with the quantizer and the kernel stood in for
    (parts of several dtypes and odd sizes, one absent): each shard's parts arrive intact, in
    their owner's order, and merge to the whole attention."""
    from sageattention2 import parallel, reference

    def quantize(kernel: Any, k: torch.Tensor, v: torch.Tensor) -> Any:
        return parallel._QuantizedShard(k.half(), torch.randn(3, 5), v.double(), None,
                                        None, k.float().mean(2))

    def attend(kernel: Any, q: torch.Tensor, part: Any, kv_len: int,
               causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        assert part.k_scale.shape == (3, 5) and part.v_tile_scale is None
        k = part.k_codes.float()
        torch.testing.assert_close(part.k_mean, k.mean(2), rtol=0, atol=1e-6)
        out, lse = reference.exact_attention(q.double(), k.double(), part.v, is_causal=causal,
                                             return_lse=True)
        return out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2), lse.float()

    real = parallel._ring_plan, parallel._quantize_shard, parallel._attend_quantized
    parallel._ring_plan = lambda *a: "stand-in"  # type: ignore[assignment]
    parallel._quantize_shard = quantize  # type: ignore[assignment]
    parallel._attend_quantized = attend  # type: ignore[assignment]
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        (q, k, v), local = whole_and_shard(2, 8, 4, 4, 16, 3, rank, world, dtype=torch.float16)
        for causal in (False, True):
            want_out, want_lse = whole(q.float(), k.half().float(), v.double().float(),
                                       is_causal=causal, return_lse=True)
            got_out, got_lse = run(args=local, ring_group=GROUPS["world"], is_causal=causal,
                                   return_lse=True)
            rows = slice(rank * 4, rank * 4 + 4)
            close(got_out, want_out[:, rows], f"quantized plumbing out (causal={causal})", 2e-3)
            close(got_lse, want_lse[:, :, rows], f"quantized plumbing lse (causal={causal})", 1e-5)
    finally:
        parallel._ring_plan, parallel._quantize_shard, parallel._attend_quantized = real


@scenario
def gpu_quantized_ring() -> None:
    """On the GPUs (bf16, K with channel offsets, an odd shard length): the quantized exchange's
    output and LSE are bit for bit the 16-bit exchange's (each shard's part is sageattn's on that
    shard either way) and, gathered through the peers' memory (poisoned first), NCCL's
    all-gather's; within the 8-bit bound of float64 attention, close to the one-GPU call; its
    bytes at most 0.55x the 16-bit ones. Shards of different lengths: within the same bounds,
    and the peers' memory's bits NCCL's."""
    from sageattention2 import _peer_exchange, parallel, reference
    from sageattention2.testing import relative_l1 as rel_l1

    rank, world = dist.get_rank(), dist.get_world_size()
    n = 3001 * world
    (q, k, v), local = whole_and_shard(1, n, 8, 8, 128, 21, rank, world, dtype=torch.bfloat16)
    rows = slice(rank * 3001, (rank + 1) * 3001)
    group = GROUPS["world"]

    def through_nccl(**kwargs: Any) -> Any:
        os.environ[parallel.PEER_MEMORY_ENVIRONMENT] = "0"
        try:
            return run(ring_group=group, **kwargs)
        finally:
            os.environ.pop(parallel.PEER_MEMORY_ENVIRONMENT)

    def poisoned() -> None:
        memory = parallel._peer_memories.get((parallel._group_name(group), DEVICE.index))
        assert memory, "the ring's peers' memory was not mapped on 2 GPUs of one host"
        memory.buffers[memory.rank].fill_(255)  # (every byte read must be written)

    def gathers() -> int:  # the ring's gathers through this group's peers' memory so far
        memory = parallel._peer_memories[(parallel._group_name(group), DEVICE.index)]
        return memory.counts["signal", _peer_exchange.RING_CHANNEL, (rank + 1) % world]

    for causal in (False, True):
        options = dict(is_causal=causal, return_lse=True, qk_quant="int8")
        run(args=local, ring_group=group, exchange="input", **options)  # (maps the memory, its largest)
        poisoned()
        before = gathers()
        out_q, lse_q = run(args=local, ring_group=group, exchange="quantized", **options)
        assert gathers() == before + 1, "the ring did not gather through the peers' memory"
        out_n, lse_n = through_nccl(args=local, exchange="quantized", **options)
        assert gathers() == before + 1, "SAGEATTN_PEER_MEMORY=0 still gathered through the peers' memory"
        assert torch.equal(out_q, out_n) and torch.equal(lse_q, lse_n), f"NCCL, causal={causal}"
        poisoned()
        out_i, lse_i = run(args=local, ring_group=group, exchange="input", **options)
        assert gathers() == before + 2, "the 16-bit ring did not gather through the peers' memory"
        assert torch.equal(out_q, out_i) and torch.equal(lse_q, lse_i), f"causal={causal}"
        want, want_lse = reference.exact_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                                   is_causal=causal, return_lse=True)
        err = rel_l1(out_q, want.transpose(1, 2)[:, rows])
        one_gpu = whole(q, k, v, **options)[0][:, rows]
        print(f"rank {rank} causal={causal}: ring vs float64 rel. L1 {err:.4f}, vs one GPU "
              f"{rel_l1(out_q, one_gpu):.4f}; lse max error "
              f"{float((lse_q.double() - want_lse[:, :, rows]).abs().max()):.2e}", flush=True)
        assert err < 0.05 and rel_l1(out_q, one_gpu) < 0.05
        close(lse_q, want_lse[:, :, rows], "ring lse", 1e-2)
    # Shards of different lengths (diffusers' ring_anything): each padded to the longest on the
    # way, each attending its own keys only (a padded key would add its weight to every row).
    tokens = [3001 + 211 * (-1) ** r for r in range(world)]
    rows = rows_of(tokens, rank)
    for causal in (False, True):
        options = dict(is_causal=causal, return_lse=True, qk_quant="int8")
        out, lse = run(args=tuple(t[:, rows] for t in (q, k, v)), ring_group=group, **options)
        out_n, lse_n = through_nccl(args=tuple(t[:, rows] for t in (q, k, v)), **options)
        assert torch.equal(out, out_n) and torch.equal(lse, lse_n), f"uneven, NCCL, causal={causal}"
        want, want_lse = reference.exact_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                                   is_causal=causal, return_lse=True)
        one_gpu = whole(q, k, v, **options)[0][:, rows]
        err = rel_l1(out, want.transpose(1, 2)[:, rows])
        print(f"rank {rank} uneven causal={causal}: ring vs float64 rel. L1 {err:.4f}, vs one GPU "
              f"{rel_l1(out, one_gpu):.4f}", flush=True)
        assert err < 0.05 and rel_l1(out, one_gpu) < 0.05
        close(lse, want_lse[:, :, rows], "uneven ring lse", 1e-2)
    run(args=local, ring_group=group, exchange="quantized", qk_quant="int8")
    sent = parallel.last_ring_bytes()
    run(args=local, ring_group=group, exchange="input", qk_quant="int8")
    plain = parallel.last_ring_bytes()
    print(f"rank {rank}: bytes sent per ring call {sent} quantized, {plain} bf16 "
          f"({sent / plain:.3f}x)", flush=True)
    assert sent <= 0.55 * plain


@scenario
def gpu_ulysses_bit_exact() -> None:
    """Ulysses on the GPUs: this rank's output and LSE are the one-GPU call's rows, bit for bit
    (each head's attention is computed alone either way), also over shards of different lengths
    and heads that do not divide among the ranks; through the peers' memory in halves of the
    heads (every call here, however short) where the ranks have it."""
    from sageattention2 import _peer_exchange, parallel

    with halves_for_every_call():
        calls = _peer_exchange.halves_calls
        ulysses_bit_exact()
        if parallel._peer_memories:
            assert _peer_exchange.halves_calls > calls, "no call went in halves"


@contextlib.contextmanager
def halves_for_every_call() -> Iterator[None]:
    """Ulysses through the peers' memory in halves for calls of any length (the product takes
    them from ~1 ms of kernel: these calls are shorter)."""
    from sageattention2 import parallel

    least = parallel._HALVES_MIN_WORK
    parallel._HALVES_MIN_WORK = 0
    parallel._halves_kinds.clear()
    try:
        yield
    finally:
        parallel._HALVES_MIN_WORK = least
        parallel._halves_kinds.clear()


def ulysses_bit_exact() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 2500 * world
    (q, k, v), local = whole_and_shard(1, n, 8, 4, 128, 31, rank, world, dtype=torch.bfloat16)
    rows = slice(rank * 2500, (rank + 1) * 2500)
    for causal in (False, True):
        options = dict(is_causal=causal, return_lse=True, qk_quant="int8", enable_gqa=True)
        out, lse = run(args=local, ulysses_group=GROUPS["world"], **options)
        want, want_lse = whole(q, k, v, **options)
        assert torch.equal(out, want[:, rows]), f"causal={causal}"
        assert torch.equal(lse, want_lse[:, :, rows]), f"causal={causal}"
    # Shards of different lengths (diffusers' ulysses_anything), 10 query heads over 5 key heads
    # (3 and 2 key heads a rank on 2 GPUs): the same, through the peers' memory.
    tokens = [2500 + 173 * (-1) ** r for r in range(world)]
    rows = rows_of(tokens, rank)
    q, k, v = (draw(1, sum(tokens), h, 128, seed, torch.bfloat16, offset=3.0 * (seed == 52))
               for h, seed in ((10, 51), (5, 52), (5, 53)))
    for causal in (False, True):
        options = dict(is_causal=causal, return_lse=True, qk_quant="int8", enable_gqa=True)
        out, lse = run(args=tuple(t[:, rows] for t in (q, k, v)), ulysses_group=GROUPS["world"],
                       **options)
        want, want_lse = whole(q, k, v, **options)
        assert torch.equal(out, want[:, rows]), f"uneven, causal={causal}"
        assert torch.equal(lse, want_lse[:, :, rows]), f"uneven, causal={causal}"


@scenario
def gpu_ulysses_through_peer_memory() -> None:
    """On the GPUs Ulysses travels through the peers' memory (the group's buffers are mapped
    after a call), in halves of the heads and with every head at once (``copy``), and gives
    NCCL's all-to-all's output and LSE bit for bit (HND inputs, whose rows the copy engines
    leave to the copy kernel; GQA, batch 2, an odd shard length, poisoned memory; and value
    head_dim 64 under head_dim 128, which no kernel serves: every head at once); a rank whose
    environment disables it while another's does not raises on every rank."""
    from sageattention2 import _peer_exchange, parallel
    from sageattention2.testing import poison_cuda_allocator

    rank, world = dist.get_rank(), dist.get_world_size()
    group = GROUPS["world"]
    n = 1001 * world
    (q, k, v), local = whole_and_shard(2, n, 8, 4, 128, 41, rank, world, dtype=torch.bfloat16)
    local = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in local)  # HND memory
    options = dict(return_lse=True, qk_quant="int8", enable_gqa=True)
    rows = slice(rank * 1001, (rank + 1) * 1001)
    # (value head_dim 64: the kernels do not serve it, so no call goes in halves)
    for value_dim in (128, 64):
        args = (*local[:2], local[2][..., :value_dim])
        results = {}
        with halves_for_every_call():
            for allowed in ("1", "copy", "0", "1 poisoned", "copy poisoned"):
                os.environ[parallel.PEER_MEMORY_ENVIRONMENT] = allowed.split()[0]
                poison_cuda_allocator(DEVICE)
                memory = parallel._peer_memories.get((parallel._group_name(group), DEVICE.index))
                if allowed.endswith("poisoned"):
                    assert memory, "the peers' memory was not mapped on 2 GPUs of one host"
                    memory.buffers[memory.rank].fill_(255)  # (NaN in bf16: every byte read must be written)
                calls = _peer_exchange.halves_calls
                results[allowed] = run(args=args, ulysses_group=group, **options)
                in_halves = _peer_exchange.halves_calls > calls
                assert in_halves == (allowed.startswith("1") and value_dim == 128), (allowed, value_dim)
        os.environ.pop(parallel.PEER_MEMORY_ENVIRONMENT)
        want = whole(q, k, v[..., :value_dim], **options)
        for allowed in ("1", "copy", "1 poisoned", "copy poisoned"):
            for got, other in zip(results[allowed], results["0"]):
                assert torch.equal(got, other), (allowed, value_dim)
            assert torch.equal(results[allowed][0], want[0][:, rows]), (allowed, value_dim)
            assert torch.equal(results[allowed][1], want[1][:, :, rows]), (allowed, value_dim)
    os.environ[parallel.PEER_MEMORY_ENVIRONMENT] = "0" if rank == 0 else "1"
    try:
        expect_error("differ in SAGEATTN_PEER_MEMORY", args=local, ulysses_group=group, **options)
    finally:
        os.environ.pop(parallel.PEER_MEMORY_ENVIRONMENT)


@scenario
def diffusers_models_as_shipped() -> None:
    """Wan and Flux (tiny, float32) with our backend under diffusers' context parallelism,
    chosen before and after enable_parallelism and by attention_backend(...), Ulysses and the
    ring: the output equals the one-process output (the CPU's exact path)."""
    diffusers_models([(1, 2), (2, 1)], ("before", "after", "context"))
    diffusers_models([(1, 2, "ulysses_anything"), (2, 1, "ring_anything")], ("before",))


@scenario
def diffusers_models_ring_and_ulysses() -> None:
    """The same on 4 ranks: ring 2 x Ulysses 2 (the tiny models have 2 heads)."""
    diffusers_models([(2, 2)], ("before",))


def diffusers_models(modes: list[tuple[Any, ...]], orders: tuple[str, ...]) -> None:
    from diffusers import ContextParallelConfig
    from diffusers.models.attention_dispatch import attention_backend

    from sageattention2 import _model_suite
    from sageattention2.integrations import diffusers as sage_diffusers

    if DEVICE.type == "cpu":  # diffusers places each rank on an accelerator (rank % count)
        torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
        # (and the "anything" modes gather the shards' sizes there, unless the group is "cpu:gloo")
        torch.accelerator.current_accelerator = lambda *args: torch.device("cpu")  # type: ignore[assignment]
    sage_diffusers.register()
    # (gloo's all_gather takes no shards of different lengths, and diffusers gathers the model's
    # output with it: on the CPU the "anything" modes run on shards of one length)
    odd_tokens = any(len(mode) > 2 for mode in modes) and dist.get_backend() == "nccl"
    for build in (_model_suite.wan21_1_3b, _model_suite.flux_dev):
        def fresh() -> tuple[torch.nn.Module, dict[str, Any]]:
            torch.manual_seed(0)
            model, inputs = build(DEVICE, torch.float32, True)
            if odd_tokens and build is _model_suite.wan21_1_3b:  # 3 x 3 x 5 = 45 tokens: 23 and 22
                inputs["hidden_states"] = torch.randn(1, 16, 3, 6, 10, generator=torch.Generator()
                                                      .manual_seed(1)).to(DEVICE)
            return model, dict(inputs, return_dict=False)  # what the plans' output hooks take

        model, inputs = fresh()
        model.set_attention_backend("sageattention2")
        with torch.no_grad():
            want = model(**inputs)[0]
        for ring, ulysses, *anything in modes:
            for order in orders:
                model, inputs = fresh()
                config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses,
                                               **{name: True for name in anything})
                if order == "before":
                    model.set_attention_backend("sageattention2")
                    model.enable_parallelism(config=config)
                elif order == "after":
                    model.enable_parallelism(config=config)
                    model.set_attention_backend("sageattention2")
                with torch.no_grad():
                    if order == "context":
                        model.enable_parallelism(config=config)
                        with attention_backend("sageattention2"):
                            got = model(**inputs)[0]
                    else:
                        got = model(**inputs)[0]
                close(got, want, f"{build.__name__} ring {ring} ulysses {ulysses} {anything} ({order})",
                      1e-5)


@scenario
def yunchang_usp_runs_the_dropin() -> None:
    """yunchang's LongContextAttention (Ulysses x ring, every split of this world) with its
    SAGE attention types, served by the drop-in ``sageattention`` (compat/, on PYTHONPATH):
    each rank's output equals one-process float64 attention (the CPU's exact path) or, on GPUs,
    is within quantization noise of it and of yunchang's own torch backend; on GPUs the
    quantized kernel ran."""
    import sageattention  # noqa: F401 (the drop-in: yunchang finds it)
    from yunchang import LongContextAttention, set_seq_parallel_pg
    from yunchang.kernels import AttnType

    from sageattention2 import ops
    from sageattention2.reference import exact_attention
    from sageattention2.testing import cosine_similarity as cosine

    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = DEVICE.type == "cuda"
    n, d, dtype = (2048, 128, torch.bfloat16) if on_gpu else (24, 16, torch.float32)
    q, k, v = (draw(1, n, 8, d, 21 + i, offset=3.0 * (i == 1)).to(dtype) for i in range(3))
    kernel_calls = [0]
    real = {name: getattr(ops, name) for name in ("sageattn_wgmma", "sageattn_mma")}

    def counter(function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            kernel_calls[0] += 1
            return function(*args, **kwargs)
        return counted

    for name, function in real.items():
        setattr(ops, name, counter(function))
    splits = [(u, world // u) for u in (1, 2, 4) if world % u == 0 and u <= world]
    for ulysses, ring in splits:
        set_seq_parallel_pg(ulysses, ring, rank, world)
        for causal in (False, True):
            want = exact_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                   is_causal=causal).transpose(1, 2)
            rows = slice(rank * n // world, (rank + 1) * n // world)
            local = [t[:, rows].contiguous() for t in (q, k, v)]
            outputs = {}
            kinds = [AttnType.SAGE_AUTO, AttnType.SAGE_FP8, AttnType.SAGE_FP8_SM90, AttnType.SAGE_FP16]
            for kind in kinds + ([AttnType.TORCH_FLASH] if on_gpu else []):
                before = kernel_calls[0]
                attention = LongContextAttention(ring_impl_type="basic", attn_type=kind)
                with torch.no_grad():
                    outputs[kind] = attention(*local, softmax_scale=d ** -0.5, causal=causal)
                what = f"yunchang {kind.value} ulysses {ulysses} x ring {ring} causal={causal}"
                if kind is AttnType.TORCH_FLASH:
                    continue
                if on_gpu:
                    assert kernel_calls[0] > before, f"{what}: the quantized kernel did not run"
                    assert cosine(outputs[kind], want[:, rows]) >= 0.999, what
                else:
                    close(outputs[kind], want[:, rows].to(dtype), what, 1e-5)
            if on_gpu:
                for kind in kinds:
                    similarity = cosine(outputs[kind], outputs[AttnType.TORCH_FLASH])
                    assert similarity >= 0.999, (kind, ulysses, ring, causal, similarity)
                    if rank == 0:
                        print(f"yunchang {kind.value} ulysses {ulysses} x ring {ring} "
                              f"causal={causal}: CosSim vs its torch backend {similarity:.6f}",
                              flush=True)
    for name, function in real.items():
        setattr(ops, name, function)


def expect_error(match: str, **kwargs: Any) -> None:
    try:
        run(**kwargs)
    except ValueError as error:
        assert match in str(error), (match, str(error))
        return
    raise AssertionError(f"no error on rank {dist.get_rank()} (expected {match!r})")


@scenario
def bad_input_on_one_rank_raises_everywhere() -> None:
    """Rank 1 alone passes a bad dtype, then a different shape, then a bad option: every rank
    raises the same clear error (none waits in a collective), in ring and Ulysses; good calls
    agree with one all-reduce, without the full records."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _, (q, k, v) = whole_and_shard(1, 8, 4, 4, 8, 1, rank, world)
    group = GROUPS["world"]
    for mode in ("ring_group", "ulysses_group"):
        bad_q = q.long() if rank == 1 else q
        expect_error("rank 1: TypeError", args=(bad_q, k, v), **{mode: group})
        # (either alone takes shards of any length: the ranks differ in head_dim instead)
        narrow = (q[..., :4], k[..., :4], v[..., :4])
        expect_error("differ in head_dim", args=narrow if rank == 1 else (q, k, v), **{mode: group})
        options = {"qk_quant": "int9"} if rank == 1 else {}
        expect_error("rank 1: ValueError: qk_quant", args=(q, k, v), **{mode: group}, **options)
        keys = torch.ones(1, k.shape[1], dtype=torch.bool, device=DEVICE)
        if rank == 1:
            keys = keys.to("meta")  # on another device than q
        expect_error("rank 1: ValueError: attn_mask must be on", args=(q, k, v), attn_mask=keys,
                     **{mode: group})
    # and the group still works afterwards, its agreement one all-reduce per call: the full
    # records (messages, which fields differ) travel only when a rank's call is bad or differs
    from sageattention2 import parallel

    assert isinstance(parallel._host_meshes.get(parallel._group_name(group)), parallel._HostMesh), \
        "the ranks of one host did not agree through their sockets"
    exchanges: list[int] = []
    real = parallel._exchange_records
    parallel._exchange_records = lambda *a: exchanges.append(1) or real(*a)  # type: ignore[assignment]
    try:
        for mode in ("ring_group", "ulysses_group"):
            out = run(args=(q, k, v), **{mode: group})
            assert out.shape == q.shape
        assert not exchanges, "the ranks exchanged full records although they agreed"
        expect_error("differ in value head_dim", args=(q, k, v[..., :4] if rank == 1 else v),
                     ring_group=group)
        assert exchanges
    finally:
        parallel._exchange_records = real


@scenario
def bad_input_raises_everywhere_through_gloo() -> None:
    """The same where the ranks' sockets cannot be made: gloo carries the agreement."""
    from sageattention2 import parallel

    name = parallel._group_name(GROUPS["world"])
    mesh = parallel._host_meshes.get(name)
    parallel._host_meshes[name] = None
    agreed: list[int] = []
    real = parallel.dist.all_reduce
    parallel.dist.all_reduce = lambda *a, **k: agreed.append(1) or real(*a, **k)  # type: ignore[assignment]
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        _, (q, k, v) = whole_and_shard(1, 8, 4, 4, 8, 1, rank, world)
        for mode in ("ring_group", "ulysses_group"):
            bad_q = q.long() if rank == 1 else q
            expect_error("rank 1: TypeError", args=(bad_q, k, v), **{mode: GROUPS["world"]})
            expect_error("differ in value head_dim", args=(q, k, v[..., :4] if rank == 1 else v),
                         **{mode: GROUPS["world"]})
        assert agreed, "gloo did not carry the agreement"
    finally:
        parallel.dist.all_reduce = real  # type: ignore[assignment]
        parallel._host_meshes[name] = mesh


def main() -> int:
    global DEVICE
    rank, world, port, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if backend == "nccl":
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, rank=rank, world_size=world)
    import mutants  # a behaviour broken on purpose (tests/mutants.py), in the ranks too

    if os.environ.get(mutants.ENVIRONMENT):
        mutants.apply(os.environ[mutants.ENVIRONMENT])
    GROUPS.update(groups())
    for name in sys.argv[5:]:
        try:
            SCENARIOS[name]()
            print(f"rank {rank}: ok {name}", flush=True)
        except Exception:  # noqa: BLE001 (reported, then the exit code says it)
            # Leave at once: the other ranks, waiting in this scenario's collectives or the next
            # one's, then fail on the lost connection instead of waiting for a timeout.
            print(f"rank {rank}: FAILED {name}\n{traceback.format_exc()}", flush=True)
            return 1
    dist.barrier()  # every rank done before any tears its connections down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Straight out: at interpreter exit gloo's worker threads can still be torn down under a
    # live process group's destructor ("terminate called without an active exception", seen once
    # in CI on 4 ranks after every scenario had passed).
    os._exit(code)
