"""Context parallelism (sageattention2.parallel) across processes: on the CPU over gloo (the exact
path: the plumbing of Ulysses, the ring and both, the LSE merge, masks, the quantized exchange
with its quantizer and kernel stood in for, and a bad input on one rank raising on every rank),
and on 2 GPUs over NCCL (the quantized path against the one-GPU call). Each rank is a process
running tests/parallel_worker.py."""
from __future__ import annotations

import dataclasses
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch

import sageattention2

WORKER = Path(__file__).resolve().parent / "parallel_worker.py"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_ranks(world: int, backend: str, *scenarios: str, timeout: float = 600,
              path: tuple[Path, ...] = ()) -> None:
    """Start ``world`` ranks of the worker on ``scenarios``; every rank must pass all of them
    (a rank left waiting in a collective shows as the timeout). ``path``: folders put first on
    the ranks' PYTHONPATH (the drop-in's)."""
    package_root = str(Path(sageattention2.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*map(str, path), package_root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    port = free_port()
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), port, backend,
                               *scenarios], env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
             for r, log in enumerate(logs)]
    # A rank that fails leaves at once; the others then fail on the lost connection, or are
    # stopped a little later (one waiting for a dead peer would otherwise wait for the timeout).
    deadline = time.monotonic() + timeout
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
        if any(rank.returncode not in (None, 0) for rank in ranks):
            deadline = min(deadline, time.monotonic() + 20)
        time.sleep(0.1)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{out[-4000:]}"
                       for r, (p, out) in enumerate(zip(ranks, outputs)))
    assert all(p.returncode == 0 for p in ranks), report


def test_two_ranks_on_the_cpu() -> None:
    run_ranks(2, "gloo", "ring_matches_one_process", "ring_causal_matches_one_process",
              "ulysses_matches_one_process", "ulysses_causal_matches_one_process",
              "ring_key_mask_local_and_global", "ulysses_key_mask_local",
              "bad_input_on_one_rank_raises_everywhere", "bad_input_raises_everywhere_through_gloo",
              "quantized_exchange_plumbing", "shards_of_any_length", "compiled_calls_run_eagerly")


def test_ulysses_and_ring_on_four_cpu_ranks() -> None:
    run_ranks(4, "gloo", "ulysses_and_ring", "shards_of_any_length")


def test_diffusers_context_parallelism_on_the_cpu() -> None:
    """diffusers' own context parallelism with our backend, as users enable it (2 and 4 ranks)."""
    pytest.importorskip("diffusers")
    run_ranks(2, "gloo", "diffusers_models_as_shipped")
    run_ranks(4, "gloo", "diffusers_models_ring_and_ulysses")


def test_yunchang_usp_on_cpu_ranks(dropin: Path) -> None:
    """yunchang's USP with its SAGE attention types, reaching our code through the drop-in
    ``sageattention``: Ulysses 2, ring 2, and on 4 ranks also 2 x 2."""
    pytest.importorskip("yunchang")
    run_ranks(2, "gloo", "yunchang_usp_runs_the_dropin", path=(dropin,))
    run_ranks(4, "gloo", "yunchang_usp_runs_the_dropin", path=(dropin,))


@pytest.mark.gpu
def test_yunchang_usp_on_gpus(dropin: Path, attention_kernel: None) -> None:
    """The same on GPUs (NCCL): 2 ranks, and 4 (2 x 2 among them) where there are 4 GPUs."""
    pytest.importorskip("yunchang")
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(4 if gpus >= 4 else 2, "nccl", "yunchang_usp_runs_the_dropin", path=(dropin,))


def test_one_rank_is_sageattn() -> None:
    """Without groups (or groups of one rank) the call is sageattn's."""
    from sageattention2 import sageattn
    from sageattention2.parallel import context_parallel_attention

    q, k, v = (torch.randn(1, 7, 2, 8) for _ in range(3))
    torch.testing.assert_close(context_parallel_attention(q, k, v, is_causal=True),
                               sageattn(q, k, v, is_causal=True, tensor_layout="NHD"), rtol=0, atol=0)
    with pytest.raises(TypeError, match="unexpected keyword.*bogus"):
        context_parallel_attention(q, k, v, bogus=1)
    with pytest.raises(ValueError, match="exchange must be one of"):
        context_parallel_attention(q, k, v, exchange="fp8")


def test_a_kind_of_call_is_checked_once() -> None:
    """A call of a kind that passed before is built without checking it again, into the call
    the check builds (NHD and HND, a 2-D key mask); what differs in an argument's type (``1``
    for ``True``) or in a shape is another kind, checked (and refused) as before."""
    from sageattention2 import parallel

    parallel._checked_kinds.clear()
    checks: list[int] = []
    real_check = parallel._check

    def counted(*args: object) -> parallel.ParallelCall:
        checks.append(1)
        return real_check(*args)

    def checked(q: torch.Tensor, mask: torch.Tensor | None, layout: str, causal: object = False,
                **options: object) -> tuple[parallel.ParallelCall, tuple[int, ...]]:
        return parallel._checked(q, q, q, mask, 0.0, causal, None, False, None, None, layout,
                                 False, "auto", options)

    nhd, mask = torch.randn(2, 7, 4, 8), torch.ones(2, 7, dtype=torch.bool)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel, "_check", counted)
        for layout, q in (("NHD", nhd), ("HND", nhd.transpose(1, 2).contiguous())):
            first, fields = checked(q, mask, layout, qk_quant="int8")
            again, same = checked(q.clone(), mask.clone(), layout, qk_quant="int8")
            assert fields == same and len(checks) == (1 if layout == "NHD" else 2)
            for f in dataclasses.fields(first):
                a, b = getattr(first, f.name), getattr(again, f.name)
                if isinstance(a, torch.Tensor):
                    assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b), f.name
                else:
                    assert a == b, f.name
        with pytest.raises(TypeError, match="is_causal must be a bool"):
            checked(nhd, None, "NHD", causal=1)
        checked(nhd, None, "NHD", causal=True)
        with pytest.raises(TypeError, match="is_causal must be a bool"):
            checked(nhd, None, "NHD", causal=1)
        with pytest.raises(ValueError, match="qk_quant"):
            checked(nhd, None, "NHD", causal=True, qk_quant="int3")
        with pytest.raises(ValueError, match="4-D"):
            checked(nhd[0], None, "NHD")
        assert len(checks) == 7  # (every call above after the two repeats)
    parallel._checked_kinds.clear()


