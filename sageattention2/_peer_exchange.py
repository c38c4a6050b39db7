"""Context parallelism's exchanges through the peers' memory (one host): every rank's buffer
mapped into every other rank's address space. Ulysses: each rank copies its tokens of the other
ranks' heads straight into their buffers, at its own token rows (docs/DECISIONS.md#d54); every
head at once (:func:`tokens_to_heads` and :func:`heads_to_tokens`, one ``copy_many_`` launch
each) or in two halves of the heads, each half's exchange beside the other half's kernel
(:func:`ulysses_in_halves`, by the copy engines). The ring: each rank's packed K and V shard
into a row of every peer's buffer by the copy engines, beside the kernel on the local shard
(:func:`start_all_gather`). :mod:`.parallel` maps the buffers, agrees on them and decides which
way a call goes.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from . import ops

__all__ = ["ALIGN", "FLAG_CHANNELS", "READ_CHANNEL", "RING_CHANNEL", "Halves", "PeerMemory", "UlyssesSplit",
           "bytes_as", "end_all_gather", "gathered_rows", "heads_to_tokens", "kept", "peer_layouts",
           "start_all_gather", "tokens_to_heads", "ulysses_in_halves", "wait_for_row"]

ALIGN = 256  # every part of an exchanged buffer starts 256-byte aligned (the kernels read 16 B)

KEPT = 64  # entries a per-kind cache keeps

FLAG_CHANNELS = 5  # PeerMemory's signal channels: 0 and 1 the halves' inputs (one per half),
RING_CHANNEL = 3   # 2 their outputs, 3 the ring's all-gather (peer by peer), 4 an exchange's
READ_CHANNEL = 4   # reads of this rank's buffer done (PeerMemory.done_reading)


def kept(cache: dict[Any, Any], key: Any, build: Callable[[], Any]) -> Any:
    """``cache[key]``, built at the key's first call. Past ``KEPT`` keys (a server seeing many
    shapes) the kept ones are dropped, not grown without end: the per-kind caches of context
    parallelism (the checked calls, Ulysses' layouts and halves, the peers' views) all keep their
    entries so."""
    if key not in cache:
        if len(cache) >= KEPT:
            cache.clear()
        cache[key] = build()
    return cache[key]


class UlyssesSplit(NamedTuple):
    """Who holds what in a Ulysses group, the same on every rank: each rank's query and key
    tokens (its shard of the sequence; shards in rank order, of any lengths: diffusers'
    ``ulysses_anything``) and the heads it attends after the exchange (key heads as even as they
    go, the first ranks one more; query heads with their key heads under GQA)."""

    q_tokens: tuple[int, ...]
    k_tokens: tuple[int, ...]
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]

    @staticmethod
    def of(q_tokens: tuple[int, ...], k_tokens: tuple[int, ...], h_q: int, h_kv: int) -> UlyssesSplit:
        p = len(q_tokens)
        kv_heads = tuple(h_kv // p + int(r < h_kv % p) for r in range(p))
        return UlyssesSplit(q_tokens, k_tokens, tuple(h * (h_q // h_kv) for h in kv_heads), kv_heads)


def bytes_as(buffer: Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``buffer`` (uint8) from ``offset`` viewed as a contiguous ``dtype`` tensor of ``shape``."""
    return buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