def _peers_memory(world: int, nbytes: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The threads tests' peers' memory: every rank's buffer of ``nbytes``, poisoned (every byte
    read must be written), and its signals' flags, zero."""
    from sageattention2 import _peer_exchange

    buffers = [torch.full((nbytes,), 255, dtype=torch.uint8) for _ in range(world)]
    flags = [torch.zeros(_peer_exchange.FLAG_CHANNELS, world, dtype=torch.int32) for _ in range(world)]
    return buffers, flags


def _packed_row(nbytes: int, salt: int) -> torch.Tensor:
    """A ring row of ``nbytes`` whose bytes differ with ``salt`` (a rank, a call)."""
    return torch.arange(nbytes, dtype=torch.int64).add(salt).remainder(251).to(torch.uint8)


def _ring_call_read_late(memory: Any, row: torch.Tensor, late: float) -> torch.Tensor:
    """One ring gather through the threads' peers' memory: this rank's ``row`` packed and sent,
    then each owner's row read after its wait, in the ring's order, ``late`` seconds after the
    wait on every rank but the first (a read before its wait, or a peer's next write before the
    read, would show). Every rank's row as this rank read it, ``[P, bytes]``."""
    from sageattention2 import _peer_exchange

    r, world, nbytes = memory.rank, len(memory.buffers), row.numel()
    rows = _peer_exchange.gathered_rows(memory, nbytes)
    assert rows.shape == (world, nbytes) and rows.data_ptr() == memory.buffers[r].data_ptr()
    rows[r].copy_(row)
    _peer_exchange.start_all_gather(memory, nbytes)
    read = row.expand(world, nbytes).clone()
    for step in range(1, world):
        owner = (r + step) % world
        _peer_exchange.wait_for_row(memory, owner)
        time.sleep(late if r else 0.0)
        read[owner] = rows[owner]
    _peer_exchange.end_all_gather(memory)
    return read


class _ThreadRanks(NamedTuple):
    """Ulysses' inputs for the tests where threads stand in for the ranks: every rank's token
    count and first row, the whole q, k and v (NHD views of HND tensors, batch 2), each rank's
    shards of them, the split, and the generator (for what a test draws next)."""

    tokens: list[int]
    starts: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    shards: list[list[torch.Tensor]]
    split: Any
    generator: torch.Generator

    @staticmethod
    def of(world: int, even: bool, hq: int, hkv: int, dtype: torch.dtype, head_dim: int,
           value_dim: int) -> _ThreadRanks:
        """Shards of one length, or (uneven) of different lengths, on 4 ranks one empty."""
        from sageattention2 import _peer_exchange

        tokens = [6] * world if even else ([7, 4] if world == 2 else [3, 0, 5, 2])
        starts = [sum(tokens[:r]) for r in range(world + 1)]
        g = torch.Generator().manual_seed(world + head_dim)
        q, k, v = (torch.randn(2, h, starts[-1], d, generator=g).to(dtype).transpose(1, 2)
                   for h, d in ((hq, head_dim), (hkv, head_dim), (hkv, value_dim)))
        shards = [[t[:, starts[r]:starts[r + 1]] for t in (q, k, v)] for r in range(world)]
        split = _peer_exchange.UlyssesSplit.of(tuple(tokens), tuple(tokens), hq, hkv)
        return _ThreadRanks(tokens, starts, q, k, v, shards, split, g)

    def run(self, rank: Callable[[int], None]) -> None:
        """``rank(r)`` on a thread per rank, all at once (their barriers meet), to the end."""
        import threading

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(self.tokens))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype, head_dim, value_dim", [(torch.bfloat16, 128, 128),
                                                        (torch.float16, 64, 128),
                                                        (torch.float32, 5, 3)])  # (no 8-byte words)
@pytest.mark.parametrize("even", [True, False])
def test_ulysses_through_peer_memory(world: int, dtype: torch.dtype, head_dim: int,
                                     value_dim: int, even: bool) -> None:
    """Ulysses' exchanges through the peers' memory, with threads standing in for the ranks
    (their buffers in one process, a threading barrier for the GPU's): every rank receives all
    tokens of its heads of q, k and v (GQA, batch 2, NHD views of HND tensors) and gets back its
    tokens of every head of the output, exactly, in two calls (the second through the first's
    views); the buffer is the size the layout asks for. Uneven: shards of different lengths (on
    4 ranks one empty) and key heads that do not divide among the ranks."""
    import threading

    from sageattention2 import _peer_exchange

    hq, hkv = (2 * world, world) if even else (2 * (world + 1), world + 1)
    case = _ThreadRanks.of(world, even, hq, hkv, dtype, head_dim, value_dim)
    q, k, v, shards, split, starts = case.q, case.k, case.v, case.shards, case.split, case.starts
    out = torch.randn(2, starts[-1], hq, value_dim, generator=case.generator).to(dtype)
    assert sum(split.q_heads) == hq and sum(split.kv_heads) == hkv
    layouts, nbytes = _peer_exchange.peer_layouts(*shards[0], split)
    buffers, flags = _peers_memory(world, nbytes)
    barrier = threading.Barrier(world, timeout=60)
    got: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def heads_of(r: int, counts: tuple[int, ...]) -> slice:
        return slice(sum(counts[:r]), sum(counts[:r + 1]))

    def rank(r: int) -> None:
        memory = _peer_exchange.PeerMemory(r, buffers, lambda channel=0: barrier.wait(), flags=flags)
        assert _peer_exchange.peer_layouts(*shards[r], split) == (layouts, nbytes)
        # The second call reuses the first call's views of the buffers (memory.layouts): it
        # must move the second call's tensors (the first's negated), all of them.
        for sign in (-1, 1):
            mine = [sign * t for t in shards[r]]
            heads = [sign * t.clone() for t in
                     _peer_exchange.tokens_to_heads(*mine, memory, layouts, split)]
            back = sign * _peer_exchange.heads_to_tokens(
                sign * out[:, :, heads_of(r, split.q_heads)], memory, split)
        # (each call told every peer that it had read its buffer: the ring's gather waits so)
        assert all(memory.counts["signal", _peer_exchange.READ_CHANNEL, peer] == 2
                   for peer in range(world) if peer != r), r
        got[r] = heads, back

    case.run(rank)
    assert sorted(got) == list(range(world))
    for r, (heads, back) in got.items():
        for name, whole, part, counts in zip("qkv", (q, k, v), heads,
                                             (split.q_heads, split.kv_heads, split.kv_heads)):
            assert torch.equal(part, whole[:, :, heads_of(r, counts)]), (r, name)
        assert torch.equal(back, out[:, starts[r]:starts[r + 1]]), r


def _exact_halves_attention(q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves' attention in the threads test: ``[B, H, N, D]`` views in (GQA), float64
    attention, the output in the inputs' dtype and NHD memory (as the kernel writes it) and the
    float32 LSE out."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    out = (torch.softmax(scores, -1) @ v).to(q.dtype)
    return out.transpose(1, 2).contiguous().transpose(1, 2), torch.logsumexp(scores, -1).float()


def _no_barrier(channel: int = 0) -> None:
    """The threads tests' barrier where the exchange under test takes none."""
    raise AssertionError("the exchange took a barrier")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype, head_dim, value_dim", [(torch.bfloat16, 128, 128),
                                                        (torch.float32, 5, 3)])
@pytest.mark.parametrize("even", [True, False])
def test_ulysses_in_halves_through_peer_memory(world: int, dtype: torch.dtype, head_dim: int,
                                               value_dim: int, even: bool) -> None:
    """Ulysses in two halves of the heads, threads standing in for the ranks (their buffers in
    one process, poisoned; no barrier: the halves take none; the signals' flags in shared CPU
    tensors, each wait a thread's; the exact attention for the kernel): every rank gets its
    tokens of every head's output, each head attended over all tokens, and its heads' LSE,
    exactly as the halves' attention gives them on the whole tensors; in two calls (the second
    through the first's views). Uneven: shards of different lengths (on 4 ranks one empty) and
    key heads that do not divide among the ranks (the first rank's halves 2 + 1 heads)."""
    from sageattention2 import _peer_exchange

    hkv = 2 * world + (0 if even else 1)
    hq = 2 * hkv
    case = _ThreadRanks.of(world, even, hq, hkv, dtype, head_dim, value_dim)
    q, k, v, shards, split, starts = case.q, case.k, case.v, case.shards, case.split, case.starts
    halves = _peer_exchange.Halves.of(*shards[0], split, None)
    assert [c[2] - c[0] for c in halves.kv_cuts] == list(split.kv_heads)
    buffers, flags = _peers_memory(world, halves.nbytes)
    got: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def rank(r: int) -> None:
        memory = _peer_exchange.PeerMemory(r, buffers, _no_barrier, flags=flags)
        signal = memory.signal

        def late_after_signalling(channel: int, peers: Any = None) -> None:
            # (every rank but the first goes on late after each signal: its next copies come
            # after the first rank's next steps, unless the first rank waits for them)
            signal(channel, peers)
            time.sleep(0.02 if r else 0.0)

        memory.signal = late_after_signalling  # type: ignore[method-assign]
        assert _peer_exchange.Halves.of(*shards[r], split, None) == halves
        got[r] = []
        for sign in (-1, 1):  # (the second call through the first's views: it must move all)
            out, lse = _peer_exchange.ulysses_in_halves(*(sign * t for t in shards[r]), memory,
                                                        halves, split, sign > 0, _exact_halves_attention)
            got[r].append((sign * out, lse))
        assert all(memory.counts["signal", _peer_exchange.READ_CHANNEL, peer] == 2
                   for peer in range(world) if peer != r), r

    case.run(rank)
    assert sorted(got) == list(range(world))
    for call, sign in enumerate((-1, 1)):
        wants = _halves_wanted(case, halves, sign)
        for r in range(world):
            out, lse = got[r][call]
            _assert_halves_output(out, case, wants, r, sign)
            if sign < 0:  # (this call without return_lse)
                assert lse is None
            else:
                assert torch.equal(lse, torch.cat([wants[r, half][3] for half in range(2)], dim=1)), r


def _halves_wanted(case: _ThreadRanks, halves: Any, sign: int) -> dict[tuple[int, int], tuple[Any, ...]]:
    """Every half of every rank's heads over all tokens of ``sign`` times the case's q, k and v,
    as the kernel call would give it: (owner, half) -> (first and end query head, output
    ``[B, H, N, D]``, LSE)."""
    wants = {}
    for owner in range(len(case.tokens)):
        for half in range(2):
            a, z = halves.q_cuts[owner][half:half + 2]
            kv = slice(*halves.kv_cuts[owner][half:half + 2])
            wants[owner, half] = (a, z, *_exact_halves_attention(
                sign * case.q.transpose(1, 2)[:, a:z], sign * case.k.transpose(1, 2)[:, kv],
                sign * case.v.transpose(1, 2)[:, kv]))
    return wants