@dataclass
class PeerMemory:
    """A buffer of the same size on every rank of a group, each rank's mapped into every other
    rank's address space (``torch.distributed._symmetric_memory``: CUDA IPC over NVLink), and a
    barrier on the current stream across the group's ranks, on one of a few channels (barriers
    on different streams take different channels; every rank passes a channel's in one order)."""

    rank: int                       # this rank's index in the group
    buffers: list[Tensor]           # uint8, one per rank of the group ([rank]: this rank's own)
    barrier: Callable[..., None]    # (channel=0)
    keep: Any = None                # what keeps the mappings alive (the allocation and its handle)
    layouts: dict[Any, Any] = field(default_factory=dict)  # :meth:`views`' keys and views
    side_streams: list[Any] | None = None  # the halves' streams (:meth:`streams`)
    # int32 [FLAG_CHANNELS, P] per rank, mapped like the buffers: [channel, r] counts rank r's
    # signals to this rank on the channel (:meth:`signal`, :meth:`wait`); zero on every rank
    # before any signal
    flags: list[Tensor] | None = None
    # ("signal" or "wait", channel, peer): this rank's signals to the peer, its waits on it
    counts: Counter[tuple[str, int, int]] = field(default_factory=Counter)
    slots: dict[tuple[bool, int, int], Tensor] = field(default_factory=dict)  # :meth:`_slot`'s
    others: tuple[int, ...] | None = None  # every rank but this one, once signals are used

    def _peers(self, peers: Sequence[int] | None) -> Sequence[int]:
        if peers is not None:
            return peers
        if self.others is None:
            assert self.flags is not None, "signals need the flags (PeerMemory.flags)"
            self.others = tuple(r for r in range(len(self.flags)) if r != self.rank)
        return self.others

    def _slot(self, toward_peer: bool, channel: int, peer: int) -> Tensor:
        """The flag this rank writes for ``peer`` (in the peer's flags) or reads of it (in its
        own), made once: at most 2 x FLAG_CHANNELS x P of them, apart from the views (whose
        cache is dropped whole when full)."""
        key = (toward_peer, channel, peer)
        if key not in self.slots:
            assert self.flags is not None
            me = self.rank
            self.slots[key] = (self.flags[peer][channel, me:me + 1] if toward_peer
                               else self.flags[me][channel, peer:peer + 1])
        return self.slots[key]

    def _by_count(self, toward_peer: bool, channel: int,
                  counts: list[tuple[int, int]]) -> dict[int, list[Tensor]]:
        """The slots of (peer, count) pairs grouped by count: one stream operation per count,
        peers told or awaited alike share one (one op instead of three on 4 ranks)."""
        slots: dict[int, list[Tensor]] = {}
        for peer, count in counts:
            slots.setdefault(count, []).append(self._slot(toward_peer, channel, peer))
        return slots

    def _counted(self, kind: str, channel: int, peers: Sequence[int]) -> dict[int, list[Tensor]]:
        """Counts one more ``kind`` on ``channel`` toward each of ``peers``: the slots by their
        new counts."""
        for peer in peers:
            self.counts[kind, channel, peer] += 1
        return self._by_count(kind == "signal", channel,
                              [(peer, self.counts[kind, channel, peer]) for peer in peers])

    def signal(self, channel: int, peers: Sequence[int] | None = None) -> None:
        """Tells every peer (or ``peers``), on the current stream once its work so far has
        landed (a peer then sees every byte it wrote into the peer's buffer), that this rank
        passed ``channel`` toward it once more. No SM: a stream memory operation, so that a
        signal beside a kernel that holds every SM is not held up until that kernel's tail as a
        barrier kernel is. A channel's signals and waits are counted per peer: a channel may be
        passed toward the peers one by one (the ring's gather)."""
        for count, slots in self._counted("signal", channel, self._peers(peers)).items():
            ops.signal_flags_(slots, count)

    def wait(self, channel: int, peers: Sequence[int] | None = None) -> None:
        """The current stream waits, no SM, until every peer (or each of ``peers``) has
        signalled ``channel`` toward this rank as many times as this rank has waited on it
        (this wait included)."""
        for count, slots in self._counted("wait", channel, self._peers(peers)).items():
            ops.wait_flags_(slots, count)

    def wait_caught_up(self, channel: int) -> None:
        """The current stream waits, no SM, until every peer has signalled ``channel`` toward
        this rank as many times as this rank has signalled it toward that peer: for a channel
        that every rank passes once at the end of each call (:data:`READ_CHANNEL`), every peer
        has ended the calls this rank has ended. Counts nothing; nothing to wait for before
        the first signal."""
        owed = [(peer, self.counts["signal", channel, peer]) for peer in self._peers(None)]
        for count, slots in self._by_count(False, channel, [o for o in owed if o[1]]).items():
            ops.wait_flags_(slots, count)

    def done_reading(self) -> None:
        """Tells every peer, once this rank's work so far on the current stream has landed, that
        this call has read all it reads of this rank's buffer: a peer's next writes into it may
        go (:meth:`wait_caught_up` on :data:`READ_CHANNEL`). Every exchange through the buffer
        ends with it, so that the ring's gather, which takes no barrier, also waits for the
        last Ulysses call's readers."""
        self.signal(READ_CHANNEL)

    def view(self, owner: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return bytes_as(self.buffers[owner], offset, shape, dtype)

    def views(self, layout: Any, build: Callable[[], Any]) -> Any:
        """An exchange's views of the buffers, built at the first call of its ``layout`` (the
        same every call of a model: building them, dozens of slices and views, cost the host
        ~0.3 ms a Wan call on 2 ranks, session 48); at most 64 layouts are kept."""
        return kept(self.layouts, layout, build)

    def streams(self) -> list[Any]:
        """The halves' side streams on the buffers' device (copies in, the local copy, the
        second half's kernel, copies out), made once; on the CPU (the threads test) None each:
        every step then runs in program order."""
        if self.side_streams is None:
            device = self.buffers[self.rank].device
            self.side_streams = [torch.cuda.Stream(device) if device.type == "cuda" else None
                                 for _ in range(4)]
        return self.side_streams


def peer_layouts(q: Tensor, k: Tensor, v: Tensor,
                 split: UlyssesSplit) -> tuple[tuple[tuple[tuple[int, tuple[int, ...]], ...], ...], int]:
    """Where q, k and v land in each rank's buffer, ``[B, N, H_r, D]`` each (offset, shape) per
    rank, and the bytes every buffer needs: the most any rank's parts take, or its output ``[B,
    S_r, H, Dv]`` (which lands at offset 0 once the kernel has read q), whichever is more."""
    b, d, dv, nq, nk = q.shape[0], q.shape[3], v.shape[3], sum(split.q_tokens), sum(split.k_tokens)
    layouts, nbytes = [], 0
    for r in range(len(split.q_tokens)):
        parts, total = [], 0
        for t, shape in ((q, (b, nq, split.q_heads[r], d)), (k, (b, nk, split.kv_heads[r], d)),
                         (v, (b, nk, split.kv_heads[r], dv))):
            parts.append((total, shape))
            total += ops.round_up(math.prod(shape) * t.element_size(), ALIGN)
        out = b * split.q_tokens[r] * q.shape[2] * dv * q.element_size()
        layouts.append(tuple(parts))
        nbytes = max(nbytes, total, out)
    return tuple(layouts), nbytes


def tokens_to_heads(q: Tensor, k: Tensor, v: Tensor, memory: PeerMemory, layouts: tuple[Any, ...],
                    split: UlyssesSplit) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v ``[B, S, H, D]`` (this rank's tokens, all heads) -> ``[B, N, H_r, D]`` (all
    tokens, this rank's heads) through the peers' memory: this rank copies rank r's heads of
    its tokens into rank r's buffer, at its own token rows. The first barrier: every rank's
    kernel has finished reading what the last call left there; the second: every rank's rows
    have arrived. ``layouts``: :func:`peer_layouts`'."""
    p, me = len(memory.buffers), memory.rank
    owners = [(me + step) % p for step in range(p)]  # (each rank starts with a different peer)
    tokens = (split.q_tokens, split.k_tokens, split.k_tokens)
    heads = (split.q_heads, split.kv_heads, split.kv_heads)

    def build() -> tuple[list[Tensor], tuple[Tensor, ...], bool]:
        dsts, received = [], []
        for i, x in enumerate((q, k, v)):
            row, mine = sum(tokens[i][:me]), tokens[i][me]
            dsts += [memory.view(owner, *layouts[owner][i], x.dtype)[:, row:row + mine] for owner in owners]
            received.append(memory.view(me, *layouts[me][i], x.dtype))
        return dsts, tuple(received), all(ops.moved_as_words(t) for t in dsts)

    dsts, received, dsts_as_words = memory.views(
        ("to heads", layouts, split, q.dtype, k.dtype, v.dtype), build)
    srcs = []
    for x, counts in zip((q, k, v), heads):
        parts = x.split(counts, dim=2)  # P views [B, S, H_r, D]
        srcs += [parts[owner] for owner in owners]
    memory.barrier()
    # (one launch: the local and the remote copies side by side; a head slice moves as words
    # where its whole tensor does)
    ops.copy_many_(dsts, srcs, as_words=dsts_as_words and all(map(ops.moved_as_words, (q, k, v))))
    memory.barrier()
    return received  # type: ignore[return-value]


def heads_to_tokens(x: Tensor, memory: PeerMemory, split: UlyssesSplit) -> Tensor:
    """``[B, N, H_r, D]`` (all tokens, this rank's heads) -> ``[B, S, H, D]`` (this rank's
    tokens, all heads), the inverse of :func:`tokens_to_heads`, into offset 0 of every buffer
    (q's part, which every rank's kernel has read once the first barrier is passed)."""
    p, me = len(memory.buffers), memory.rank
    b, dv = x.shape[0], x.shape[3]
    owners = [(me + step) % p for step in range(p)]
    h, h0 = sum(split.q_heads), sum(split.q_heads[:me])
    h1 = h0 + split.q_heads[me]

    def build() -> tuple[list[Tensor], Tensor, bool]:
        dsts = [memory.view(owner, 0, (b, split.q_tokens[owner], h, dv), x.dtype)[:, :, h0:h1]
                for owner in owners]
        return (dsts, memory.view(me, 0, (b, split.q_tokens[me], h, dv), x.dtype),
                all(ops.moved_as_words(t) for t in dsts))

    dsts, received, dsts_as_words = memory.views(("to tokens", split, b, dv, x.dtype), build)
    tokens = x.split(split.q_tokens, dim=1)  # P views [B, S_r, H_me, D]
    memory.barrier()
    ops.copy_many_(dsts, [tokens[owner] for owner in owners],
                   as_words=dsts_as_words and ops.moved_as_words(x))
    memory.barrier()
    out = received.clone()  # (the buffer is the next call's)
    memory.done_reading()
    return out


class Halves(NamedTuple):
    """Ulysses in two halves of every rank's heads, the same on every rank: rank r's first
    ceil(H_r / 2) key heads and the rest, query heads with their key heads; where each half's q,
    k and v land in rank r's buffer and, after them, rank r's output ``[B, S_r, H, Dv]``; the
    bytes every buffer needs; the kernel call of every half (decided on the first rank's share,
    the largest, so that every rank takes the same path)."""

    q_cuts: tuple[tuple[int, int, int], ...]    # per rank: its query heads' start, middle, end
    kv_cuts: tuple[tuple[int, int, int], ...]   # the same of its key heads
    parts: tuple[Any, ...]                      # [rank][half][q, k, v]: (offset, shape)
    out: tuple[tuple[int, tuple[int, ...]], ...]  # [rank]: (offset, shape)
    nbytes: int
    kernel: Any                                 # _execute.KernelCall (a stand-in in tests)

    @staticmethod
    def of(q: Tensor, k: Tensor, v: Tensor, split: UlyssesSplit, kernel: Any) -> Halves:
        """The halves of a call of ``q``, ``k`` and ``v`` (NHD shards) split as ``split``."""
        b, d, dv, size = q.shape[0], q.shape[3], v.shape[3], q.element_size()
        nq, nk, group = sum(split.q_tokens), sum(split.k_tokens), q.shape[2] // k.shape[2]
        q_cuts, kv_cuts, parts, outs, nbytes = [], [], [], [], 0
        for r, heads in enumerate(split.kv_heads):
            start = sum(split.kv_heads[:r])
            # (an even cut: a first quarter, exposing less of its inputs and more of the second
            # part's output, was no faster on 2 H200s, session 52)
            cut = (start, start + (heads + 1) // 2, start + heads)
            kv_cuts.append(cut)
            q_cuts.append((cut[0] * group, cut[1] * group, cut[2] * group))
            halves, total = [], 0
            for a, z in ((cut[0], cut[1]), (cut[1], cut[2])):
                half = []
                for shape in ((b, nq, (z - a) * group, d), (b, nk, z - a, d), (b, nk, z - a, dv)):
                    half.append((total, shape))
                    total += ops.round_up(math.prod(shape) * size, ALIGN)
                halves.append(tuple(half))
            out_shape = (b, split.q_tokens[r], q.shape[2], dv)
            outs.append((total, out_shape))
            parts.append(tuple(halves))
            nbytes = max(nbytes, total + math.prod(out_shape) * size)
        return Halves(tuple(q_cuts), tuple(kv_cuts), tuple(parts), tuple(outs), nbytes, kernel)

    def sizes(self, cuts: tuple[tuple[int, int, int], ...]) -> list[int]:
        """The heads of every (rank, half) in order: a tensor's ``split`` into its 2P sources."""
        return [n for a, m, z in cuts for n in (m - a, z - m)]


halves_calls = 0  # calls that went in halves (the tests' evidence of the path)


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _wait(stream: Any, other: Any) -> None:
    """``stream`` waits for the work enqueued on ``other`` so far (CUDA streams; None: the CPU)."""
    if stream is not None:
        stream.wait_stream(other)


def ulysses_in_halves(q: Tensor, k: Tensor, v: Tensor, memory: PeerMemory, halves: Halves,
                      split: UlyssesSplit, return_lse: bool,
                      attend: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
                      ) -> tuple[Tensor, Tensor | None]:
    """Ulysses through the peers' memory in two halves of the heads: (this rank's tokens of
    every head's output ``[B, S, H, Dv]``; with ``return_lse`` the LSE of its heads ``[B, H_r,
    N]``, else None). The copy engines move each half's q, k and v into their owners'
    buffers, each rank then signalling every peer (:meth:`PeerMemory.signal`: no SM), so that
    the second half crosses while the first half's kernel runs, which holds every SM; the
    second half's kernel waits for its signals on its own stream (no SM either) and fills the
    first one's tail; each half's output rows go back to their owners by the copy engines too,
    the first half's beside the second's kernel (D54: on 2 H200s a call 4 % (Wan), 5 % (Flux)
    faster than every head at once). A half's kernel reads only its own heads, so the output is
    the one-GPU output bit for bit. No barrier: the copy stream first waits until every peer has
    ended its last exchange through its buffer. Every signal is enqueued before every wait on
    a signal of this call: two streams that share a hardware queue
    (``CUDA_DEVICE_MAX_CONNECTIONS=1``) then serialise, but no wait is queued ahead of the
    signal it needs.
    ``attend``: the halves' attention, ``[B, H, N, D]`` views in, NHD-memory output and LSE out
    (the kernel call; the threads test's exact stand-in)."""
    global halves_calls
    halves_calls += 1
    p, me = len(memory.buffers), memory.rank
    owners = [(me + step) % p for step in range(p)]
    tensors = ((q, split.q_tokens), (k, split.k_tokens), (v, split.k_tokens))

    def build() -> tuple[list[tuple[list[Tensor], list[Tensor]]], list[list[Tensor]], list[list[Tensor]], Tensor,
                         bool]:
        ins = []
        for j in (0, 1):
            remote, local = [], []
            for i, (x, tokens) in enumerate(tensors):
                row, mine = sum(tokens[:me]), tokens[me]
                for owner in owners:
                    view = memory.view(owner, *halves.parts[owner][j][i], x.dtype)[:, row:row + mine]
                    (local if owner == me else remote).append(view)
            ins.append((remote, local))
        received = [[memory.view(me, *where, x.dtype) for where, (x, _) in zip(halves.parts[me][j], tensors)]
                    for j in (0, 1)]
        cut = halves.q_cuts[me]
        back = [[memory.view(owner, *halves.out[owner], q.dtype)[:, :, cut[j]:cut[j + 1]]
                 for owner in owners] for j in (0, 1)]
        dsts = [t for remote, local in ins for t in remote + local] + [t for ts in back for t in ts]
        return (ins, received, back, memory.view(me, *halves.out[me], q.dtype),
                all(ops.moved_as_words(t) for t in dsts))

    ins, received, back, mine, dsts_as_words = memory.views(("halves", halves, q.dtype), build)
    # (the sources are head or token slices of q, k, v and the kernel's output: asked of their
    # parents once, not of the six launches' 24-odd tensors; copy_many_'s note)
    ins_as_words = dsts_as_words and all(map(ops.moved_as_words, (q, k, v)))
    sources = [x.split(halves.sizes(cuts), dim=2) for x, cuts in
               ((q, halves.q_cuts), (k, halves.kv_cuts), (v, halves.kv_cuts))]
    copies, local, second, returns = memory.streams()
    main = torch.cuda.current_stream(q.device) if copies is not None else None
    computes = (main, second)
    # No barrier: the copies into a peer's buffer wait (no SM) until the peer has ended its last
    # exchange through it (done_reading); after a halves call that holds anyway (this rank ended
    # it once every peer's output rows came, which follow every peer's kernels), after a ring
    # call it is the ring's readers; a peer's output region is written only after the peer's
    # signal of this call, which follows its copy out of the last call's output.
    _wait(copies, main)
    _wait(local, main)
    with _on(copies):
        memory.wait_caught_up(READ_CHANNEL)
    for j in (0, 1):
        remote_dsts, local_dsts = ins[j]
        remote_srcs = [parts[2 * owner + j] for parts in sources for owner in owners[1:]]
        with _on(local):
            ops.copy_many_(local_dsts, [parts[2 * me + j] for parts in sources], as_words=ins_as_words,
                           by_copy_engine=True)
        _wait(computes[j], local)
        with _on(copies):
            ops.copy_many_(remote_dsts, remote_srcs, as_words=ins_as_words, by_copy_engine=True)
            memory.signal(j)  # this rank's rows of half j are in every peer's buffer
    lses = []
    for j in (0, 1):
        with _on(computes[j]):
            memory.wait(j)  # every peer's rows of half j are here (no SM: not held up by half 0's kernel)
            out, lse = (attend or halves.kernel)(*(t.transpose(1, 2) for t in received[j]))
        lses.append(lse)
        tokens_first = out.transpose(1, 2)
        rows = tokens_first.split(split.q_tokens, dim=1)
        as_words = dsts_as_words and ops.moved_as_words(tokens_first)
        # The peers' rows by the copy engines beside the next kernel; this rank's own on their own
        # stream: a copy within one GPU takes SMs, and would hold the peers' rows back until the
        # second half's kernel frees them (session 52's trace).
        _wait(returns, computes[j])
        with _on(returns):
            ops.copy_many_(back[j][1:], [rows[owner] for owner in owners[1:]], as_words=as_words,
                           by_copy_engine=True)
        _wait(local, computes[j])
        with _on(local):
            ops.copy_many_(back[j][:1], [rows[me]], as_words=as_words, by_copy_engine=True)
    with _on(returns):
        memory.signal(2)  # this rank's output rows are in every peer's buffer
    memory.wait(2)  # every peer's output rows are here
    _wait(main, returns)
    _wait(main, local)
    _wait(main, second)
    out = mine.clone()  # (the buffer is the next call's)
    memory.done_reading()
    return out, torch.cat(lses, dim=1) if return_lse else None


def gathered_rows(memory: PeerMemory, nbytes: int) -> Tensor:
    """This rank's buffer as the ring's ``[P, nbytes]`` rows: row r holds rank r's packed shard
    once gathered. The caller packs its own shard into its own row, on the current stream, then
    calls :func:`start_all_gather`."""
    return memory.view(memory.rank, 0, (len(memory.buffers), nbytes), torch.uint8)


def _senders_first(memory: PeerMemory) -> list[int]:
    """The peers in the order this rank sends them its row: the one whose ring takes this
    rank's shard first (rank r attends owners r+1, r+2, ...: rank me - 1 takes mine first)."""
    p, me = len(memory.buffers), memory.rank
    return [(me - step) % p for step in range(1, p)]


def start_all_gather(memory: PeerMemory, nbytes: int) -> None:
    """Sends this rank's row of :func:`gathered_rows` into the same row of every peer's buffer,
    by the copy engines on a side stream, telling each peer on ``RING_CHANNEL`` as its row
    lands (first the peer that attends this shard first), so that a rank's kernel on an
    owner's shard waits for that owner's row only (:func:`wait_for_row`). The copy stream first
    waits for the packing, and until every peer has ended its last call through the buffer
    (:meth:`PeerMemory.done_reading`); the current stream goes on at once to the kernel on the
    local shard: no barrier ahead of it, which had waited for the slowest rank there (0.95 ms
    of a Wan2.1-14B-like call on 2 H200s, session 53). Not by NCCL's all-gather: its kernel
    needs SMs, and where the kernel on the local shard got them first, the gather waited for
    that kernel's tail (2.0 ms of the same call, session 52). The call ends with
    :func:`end_all_gather`."""
    me = memory.rank

    def build() -> tuple[list[int], list[Tensor], Tensor, bool]:
        peers = _senders_first(memory)
        dsts = [memory.view(peer, me * nbytes, (nbytes,), torch.uint8) for peer in peers]
        source = gathered_rows(memory, nbytes)[me]
        return peers, dsts, source, all(map(ops.moved_as_words, [*dsts, source]))

    peers, dsts, source, as_words = memory.views(("ring", nbytes), build)
    copies = memory.streams()[0]
    _wait(copies, torch.cuda.current_stream(memory.buffers[me].device) if copies is not None else None)
    with _on(copies):
        memory.wait_caught_up(READ_CHANNEL)  # every peer has read the last call's rows
        for peer, dst in zip(peers, dsts):
            ops.copy_many_([dst], [source], as_words=as_words, by_copy_engine=True)
            memory.signal(RING_CHANNEL, (peer,))  # this rank's shard is in the peer's buffer


def wait_for_row(memory: PeerMemory, owner: int) -> None:
    """The current stream waits, no SM, until ``owner``'s row of :func:`gathered_rows` has
    arrived."""
    memory.wait(RING_CHANNEL, (owner,))


def end_all_gather(memory: PeerMemory) -> None:
    """The current stream waits for this rank's sends (its row is packed again next call); once
    the kernels on the peers' rows have run, every peer may send the next call's rows."""
    copies = memory.streams()[0]
    if copies is not None:
        _wait(torch.cuda.current_stream(memory.buffers[memory.rank].device), copies)
    memory.done_reading()