def _assert_halves_output(out: torch.Tensor, case: _ThreadRanks, wants: dict[tuple[int, int], tuple[Any, ...]],
                          r: int, sign: int) -> None:
    """Rank r's output (``sign`` times what it got) is its tokens of every head's output."""
    assert out.shape == (*case.q.shape[:1], case.tokens[r], case.q.shape[2], case.v.shape[3])
    rows = slice(case.starts[r], case.starts[r + 1])
    for (owner, half), (a, z, want, _) in wants.items():
        assert torch.equal(out[:, :, a:z], sign * want.transpose(1, 2)[:, rows]), (r, owner, half)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_all_gather_through_peer_memory(world: int) -> None:
    """The ring's all-gather through the peers' memory, threads standing in for the ranks (their
    buffers in one process, poisoned; the flags in shared CPU tensors; no barrier: the gather
    takes none): a rank reads each owner's row, in the ring's order, after its wait for that
    owner; every rank but the first is late before each read, so that a rank that read before
    its wait would read a row not yet written, and a rank that sent its next call's row before
    its peers had read the last one would overwrite a row not yet read. Row r of what every
    rank read holds rank r's packed bytes, in three calls whose bytes differ."""
    import threading

    from sageattention2 import _peer_exchange

    nbytes = 2 * _peer_exchange.ALIGN
    buffers, flags = _peers_memory(world, world * nbytes)
    got: dict[int, list[torch.Tensor]] = {}
    calls = 3

    def packed(r: int, call: int) -> torch.Tensor:
        return _packed_row(nbytes, 97 * r + 31 * call)

    def rank(r: int) -> None:
        memory = _peer_exchange.PeerMemory(r, buffers, _no_barrier, flags=flags)
        signal = memory.signal

        def late_after_signalling(channel: int, peers: Any = None) -> None:
            # (every rank but the first is late after each send: its rows land one by one)
            signal(channel, peers)
            time.sleep(0.02 if r else 0.0)

        memory.signal = late_after_signalling  # type: ignore[method-assign]
        got[r] = []
        for call in range(calls):
            got[r].append(_ring_call_read_late(memory, packed(r, call), 0.02))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(world))
    for r in range(world):
        assert len(got[r]) == calls, r
        for call in range(calls):
            assert torch.equal(got[r][call], torch.stack([packed(o, call) for o in range(world)])), (r, call)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_after_ulysses_waits_for_its_readers(world: int) -> None:
    """A ring call after a Ulysses call through the same peers' memory (one group, both modes),
    threads standing in for the ranks: the ring's gather takes no barrier, so it must wait until
    every peer has ended its Ulysses call (every exchange signals "done reading" at its end).
    Every rank but the first is late between its last wait of the Ulysses call and its copy of
    the output out of its buffer, and the first rank's ring row covers that output: sent early,
    it would overwrite the output before the late rank had copied it."""
    from sageattention2 import _peer_exchange, ops

    case = _ThreadRanks.of(world, True, 4 * world, 2 * world, torch.float32, 8, 8)
    halves = _peer_exchange.Halves.of(*case.shards[0], case.split, None)
    nbytes = ops.round_up(halves.nbytes, _peer_exchange.ALIGN)  # (row 0 covers every output)
    buffers, flags = _peers_memory(world, world * nbytes)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def packed(r: int) -> torch.Tensor:
        return _packed_row(nbytes, 89 * r)

    def rank(r: int) -> None:
        memory = _peer_exchange.PeerMemory(r, buffers, _no_barrier, flags=flags)
        wait = memory.wait

        def late_after_the_outputs(channel: int, peers: Any = None) -> None:
            wait(channel, peers)
            if channel == 2:  # (every peer's output rows are here; the copy out comes late)
                time.sleep(0.1 if r else 0.0)

        memory.wait = late_after_the_outputs  # type: ignore[method-assign]
        out, _ = _peer_exchange.ulysses_in_halves(*case.shards[r], memory, halves, case.split, False,
                                                  _exact_halves_attention)
        rows = _peer_exchange.gathered_rows(memory, nbytes)
        rows[r].copy_(packed(r))
        _peer_exchange.start_all_gather(memory, nbytes)
        for step in range(1, world):
            _peer_exchange.wait_for_row(memory, (r + step) % world)
        got[r] = out, rows.clone()
        _peer_exchange.end_all_gather(memory)

    case.run(rank)
    assert sorted(got) == list(range(world))
    wants = _halves_wanted(case, halves, 1)
    for r, (out, rows) in got.items():
        _assert_halves_output(out, case, wants, r, 1)
        assert torch.equal(rows, torch.stack([packed(o) for o in range(world)])), r


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_after_the_ring_waits_for_its_readers(world: int) -> None:
    """A Ulysses call in halves after a ring call through the same peers' memory, threads
    standing in for the ranks, no barrier: the halves' copies into a peer's buffer must wait
    until the peer has ended its ring call. Every rank but the first reads each owner's ring row
    late, and the first rank's q rows of the halves land over the first ring row: sent early,
    they would overwrite a row the late rank had not read yet."""
    from sageattention2 import _peer_exchange

    case = _ThreadRanks.of(world, True, 4 * world, 2 * world, torch.float32, 8, 8)
    halves = _peer_exchange.Halves.of(*case.shards[0], case.split, None)
    nbytes = 2 * _peer_exchange.ALIGN
    assert halves.parts[1][0][0][0] == 0  # (a peer's half-0 q starts at 0, in row 0 of the ring)
    size = max(world * nbytes, halves.nbytes)
    buffers, flags = _peers_memory(world, size)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def packed(r: int) -> torch.Tensor:
        return _packed_row(nbytes, 83 * r + 7)

    def rank(r: int) -> None:
        memory = _peer_exchange.PeerMemory(r, buffers, _no_barrier, flags=flags)
        read = _ring_call_read_late(memory, packed(r), 0.1)
        out, _ = _peer_exchange.ulysses_in_halves(*case.shards[r], memory, halves, case.split, False,
                                                  _exact_halves_attention)
        got[r] = read, out

    case.run(rank)
    assert sorted(got) == list(range(world))
    wants = _halves_wanted(case, halves, 1)
    for r, (read, out) in got.items():
        assert torch.equal(read, torch.stack([packed(o) for o in range(world)])), r
        _assert_halves_output(out, case, wants, r, 1)


def test_a_kind_of_ulysses_call_is_laid_out_once() -> None:
    """The split and the peers' layouts of a Ulysses call are made at the first call of its kind
    (shapes, dtype, the ranks' token counts) and reused; another kind gets its own; past 64 kinds
    the kept ones are dropped, not grown without end."""
    from sageattention2 import _peer_exchange, parallel

    parallel._ulysses_layouts.clear()
    q, k, v = (torch.zeros(1, 5, h, 8, dtype=torch.float16) for h in (4, 2, 2))
    first = parallel._ulysses_layout(q, k, v, (5, 3), (5, 3))
    split, layouts, nbytes = first
    assert split == _peer_exchange.UlyssesSplit.of((5, 3), (5, 3), 4, 2)
    assert (layouts, nbytes) == _peer_exchange.peer_layouts(q, k, v, split)
    assert parallel._ulysses_layout(q.clone(), k, v, (5, 3), (5, 3)) is first
    other = parallel._ulysses_layout(q, k, v, (5, 4), (5, 4))
    assert other is not first and other[0].q_tokens == (5, 4)
    assert parallel._ulysses_layout(q.float(), k.float(), v.float(), (5, 3), (5, 3)) is not first
    for n in range(3, 65):  # (with (5, 3), (5, 4) and the float32 kind: 63 kinds)
        parallel._ulysses_layout(q, k, v, (5, n), (5, n))
    assert len(parallel._ulysses_layouts) == 63
    parallel._ulysses_layout(q, k, v, (5, 98), (5, 98))
    assert len(parallel._ulysses_layouts) == 64
    last = parallel._ulysses_layout(q, k, v, (5, 99), (5, 99))
    assert len(parallel._ulysses_layouts) == 1
    assert parallel._ulysses_layout(q, k, v, (5, 99), (5, 99)) is last


def test_peer_memory_keeps_views_per_layout() -> None:
    """An exchange's views are built at its layout's first call and reused after; past 64
    layouts (a server seeing many shapes) the kept ones are dropped, not grown without end."""
    from sageattention2 import _peer_exchange

    memory = _peer_exchange.PeerMemory(0, [torch.zeros(16, dtype=torch.uint8)], lambda: None)
    built: list[int] = []

    def views(layout: int) -> object:
        return memory.views(layout, lambda: built.append(layout) or ("views", layout))

    assert views(0) == ("views", 0) and views(0) == ("views", 0) and built == [0]
    for layout in range(1, 64):
        views(layout)
    assert len(memory.layouts) == 64 and built == list(range(64))
    assert views(64) == ("views", 64) and len(memory.layouts) == 1
    assert views(0) == ("views", 0) and built[-2:] == [64, 0]


def _copy_pairs(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """copy_many_'s cases: (destinations, sources, the buffers the destinations are views of,
    filled with 0xFF around them). Ulysses' views (a token slice of a head group; its source
    from NHD and from HND memory, GQA's fewer heads), the output's (a head slice), 3-, 2- and
    1-D pairs, a 4-D one whose rows are its third dimension, fp16, float32 and bytes, an empty
    pair."""
    g = torch.Generator().manual_seed(5)

    def data(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=g, dtype=dtype).to(device)
        return torch.randn(shape, generator=g).to(dtype).to(device)

    def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:  # 0xFF: NaN in floats
        nbytes = math.prod(shape) * dtype.itemsize
        return torch.full((nbytes,), 255, dtype=torch.uint8, device=device).view(dtype).view(shape)

    dsts, srcs, buffers = [], [], []

    def pair(buffer: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        buffers.append(buffer)
        dsts.append(dst)
        srcs.append(src)

    for owner in range(2):  # q and k of one rank (of 2) to both owners, B 2, S 37, H 8 / 4
        for h in (8, 4):
            buffer = poisoned((2, 74, h // 2, 128), torch.bfloat16)
            nhd = data((2, 37, h, 128), torch.bfloat16)
            source = nhd if h == 8 else nhd.transpose(1, 2).contiguous().transpose(1, 2)
            pair(buffer, buffer[:, 37:], source.unflatten(2, (2, h // 2))[:, :, owner])
    out_buffer = poisoned((1, 40, 6, 64), torch.float16)
    pair(out_buffer, out_buffer[:, :, 3:], data((1, 80, 3, 64), torch.float16)[:, 40:])
    flat = poisoned((9, 24), torch.float32)
    pair(flat, flat[2:7, 4:12], data((5, 8), torch.float32))
    rows = poisoned((3, 5, 48), torch.uint8)
    pair(rows, rows[:, 1:4, 16:32], data((3, 3, 16), torch.uint8))
    line = poisoned((64,), torch.uint8)
    pair(line, line[16:48], data((32,), torch.uint8))
    heads = poisoned((2, 3, 4, 32), torch.float16)  # (by the copy engines: a 2-D copy per (i, j))
    pair(heads, heads[:, :, 1:3, :16], data((2, 3, 2, 16), torch.float16))
    empty = torch.zeros(0, 8, dtype=torch.float16, device=device)
    pair(empty, empty, data((0, 8), torch.float16))
    return dsts, srcs, buffers


def _check_copied(dsts: list[torch.Tensor], srcs: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Every destination equals its source, and every byte of its buffer outside it kept 0xFF."""
    for i, (dst, src, buffer) in enumerate(zip(dsts, srcs, buffers)):
        assert torch.equal(dst.view(torch.uint8), src.contiguous().view(torch.uint8)), i
        outside = torch.ones_like(buffer, dtype=torch.bool)
        outside.as_strided(dst.shape, dst.stride(), dst.storage_offset()).fill_(False)
        kept = buffer.view(torch.uint8).view(*buffer.shape, buffer.element_size())[outside]
        assert bool((kept == 255).all()), f"pair {i} wrote outside its destination"


def test_copy_many_on_the_cpu() -> None:
    """ops.copy_many_ without the kernel (CPU tensors): one copy each, the same result."""
    from sageattention2 import ops

    dsts, srcs, buffers = _copy_pairs("cpu")
    ops.copy_many_(dsts, srcs)
    _check_copied(dsts, srcs, buffers)


def test_copy_many_refusals() -> None:
    """The op's checks (its Meta implementation, what torch.compile traces): each names the pair
    and what is allowed."""
    from sageattention2 import ops

    if not ops.has_op("copy_many_"):
        pytest.skip("the extension has no copy_many_ op")
    op = torch.ops.sageattention2.copy_many_

    def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    cases = [
        (([meta(4, 8)], []), "lists of the same length"),
        (([meta(4, 8)] * 33, [meta(4, 8)] * 33), "at most 32 pairs"),
        (([meta(4, 8)], [meta(4, 16)]), r"dsts\[0\] and srcs\[0\] must have the same shape"),
        (([meta(4, 8)], [meta(4, 8, dtype=torch.float16)]), "same shape and dtype"),
        (([meta(2, 2, 2, 2, 8)], [meta(2, 2, 2, 2, 8)]), "1 to 4 dimensions"),
        (([meta(4, 4)], [meta(4, 4)]), "multiple of 16 bytes"),
        (([meta(8, 8).t()], [meta(8, 8)]), "contiguous last dimension"),
        (([meta(4, 12)[:, :8]], [meta(4, 8)]), r"stride 0 must be a multiple of 16 bytes"),
    ]
    for (dsts, srcs), match in cases:
        with pytest.raises(RuntimeError, match=match):
            op(dsts, srcs)
    op([meta(4, 8)], [meta(4, 8)])  # a good call passes


@pytest.mark.gpu
def test_copy_many_on_the_gpu() -> None:
    """The op on the GPU: every case of :func:`_copy_pairs` in one launch, and by the copy
    engines (a view of HND memory by token rows, more than 64 2-D copies, still by the launch),
    nothing written outside the destinations (their buffers poisoned); ops.copy_many_ takes the
    op for them; overlapping pairs refused; opcheck."""
    from sageattention2 import ops

    if not torch.cuda.is_available() or not ops.has_op("copy_many_"):
        pytest.skip("needs a CUDA GPU and the copy_many_ op")
    for by_copy_engine in (False, True):
        dsts, srcs, buffers = _copy_pairs("cuda")
        assert all(ops.moved_as_words(t) for t in (*dsts, *srcs))
        ops.copy_many_(dsts, srcs, by_copy_engine=by_copy_engine)
        _check_copied(dsts, srcs, buffers)
    # The copy engines on a side stream, beside work on the current one.
    dsts, srcs, buffers = _copy_pairs("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.copy_many_(dsts, srcs, by_copy_engine=True)
    torch.cuda.current_stream().wait_stream(side)
    _check_copied(dsts, srcs, buffers)
    whole, other = torch.zeros(2, 64, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match=r"srcs\[0\] overlaps dsts\[0\]"):
        torch.ops.sageattention2.copy_many_([whole[16:48]], [whole[:32]])
    with pytest.raises(RuntimeError, match=r"dsts\[1\] overlaps dsts\[0\]"):
        torch.ops.sageattention2.copy_many_([whole[:32], whole[16:48]], [other[:32], other[32:]])
    # An empty slice (a rank's empty shard or share of heads) overlaps nothing, wherever its
    # strides would reach.
    rows = torch.zeros(4, 3, 16, dtype=torch.bfloat16, device="cuda")
    ones = torch.ones(4, 2, 16, dtype=torch.bfloat16, device="cuda")
    torch.ops.sageattention2.copy_many_([rows[:, :0], rows[:, 1:]], [rows[:, 2:2], ones])
    assert bool((rows[:, 1:] == 1).all()) and bool((rows[:, 0] == 0).all())
    dsts, srcs, _ = _copy_pairs("cuda")
    torch.library.opcheck(torch.ops.sageattention2.copy_many_.default, (dsts[:5], srcs[:5]))
    torch.library.opcheck(torch.ops.sageattention2.copy_many_.default, (dsts[:5], srcs[:5], True))


def test_flags_refusals_and_the_cpu_stand_in() -> None:
    """signal_flags_ / wait_flags_: the ops' checks (Meta) name the flag and what is allowed; on
    CPU tensors (the threads tests' ranks) a signal sets the flags and a wait returns once every
    flag holds the count or a later one, modulo 2**32, and times out otherwise."""
    from sageattention2 import ops

    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
    ops.signal_flags_(flags, 2**32 + 5)  # (a count past 2**32 wraps around)
    assert [int(f) for f in flags] == [5, 5]
    ops.wait_flags_(flags, 2**32 + 5)
    ops.wait_flags_(flags, 3)  # (an earlier count)
    flags[1].fill_(2**31 - 1)
    ops.wait_flags_(flags[1:], 2**31 - 2)
    ops.signal_flags_(flags[1:], 2**31)  # (int32's largest, then its smallest: still later)
    assert int(flags[1]) == -(2**31)
    ops.wait_flags_(flags[1:], 2**31 - 1)
    with pytest.raises(TimeoutError, match="holds 5, waited for 6"):
        ops.wait_flags_(flags, 6, timeout_s=0.05)
    if not ops.has_op("signal_flags_"):
        pytest.skip("the extension has no signal_flags_ op")
    meta = torch.empty(1, dtype=torch.int32, device="meta")
    for name in ("signal_flags_", "wait_flags_"):
        op = getattr(torch.ops.sageattention2, name)
        with pytest.raises(RuntimeError, match=rf"{name}: flags\[1\] must be a one-element int32 tensor"):
            op([meta, torch.empty(2, dtype=torch.int32, device="meta")], 1)
        with pytest.raises(RuntimeError, match="one-element int32 tensor, got Long"):
            op([torch.empty(1, dtype=torch.int64, device="meta")], 1)
        op([meta, meta], 1)  # a good call passes


@pytest.mark.gpu
def test_flags_order_streams_on_the_gpu() -> None:
    """A stream that waits on a flag runs what follows only once another stream, which first
    sleeps and then writes, has signalled it: what it reads is the written value, not the old
    one; counts past 2**31 still order; opcheck."""
    from sageattention2 import ops

    if not torch.cuda.is_available() or not ops.has_op("signal_flags_"):
        pytest.skip("needs a CUDA GPU and the signal_flags_ op")
    for count in (1, 2**31 + 3):
        flags = torch.full((2,), ops._flag_value(count - 1), dtype=torch.int32, device="cuda")
        written = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
        seen = torch.empty_like(written)
        torch.cuda.synchronize()
        writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
        # (the writer first: two streams may share a hardware queue, where a wait enqueued before
        # its signal would never see it; the product enqueues every signal before its waits)
        with torch.cuda.stream(writer):
            torch.cuda._sleep(int(5e7))  # (~25 ms: the reader is waiting by then)
            written.fill_(7.0)
            ops.signal_flags_([flags[0:1]], count)
            torch.cuda._sleep(int(2e7))
            ops.signal_flags_([flags[1:2]], count)
        with torch.cuda.stream(reader):
            ops.wait_flags_([flags[0:1], flags[1:2]], count)
            seen.copy_(written)
        torch.cuda.synchronize()
        assert bool((seen == 7.0).all()), count
        assert [int(f) for f in flags.cpu()] == [ops._flag_value(count)] * 2
    torch.library.opcheck(torch.ops.sageattention2.signal_flags_.default, ([flags[0:1]], 9))  # (then 9)
    torch.library.opcheck(torch.ops.sageattention2.wait_flags_.default, ([flags[0:1]], 9))


def _merge_parts_case(device: str, parts: int, dtype: torch.dtype, head_dim: int, nhd: bool,
                      seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Attention over ``parts`` disjoint key sets of fresh inputs with channel offsets, computed in
    float64 part by part: (the parts' outputs ``[B, H, N, D]`` in ``dtype``, NHD memory where
    ``nhd``; their LSEs as strided float32 views; the float64 attention over all keys). Part 0's
    rows 0-4 see none of its keys (LSE -inf, output 0); rows 5-6 see no key in any part."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, keys = 2, 3, 37, 29
    q = torch.randn(b, h, n, head_dim, generator=g, dtype=torch.float64) + torch.randn(head_dim, generator=g) * 2
    k = torch.randn(b, h, parts * keys, head_dim, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(b, h, parts * keys, head_dim, generator=g, dtype=torch.float64) + 3
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    seen = torch.ones(b, h, n, parts * keys, dtype=torch.bool)
    seen[:, :, 0:5, :keys] = False
    seen[:, :, 5:7] = False
    scores = scores.masked_fill(~seen, -math.inf)
    whole = torch.softmax(scores, -1).nan_to_num(0) @ v
    outs, lses = [], []
    for part in range(parts):
        s = scores[..., part * keys:(part + 1) * keys]
        lse = torch.logsumexp(s, -1)
        out = (torch.softmax(s, -1).nan_to_num(0) @ v[:, :, part * keys:(part + 1) * keys]).to(dtype)
        if nhd:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        outs.append(out.to(device))
        # a strided LSE, as the kernels' padded rows leave it
        padded = torch.full((b, h, n + 3), float("nan"), dtype=torch.float32)
        padded[..., :n] = lse
        lses.append(padded.to(device)[..., :n])
    return outs, lses, whole


def _merged_reference(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts merged in float64 (no rounding but the parts' own)."""
    lse = torch.stack([t.double().cpu() for t in lses])
    top = lse.max(0).values.nan_to_num(neginf=0.0)
    weight = torch.exp(lse - top)
    total = weight.sum(0)
    out = sum(w[..., None] * o.double().cpu() for w, o in zip(weight, outs)) / total.clamp_min(1e-300)[..., None]
    return out, top + torch.log(total)


def _check_merged(out: torch.Tensor, lse: torch.Tensor, outs: list[torch.Tensor], lses: list[torch.Tensor],
                  whole: torch.Tensor, out_nhd: bool) -> None:
    """Merged rows equal the float64 merge of the parts to the output dtype's rounding, and the
    float64 attention over all keys to the parts' rounding; rows that see no key: 0 and -inf."""
    ref_out, ref_lse = _merged_reference(outs, lses)
    assert out.shape == outs[0].shape and out.dtype == outs[0].dtype
    assert (out.stride(1) < out.stride(2)) == out_nhd
    assert lse.shape == lses[0].shape and lse.dtype == torch.float32
    got = out.double().cpu()
    assert bool(torch.isfinite(got).all()), "an element of the merged output was not written"
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(got, ref_out, rtol=eps, atol=eps * 1e-2)
    torch.testing.assert_close(got, whole, rtol=4 * eps, atol=4 * eps)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=1e-6, atol=1e-6)
    assert bool((got[:, :, 5:7] == 0).all()) and bool(torch.isneginf(lse[:, :, 5:7]).all())


@pytest.mark.parametrize("out_nhd", [False, True])
def test_merge_parts_on_the_cpu(out_nhd: bool) -> None:
    """_execute.merge_parts without the op (CPU tensors): the parts folded in float32, rounded
    once, in the memory order asked."""
    from sageattention2 import _execute

    for parts in (1, 2, 3):
        outs, lses, whole = _merge_parts_case("cpu", parts, torch.bfloat16, 16, not out_nhd, parts)
        out, lse = _execute.merge_parts(outs, lses, out_nhd)
        _check_merged(out, lse, outs, lses, whole, out_nhd)


def test_merge_attention_parts_refusals() -> None:
    """The op's checks (its Meta implementation) name the argument and what is allowed; a good
    call's Meta result has the shapes and the memory order asked."""
    from sageattention2 import ops

    if not ops.has_op("merge_attention_parts"):
        pytest.skip("the extension has no merge_attention_parts op")
    op = torch.ops.sageattention2.merge_attention_parts

    def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    o, l = meta(2, 3, 5, 16), meta(2, 3, 5, dtype=torch.float32)
    cases = [
        (([o] * 9, [l] * 9), "1 to 8 parts"),
        (([o, o], [l]), "one LSE per part"),
        (([meta(2, 3, 5, 16, dtype=torch.float32)], [l]), "float16 or bfloat16"),
        (([meta(3, 5, 16)], [meta(3, 5, dtype=torch.float32)]), r"\[B, H, N, D\]"),
        (([meta(2, 3, 5, 12)], [l]), "multiple of 8"),
        (([o, meta(2, 3, 6, 16)], [l, l]), r"outs\[1\] must be like outs\[0\]"),
        (([o, meta(2, 3, 5, 16, dtype=torch.float16)], [l, l]), r"outs\[1\] must be like"),
        (([meta(2, 3, 16, 5).transpose(-1, -2)], [l]), "contiguous in its last dimension"),
        (([meta(2000).as_strided((2, 3, 5, 16), (480, 160, 20, 1))], [l]),
         r"outs\[0\].stride\(2\) must be a multiple of 8"),
        (([o], [meta(2, 3, 5)]), r"lses\[0\] must be float32"),
        (([o], [meta(2, 3, 6, dtype=torch.float32)]), r"lses\[0\] must be float32 \[2, 3, 5\]"),
    ]
    for (outs, lses), match in cases:
        with pytest.raises(RuntimeError, match=match):
            op(outs, lses, False)
    for out_nhd in (False, True):
        out, lse = op([o, o], [l, l], out_nhd)
        assert out.shape == o.shape and lse.shape == l.shape and lse.dtype == torch.float32
        assert (out.stride(1) < out.stride(2)) == out_nhd


@pytest.mark.gpu
def test_merge_attention_parts_on_the_gpu() -> None:
    """The op on the GPU, into a poisoned allocator: 1, 2, 3 and 8 parts, fp16 and bf16, head_dim
    8 to 256, parts in NHD and HND memory, strided LSEs, both output orders, rows that see no key
    in one part or in all; two parts give merge_by_lse's bits; opcheck."""
    from sageattention2 import _execute, ops
    from sageattention2.testing import poison_cuda_allocator

    if not torch.cuda.is_available() or not ops.has_op("merge_attention_parts"):
        pytest.skip("needs a CUDA GPU and the merge_attention_parts op")
    seed = 0
    for parts, dtype, head_dim in [(1, torch.bfloat16, 128), (2, torch.bfloat16, 128), (2, torch.float16, 64),
                                   (3, torch.float16, 8), (8, torch.bfloat16, 256), (3, torch.bfloat16, 96)]:
        for nhd in (False, True):
            for out_nhd in (False, True):
                seed += 1
                outs, lses, whole = _merge_parts_case("cuda", parts, dtype, head_dim, nhd, seed)
                assert ops.merges_in_one_pass(outs, lses)
                poison_cuda_allocator()
                out, lse = _execute.merge_parts(outs, lses, out_nhd)
                _check_merged(out, lse, outs, lses, whole, out_nhd)
                if parts == 2:
                    pair_out, pair_lse = _execute.merge_by_lse(outs[0], lses[0], outs[1], lses[1])
                    assert torch.equal(out, pair_out) and torch.equal(lse, pair_lse)
    outs, lses, _ = _merge_parts_case("cuda", 3, torch.bfloat16, 64, True, 99)
    torch.library.opcheck(torch.ops.sageattention2.merge_attention_parts.default, (outs, lses, True))


@pytest.mark.gpu
def test_two_gpus(attention_kernel: None) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(2, "nccl", "ring_matches_one_process", "ulysses_matches_one_process",
              "ring_key_mask_local_and_global", "ulysses_key_mask_local",
              "bad_input_on_one_rank_raises_everywhere", "gpu_quantized_ring", "gpu_ulysses_bit_exact",
              "gpu_ulysses_through_peer_memory", "shards_of_any_length", "compiled_calls_run_eagerly")


@pytest.mark.gpu
def test_diffusers_context_parallelism_on_two_gpus(attention_kernel: None) -> None:
    """diffusers' context parallelism with our backend on 2 GPUs (NCCL), ulysses_anything over
    shards of different lengths among the modes (gloo cannot gather those: not on the CPU)."""
    pytest.importorskip("diffusers")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(2, "nccl", "diffusers_models_as_shipped")


def test_bench_report_and_chart(tmp_path: Path) -> None:
    """``bench --gpus``' report of one model: the one-GPU rows, every context-parallel row with
    its speedup over the best native row, its scaling over our one GPU and its distance to our
    one-GPU output; the chart's bars are those speedups (a row that could not run has none), and
    with matplotlib they are drawn."""
    from sageattention2 import _bench_models
    from sageattention2 import _bench_parallel as bench

    ours = torch.ones(4)
    single = {"SDPA (default)": (80.0, ours * 1.5), "sageattention2": (64.0, ours)}
    rows = [("wan", 2, "ulysses", "SDPA (native)", 44.0, "0", ours),
            ("wan", 2, "ulysses", "sageattention2", 32.0, "0", ours),
            ("wan", 2, "ring", "cudnn (native)", 48.0, "0", ours),
            ("wan", 2, "ring", "sageattention2, K/V quantized", 40.0, "1000", ours * 2),
            ("wan", 2, "ring", "sageattention2, K/V bf16", float("nan"), "0", torch.empty(0))]
    lines, bars = bench.report("wan", single, rows)
    assert lines[0] == "| wan | 1 | - | SDPA (default) | 80.0 | - | - | - | 0.5000 |"
    assert lines[3] == "| wan | 2 | ulysses | sageattention2 | 32.0 | 1.38x | 2.00x | - | 0.0000 |"
    assert lines[5] == ("| wan | 2 | ring | sageattention2, K/V quantized | 40.0 | 1.10x | 1.60x | "
                        "1000 | 1.0000 |")
    assert lines[6].endswith("| - |")  # the row that could not run
    assert [b["model"] for b in bars] == [f"wan, 2 GPUs, {r[2]}: {r[3]}" for r in rows[:4]]
    assert [round(b["speedup"], 3) for b in bars] == [1.0, 1.375, 0.917, 1.1]
    if _bench_models.pyplot() is not None:
        assert _bench_models.chart(bars, tmp_path / "parallel.png", "t", "x")
        assert (tmp_path / "parallel.png").stat().st_size > 0


def test_bench_rows_of_the_authors_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --gpus`` adds the authors' package (diffusers' ``sage`` backend) to every mode where
    it is installed, never this project's drop-in of the same name, and says how our best row
    compares with theirs."""
    from importlib import metadata

    from sageattention2 import _bench_parallel as bench

    installed: list[str] = []

    def version(name: str) -> str:
        assert name == "sageattention"
        if not installed:
            raise metadata.PackageNotFoundError(name)
        return installed[-1]

    monkeypatch.setattr(metadata, "version", version)
    assert bench.authors_version() is None
    assert all(backend != "sage" for ring in (1, 2) for _, backend, _ in bench._backends(ring))
    installed.append("2.2.0+sageattention2")  # compat/: ours under their name
    assert bench.authors_version() is None
    assert all(backend != "sage" for _, backend, _ in bench._backends(1))
    installed.append("2.2.0")
    assert bench.authors_version() == "2.2.0"
    for ring in (1, 2):
        assert (bench.AUTHORS, "sage", {}) in bench._backends(ring)
    nan = float("nan")
    rows = [("wan", 2, "ulysses", "sageattention2", 36.7), ("wan", 2, "ring", "sageattention2, K/V "
            "quantized", 38.0), ("wan", 2, "ulysses", bench.AUTHORS, 41.2),
            ("wan", 2, "ring", bench.AUTHORS, nan), ("wan", 2, "ulysses", "SDPA (native)", 30.0)]
    assert bench.versus_authors(rows) == ("wan, 2 GPUs: our best 36.7 ms, the authors' best "
                                          "41.2 ms: 1.12x")
    assert bench.versus_authors(rows[:2]) is None


def test_bench_gives_the_authors_ring_inputs_on_their_own_storage() -> None:
    """Under the ring, ``bench --gpus`` hands the authors' kernel (diffusers' ``sageattn``) a
    clone of every tensor that is a view at a storage offset (their kernel reads outside such
    views: an illegal memory access, diffusers issue 13506), the other arguments as they are,
    and puts the real function back afterwards, also after an error."""
    import types

    from sageattention2 import _bench_parallel as bench

    seen: list[tuple[Any, ...]] = []

    def sageattn(q: Any, k: Any, v: Any, **kwargs: Any) -> str:
        seen.append((q, k, v, kwargs))
        return "out"

    module = types.SimpleNamespace(sageattn=sageattn)
    gathered = torch.arange(24.0)
    q, k, v = torch.ones(4), gathered[8:16], gathered[16:24]
    with bench.inputs_on_their_own_storage(module):
        assert module.sageattn(q, k, v=v, tensor_layout="NHD", sm_scale=0.5) == "out"
    (q_in, k_in, v_in, kwargs), = seen
    assert q_in is q and kwargs == {"tensor_layout": "NHD", "sm_scale": 0.5}
    for view, got in ((k, k_in), (v, v_in)):
        assert got.storage_offset() == 0 and got.data_ptr() != view.data_ptr() and torch.equal(got, view)
    assert module.sageattn is sageattn
    with pytest.raises(RuntimeError, match="in the forward"):
        with bench.inputs_on_their_own_storage(module):
            raise RuntimeError("in the forward")
    assert module.sageattn is sageattn
