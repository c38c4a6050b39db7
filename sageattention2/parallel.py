"""Attention over a sequence split across GPUs (context parallelism): Ulysses, ring, and both.

Every rank of a group holds one contiguous shard of the tokens of q, k and v, shards in rank
order (what diffusers' context parallelism and yunchang's USP give the attention): of any
lengths under Ulysses alone or the ring alone (diffusers' ``ulysses_anything`` and
``ring_anything``), of one length under both:

- **Ulysses** (``ulysses_group``): an all-to-all turns each rank's token shard of all heads into
  all tokens of its share of the heads (key heads as even as they go, query heads with them);
  :func:`sageattn` runs there, exactly as on one GPU (so the output is the one-GPU output bit
  for bit); an all-to-all brings the output back. Where the
  group's GPUs share one host (CUDA, NCCL), the all-to-all is each rank copying its shard
  straight into the other ranks' memory (PyTorch's symmetric memory: every rank maps the
  others' buffers), between two barriers: the permuting copy and the transfer are one copy, and
  the received tokens need no second one (``SAGEATTN_PEER_MEMORY=0`` keeps NCCL's all-to-all).
  A call on the Hopper kernel goes in two halves of each rank's heads: one half's q, k and v
  cross by the copy engines while the other half's kernel runs, and each half's output goes
  back beside the next (``SAGEATTN_PEER_MEMORY=copy``: every head at once).
- **Ring** (``ring_group``): every rank's K and V shard goes to every rank of the group in one
  all-gather, started before the kernel runs on the local shard, so that the bytes travel while
  the kernel runs. On one host (CUDA, NCCL) the shard is packed into this rank's row of its
  peers' memory buffer and the copy engines send it into the same row of every peer's, which
  needs no SM (NCCL's all-gather kernel needs SMs: at Wan2.1-14B's length the local kernel took
  them all and the gather waited for its tail, ~2 ms a call on 2 H200s, session 52; D47;
  ``SAGEATTN_PEER_MEMORY=0`` keeps NCCL's); each rank attends its queries to every shard, and
  the partial outputs are merged by their LSE in float32. Where the Hopper kernel serves the
  call (no mask), K and V are quantized **once**, by the rank that holds them, exactly as
  :func:`sageattn` quantizes them on that shard (INT8 K with its per-thread scales and smoothing
  mean, FP8 V with its tile scales and mean), and the codes travel instead of the 16-bit
  tensors: about half the bytes. Each shard's partial output is then bit for bit
  ``sageattn(q, k_shard, v_shard, return_lse=True)``.
- **Both** (USP): Ulysses inside the ulysses group, then the ring over the ring group.

Every rank checks its own arguments; then the ranks exchange a short record of what each was
asked (shapes, dtype, options, or the error it found) on the host, over gloo, so that a bad
input on one rank raises the same clear error on every rank instead of leaving the others
waiting in a collective.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import secrets
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _execute, _peer_exchange, ops
from ._call import AttentionCall, validate
from ._peer_exchange import (ALIGN, FLAG_CHANNELS, Halves, PeerMemory, UlyssesSplit, bytes_as,
                             end_all_gather, gathered_rows, kept, peer_layouts, start_all_gather,
                             ulysses_in_halves, wait_for_row)
from .api import sageattn

__all__ = ["EXCHANGES", "context_parallel_attention", "last_ring_bytes"]

EXCHANGES = ("auto", "quantized", "input")
PEER_MEMORY_ENVIRONMENT = "SAGEATTN_PEER_MEMORY"  # "0": NCCL's all-to-all and all-gather only
# How Ulysses moves the heads (SAGEATTN_PEER_MEMORY): NCCL's all-to-all ("0"), the peers' memory
# with every head at once ("copy"), or in two halves where the Hopper kernel runs (the default).
# The ring gathers through the peers' memory unless "0".
_PEER_NONE, _PEER_COPIES, _PEER_HALVES = range(3)
_OPTION_NAMES = ("qk_quant", "pv_quant", "smooth_k", "smooth_q", "smooth_v", "strict")
_last_ring_bytes = 0


# ------------------------------------------------------------------------------------------------
# Agreement: every rank raises the same error where one rank's call is bad
# ------------------------------------------------------------------------------------------------

_MESSAGE_BYTES = 512
_FIELDS = ("batch", "query tokens", "key tokens", "query heads", "key heads", "head_dim",
           "value head_dim", "dtype", "is_causal", "mask", "options", "tensor_layout", "exchange",
           PEER_MEMORY_ENVIRONMENT)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_host_groups: dict[str, Any] = {}


class CallRecord(NamedTuple):
    """What one rank was asked: the fields every rank must share, or the error it found."""

    fields: tuple[int, ...]
    error_rank: int        # the (global) rank whose check failed, or -1
    error: str

    def encode(self) -> Tensor:
        message = self.error.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
        words = torch.frombuffer(bytearray(message), dtype=torch.int64)
        fields = (*self.fields, *(0,) * (len(_FIELDS) - len(self.fields)))  # one size for all
        head = torch.tensor([len(self.fields), self.error_rank, *fields], dtype=torch.int64)
        return torch.cat([head, words])

    @staticmethod
    def decode(row: Tensor) -> CallRecord:
        n, error_rank = int(row[0]), int(row[1])
        fields = tuple(int(x) for x in row[2:2 + n])
        message = row[2 + len(_FIELDS):].numpy().tobytes().rstrip(b"\0").decode(errors="replace")
        return CallRecord(fields, error_rank, message)


def _group_name(group: Any) -> str:
    return dist._get_process_group_name(group) if hasattr(dist, "_get_process_group_name") else str(id(group))


def _host_group(group: Any) -> Any:
    """A gloo group of ``group``'s ranks (``group`` itself where it is gloo): the records travel
    on the host, so agreeing costs no GPU synchronisation."""
    if dist.get_backend(group) == "gloo":
        return group
    name = _group_name(group)
    if name not in _host_groups:
        _host_groups[name] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                            use_local_synchronization=True)
    return _host_groups[name]


class _HostMesh:
    """A group's ranks on one host, every pair joined by a UNIX stream socket (Linux's abstract
    names: no file to remove). An all-reduce of the agreement's 29 integers through it takes
    about 10 us; gloo's took 0.3-0.9 ms, and the first attention call of a forward waited on it
    with the GPU idle (session 46's profile of Wan on 2 GPUs: 1.4 ms a forward)."""

    def __init__(self, sockets: dict[int, socket.socket]) -> None:
        self.sockets = sockets  # by the peer's rank in the group

    def max(self, values: list[int]) -> list[int]:
        message = struct.pack(f"<{len(values)}q", *values)
        for peer in self.sockets.values():
            peer.sendall(message)  # (232 bytes: every send fits the socket's buffer; none waits)
        result = list(values)
        for peer in self.sockets.values():
            theirs = struct.unpack(f"<{len(values)}q", _receive(peer, len(message)))
            result = [max(a, b) for a, b in zip(result, theirs)]
        return result


_MESH_TIMEOUT_S = 1800.0  # a peer that never answers: an error after gloo's default timeout
_host_meshes: dict[str, _HostMesh | None] = {}


def _receive(peer: socket.socket, nbytes: int) -> bytes:
    chunks, left = [], nbytes
    while left:
        try:
            chunk = peer.recv(left)
        except socket.timeout:
            raise RuntimeError("context_parallel_attention: a rank of the group did not answer the "
                               f"agreement in {_MESH_TIMEOUT_S:.0f} s") from None
        if not chunk:
            raise RuntimeError("context_parallel_attention: a rank of the group left (its socket closed)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _host_mesh(group: Any) -> _HostMesh | None:
    """The group's :class:`_HostMesh`, made at its first use (a collective step), or None where
    its ranks are not all on this host or the sockets cannot be made (gloo then carries the
    agreement)."""
    name = _group_name(group)
    if name not in _host_meshes:
        _host_meshes[name] = _connect_host_mesh(group)
    return _host_meshes[name]


def _connect_host_mesh(group: Any) -> _HostMesh | None:
    host, size, me = _host_group(group), dist.get_world_size(group), dist.get_rank(group)
    listener, address = None, None
    if sys.platform.startswith("linux"):
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address = f"\0sageattention2-{os.getpid()}-{secrets.token_hex(8)}"
            listener.bind(address)
            listener.listen(size)
            listener.settimeout(60.0)
        except OSError:
            listener, address = None, None
    entries: list[Any] = [None] * size
    dist.all_gather_object(entries, (socket.gethostname(), address), group=host)
    sockets: dict[int, socket.socket] = {}
    connected = listener is not None and all(e[1] and e[0] == entries[0][0] for e in entries)
    try:
        for peer in range(me + 1, size) if connected else ():  # the lower rank connects
            joined = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sockets[peer] = joined
            joined.connect(entries[peer][1])
            joined.sendall(struct.pack("<q", me))
    except OSError:
        connected = False
    flags = torch.tensor([-int(connected)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host)  # every rank, the same answer
    if flags.item() == -1:
        for _ in range(me):
            joined, _ = listener.accept()  # type: ignore[union-attr]
            joined.settimeout(_MESH_TIMEOUT_S)
            sockets[struct.unpack("<q", _receive(joined, 8))[0]] = joined
        for joined in sockets.values():
            joined.settimeout(_MESH_TIMEOUT_S)
    if listener is not None:
        listener.close()
    if flags.item() != -1:
        for joined in sockets.values():
            joined.close()
        return None
    return _HostMesh(sockets)


def _host_max(values: list[int], group: Any) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks of ``group``, on the host."""
    mesh = _host_mesh(group)
    if mesh is not None:
        return mesh.max(values)
    mine = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=_host_group(group))
    return mine.tolist()


def _exchange_records(record: CallRecord, group: Any) -> list[CallRecord]:
    host = _host_group(group)
    mine = record.encode()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=host)
    return [CallRecord.decode(row) for row in rows]


def _all_agree(record: CallRecord, group: Any,
               sizes: tuple[int, ...] = ()) -> tuple[bool, list[tuple[int, ...]]]:
    """Whether every rank of ``group`` found no error and has ``record``'s fields, and every
    rank's ``sizes`` (in rank order): one all-reduce (max) of ``[error?, fields, -fields, slots]``
    on the host (:func:`_host_max`), each rank's sizes in its own slots (-1 in the others'). Every
    rank gets the same answer, so every rank takes the same path after it; the full records
    (error messages, which fields differ) travel only when the answer is no. Session 39
    measured the full exchange on every call at 1.5 ms per Wan forward on 4 GPUs."""
    fields = (*record.fields, *(0,) * (len(_FIELDS) - len(record.fields)))
    p, me, m = dist.get_world_size(group), dist.get_rank(group), len(sizes)
    slots = [-1] * (p * m)
    slots[me * m:(me + 1) * m] = sizes
    seen = _host_max([int(record.error_rank >= 0), *fields, *(-f for f in fields), *slots], group)
    n = len(_FIELDS)
    agreed = seen[0] == 0 and all(seen[1 + i] == -seen[1 + n + i] for i in range(n))
    return agreed, [tuple(seen[1 + 2 * n + r * m:1 + 2 * n + (r + 1) * m]) for r in range(p)]


def _agree(record: CallRecord, groups: list[Any],
           sizes: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Raise on every rank of ``groups`` if any rank's check failed or the ranks were asked
    different things; return every rank's ``sizes`` in the first group. The groups are visited
    in order, each rank passing on the first error it has seen: an error in one group reaches
    the ranks of the next through the ranks they share (every rank of a ring x Ulysses mesh
    within two steps)."""
    gathered: list[tuple[int, ...]] = []
    for i, group in enumerate(groups):
        agreed, seen = _all_agree(record, group, sizes if i == 0 else ())
        if agreed:
            gathered = seen if i == 0 else gathered
            continue
        records = _exchange_records(record, group)
        if record.error_rank >= 0:
            continue
        failed = next((r for r in records if r.error_rank >= 0), None)
        if failed is not None:
            record = failed
            continue
        for rank, other in zip(dist.get_process_group_ranks(group), records):
            if other.fields != record.fields:
                differ = {name: (a, b) for name, a, b in zip(_FIELDS, record.fields, other.fields)
                          if a != b}
                record = CallRecord(record.fields, dist.get_rank(), (
                    f"the ranks of a context-parallel group must make the same call, but rank "
                    f"{dist.get_rank()} and rank {rank} differ in "
                    + ", ".join(f"{name} ({a} vs {b})" for name, (a, b) in differ.items())))
                break
    if record.error_rank >= 0:
        raise ValueError(f"context_parallel_attention: rank {record.error_rank}: {record.error}")
    return gathered


# ------------------------------------------------------------------------------------------------
# The call: checked once, on each rank
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelCall:
    """A checked :func:`context_parallel_attention` call: NHD views ``[B, N, H, D]`` and the
    options of every sageattn call it makes."""

    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Tensor | None   # [B or 1, 1, 1, keys]: a key mask over the local or all keys
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    tensor_layout: str
    return_lse: bool
    exchange: str
    options: dict[str, Any]
    ulysses: Any
    ring: Any
    peer_memory: int  # how Ulysses moves the heads: _PEER_NONE, _PEER_COPIES or _PEER_HALVES;
    # the ring gathers through the peers' memory unless _PEER_NONE

    @property
    def shards_of_any_length(self) -> bool:
        return _shards_of_any_length(self.ulysses, self.ring)

    def record_fields(self) -> tuple[int, ...]:
        b, n_q, h_q, d = self.q.shape
        n_k = self.k.shape[1]
        mask = 0 if self.attn_mask is None else 1 + int(self.attn_mask.shape[-1] == n_k)
        options = _digest(repr(sorted(self.options.items())))
        if self.shards_of_any_length:
            n_q = n_k = 0
        return (b, n_q, n_k, h_q, self.k.shape[2], d, self.v.shape[-1],
                _DTYPES.index(self.q.dtype), int(self.is_causal), mask, options,
                ("HND", "NHD").index(self.tensor_layout), EXCHANGES.index(self.exchange),
                int(self.peer_memory))


@functools.lru_cache(maxsize=64)
def _digest(text: str) -> int:
    """The same number on every rank for the same text (``hash`` of a str differs per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _degree(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _shards_of_any_length(ulysses: Any, ring: Any) -> bool:
    """Ulysses alone or the ring alone: the ranks' token shards may differ in length (each rank
    moves its own; :func:`_agree` gathers the lengths: diffusers' ``ulysses_anything`` and
    ``ring_anything``), so they are not fields every rank must share. Both together: shards of
    one length."""
    return (_degree(ulysses) > 1) != (_degree(ring) > 1)


def _check(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
           is_causal: bool, scale: float | None, enable_gqa: bool, ring: Any, ulysses: Any,
           tensor_layout: str, return_lse: bool, exchange: str, options: dict[str, Any],
           peer_memory: int) -> ParallelCall:
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"context_parallel_attention got unexpected keyword(s) {', '.join(unknown)}; "
                        f"sageattn's options are {', '.join(_OPTION_NAMES)}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}; got {exchange!r}")
    # sageattn's own checks, on the local shard (the call each rank makes before any exchange).
    call = validate(q, k, v, None, dropout_p, is_causal, scale, enable_gqa, tensor_layout,
                    options.get("qk_quant", "auto"), options.get("pv_quant", "auto"),
                    options.get("smooth_k", True), options.get("smooth_q", "auto"),
                    options.get("smooth_v", "auto"), return_lse, options.get("strict", False))
    if call.input_ndim != 4:
        raise ValueError("context_parallel_attention takes 4-D q, k and v")
    if dropout_p > 0:
        raise ValueError("context_parallel_attention does not support dropout_p > 0")
    qn, kn, vn = (t.transpose(1, 2) for t in (call.q, call.k, call.v))  # NHD views
    p_u, p_r = _degree(ulysses), _degree(ring)
    if is_causal and qn.shape[1] != kn.shape[1]:
        raise ValueError("is_causal under context parallelism needs as many query as key tokens "
                         f"per rank; got {qn.shape[1]} and {kn.shape[1]}")
    mask = attn_mask
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.device != qn.device:
            raise ValueError(f"attn_mask must be on query's device ({qn.device}), got {mask.device}")
        if is_causal:
            raise ValueError("attn_mask and is_causal are exclusive")
        mask = _as_4d_key_mask(mask)
        keys_local, keys_all = kn.shape[1], kn.shape[1] * p_u * p_r
        if (mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, qn.shape[0])
                or mask.shape[-1] not in (keys_local, keys_all)):
            raise ValueError(
                "under context parallelism attn_mask must be a key mask, [B, keys] or "
                f"[B, 1, 1, keys], over this rank's {keys_local} keys or all {keys_all}; got "
                f"shape {tuple(attn_mask.shape)}")
        if p_u > 1 and p_r > 1:
            raise ValueError("attn_mask under Ulysses and ring together is not supported")
    return ParallelCall(qn, kn, vn, mask, is_causal, scale, enable_gqa, tensor_layout, return_lse,
                        exchange, dict(options), ulysses if p_u > 1 else None,
                        ring if p_r > 1 else None,
                        peer_memory if p_u > 1 or p_r > 1 else _PEER_NONE)


def _as_4d_key_mask(mask: Tensor | None) -> Tensor | None:
    return mask[:, None, None, :] if mask is not None and mask.dim() == 2 else mask


_checked_kinds: dict[tuple[Any, ...], tuple[dict[str, Any], tuple[int, ...]]] = {}


def _peer_memory_mode() -> int:
    """SAGEATTN_PEER_MEMORY as a mode: "0" NCCL, "copy" every head at once, else the halves."""
    value = os.environ.get(PEER_MEMORY_ENVIRONMENT, "1")
    return {"0": _PEER_NONE, "copy": _PEER_COPIES}.get(value, _PEER_HALVES)


def _checked(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
             is_causal: bool, scale: float | None, enable_gqa: bool, ring: Any, ulysses: Any,
             tensor_layout: str, return_lse: bool, exchange: str,
             options: dict[str, Any]) -> tuple[ParallelCall, tuple[int, ...]]:
    """:func:`_check`'s call and its record's fields. A kind of call checked before is not
    checked again: the kind is all that :func:`_check` reads (the tensors' types, shapes, dtypes
    and devices, not their values, strides or addresses; every other argument with its type, as
    ``1`` is not ``True`` to the validation; the groups; the environment), and checking took
    ~0.11 ms of a Ulysses call's ~0.86 ms of host time (Wan on 2 H200s, session 48). Only
    calls that passed are remembered: a bad one raises each time."""
    peer_memory = _peer_memory_mode()  # (read at every call)
    kind: tuple[Any, ...] | None = None
    if all(type(t) is Tensor for t in (q, k, v)) and (attn_mask is None or type(attn_mask) is Tensor):
        kind = (*((t.shape, t.dtype, t.device) for t in (q, k, v)),
                None if attn_mask is None else (attn_mask.shape, attn_mask.dtype, attn_mask.device),
                *((type(x), x) for x in (dropout_p, is_causal, scale, enable_gqa, tensor_layout,
                                         return_lse, exchange)),
                tuple((name, type(x), x) for name, x in options.items()), ring, ulysses, peer_memory)
        try:
            known = _checked_kinds.get(kind)
        except TypeError:  # (an unhashable option: checked, and not remembered)
            kind = known = None
        if known is not None:
            fields, record_fields = known
            views = (t if tensor_layout == "NHD" else t.transpose(1, 2) for t in (q, k, v))
            return ParallelCall(*views, _as_4d_key_mask(attn_mask), **fields), record_fields
    call = _check(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, ring, ulysses,
                  tensor_layout, return_lse, exchange, options, peer_memory)
    record_fields = call.record_fields()
    if kind is not None:
        fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)
                  if f.name not in ("q", "k", "v", "attn_mask")}
        kept(_checked_kinds, kind, lambda: (fields, record_fields))
    return call, record_fields


# ------------------------------------------------------------------------------------------------
# Ulysses: all-to-all over heads
# ------------------------------------------------------------------------------------------------


def _all_to_all(sends: list[Tensor], shapes: list[tuple[int, ...]],
                group: Any) -> tuple[Tensor, list[Tensor], Any]:
    """Start one all-to-all over ``group`` (NCCL or gloo) sending ``sends[r]`` to rank r and
    receiving from each rank r a tensor of ``shapes[r]``: (the received elements, contiguous in
    rank order; the views of them as ``shapes``; the work, to wait on before reading them). The
    sends are gathered into one buffer by one ``copy_many_`` (on the GPU a launch of 16-byte
    words: the permuting copy of a head slice ran at a quarter of memory bandwidth as PyTorch's
    strided copy, session 39)."""
    x = sends[0]
    counts = [t.numel() for t in sends]
    send = torch.empty(sum(counts), dtype=x.dtype, device=x.device)
    ops.copy_many_([c.view(t.shape) for c, t in zip(send.split(counts), sends)], sends)
    sizes = [math.prod(shape) for shape in shapes]
    received = torch.empty(sum(sizes), dtype=x.dtype, device=x.device)
    work = dist.all_to_all_single(received, send, sizes, counts, group=group, async_op=True)
    return received, [c.view(shape) for c, shape in zip(received.split(sizes), shapes)], work


def _tokens_to_heads(q: Tensor, k: Tensor, v: Tensor, group: Any, memory: PeerMemory | None,
                     layouts: tuple[Any, ...], split: UlyssesSplit) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v ``[B, S, H, D]`` (this rank's tokens, all heads) -> ``[B, N, H_r, D]`` (all
    tokens, this rank's heads), through the peers' memory where there is one (``layouts``:
    :func:`peer_layouts`'). Otherwise all three all-to-alls are started before any is waited
    on: the copy gathering k's and v's sends runs while q's bytes travel."""
    if memory is not None:
        return _peer_exchange.tokens_to_heads(q, k, v, memory, layouts, split)
    me = dist.get_rank(group)
    started = []
    for x, tokens, heads in ((q, split.q_tokens, split.q_heads), (k, split.k_tokens, split.kv_heads),
                             (v, split.k_tokens, split.kv_heads)):
        b, d = x.shape[0], x.shape[3]
        started.append(((b, sum(tokens), heads[me], d), *_all_to_all(
            list(x.split(heads, dim=2)), [(b, s, heads[me], d) for s in tokens], group)))
    for *_, work in started:
        work.wait()
    # (batch 1: the sources' token rows follow each other in the received buffer)
    return tuple(received.view(shape) if shape[0] == 1 else torch.cat(views, dim=1)
                 for shape, received, views, _ in started)  # type: ignore[return-value]


def _heads_to_tokens(x: Tensor, group: Any, memory: PeerMemory | None,
                     split: UlyssesSplit) -> Tensor:
    """``[B, N, H_r, D]`` (all tokens, this rank's heads) -> ``[B, S, H, D]`` (this rank's
    tokens, all heads): the inverse of :func:`_tokens_to_heads`."""
    if memory is not None:
        return _peer_exchange.heads_to_tokens(x, memory, split)
    me = dist.get_rank(group)
    b, d = x.shape[0], x.shape[3]
    _, views, work = _all_to_all(list(x.split(split.q_tokens, dim=1)),
                                 [(b, split.q_tokens[me], h, d) for h in split.q_heads], group)
    work.wait()
    return torch.cat(views, dim=2)


def _lse_heads_to_tokens(lse: Tensor, group: Any, split: UlyssesSplit) -> Tensor:
    """LSE ``[B, H_r, N]`` -> ``[B, H, S]``."""
    me = dist.get_rank(group)
    _, views, work = _all_to_all(list(lse.split(split.q_tokens, dim=2)),
                                 [(lse.shape[0], h, split.q_tokens[me]) for h in split.q_heads], group)
    work.wait()
    return torch.cat(views, dim=1)


def _all_keys_mask(mask: Tensor | None, local_keys: int, group: Any) -> Tensor | None:
    """A key mask over this rank's keys gathered over ``group`` (shards in rank order)."""
    if mask is None or mask.shape[-1] != local_keys:
        return mask
    parts = [torch.empty_like(mask) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mask.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# ------------------------------------------------------------------------------------------------
# Ulysses through the peers' memory (one host): the buffers mapped and agreed on here; the
# exchanges through them in _peer_exchange
# ------------------------------------------------------------------------------------------------

_GRANULE = 2 << 20  # peer buffers grow in 2 MiB steps (the driver maps whole pages anyway)
_peer_memories: dict[tuple[str, int], PeerMemory | None] = {}


def _peer_memory(call: ParallelCall, group: Any, nbytes: int, device: torch.device) -> PeerMemory | None:
    """``group``'s peer buffers (Ulysses' or the ring's), at least ``nbytes`` each, or None where
    NCCL carries the exchange (not CUDA, not NCCL, ``SAGEATTN_PEER_MEMORY=0``, ranks on several
    hosts, or no symmetric memory here). Every rank reaches the same answer: the record agreed on
    the environment variable, and a first allocation is agreed on by one host all-reduce before
    the collective rendezvous."""
    if device.type != "cuda" or not call.peer_memory or dist.get_backend(group) != "nccl":
        return None
    key = (_group_name(group), device.index)
    memory = _peer_memories.get(key, False)
    if memory is None:
        return None
    if memory is not False and memory.buffers[memory.rank].numel() >= nbytes:
        return memory
    if memory is not False:
        # The last call's kernels and copies may still use the old buffer, and a peer's last
        # "done reading" signal (awaited only at the next call) may still be on its way into
        # it: every rank's device finishes, then the old buffer goes.
        torch.cuda.synchronize(device)
        _host_max([0], group)
    _peer_memories[key] = None  # (the old buffer is released before a larger one is mapped)
    _peer_memories[key] = _map_peer_memory(group, ops.round_up(nbytes, _GRANULE), device)
    return _peer_memories[key]


def _map_peer_memory(group: Any, nbytes: int, device: torch.device) -> PeerMemory | None:
    try:
        from torch.distributed import _symmetric_memory as symmetric

        p = dist.get_world_size(group)
        flag_bytes = ops.round_up(FLAG_CHANNELS * p * 4, ALIGN)  # (the signals' flags, after the buffer)
        local: Tensor | None = symmetric.empty(nbytes + flag_bytes, dtype=torch.uint8, device=device)
    except Exception:  # noqa: BLE001 (no symmetric memory in this build or on this device)
        local = None
    host = _digest(socket.gethostname())
    seen = _host_max([-int(local is not None), host, -host], group)
    if seen[0] != -1 or seen[1] != -seen[2]:  # a rank without it, or ranks on several hosts
        return None
    handle = symmetric.rendezvous(local, group)
    ranks = range(dist.get_world_size(group))
    buffers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in ranks]
    flags = [handle.get_buffer(r, (FLAG_CHANNELS, len(ranks)), torch.int32, storage_offset=nbytes // 4)
             for r in ranks]
    me = dist.get_rank(group)
    flags[me].zero_()
    handle.barrier(channel=0)  # (every rank's flags are zero before any peer signals)
    return PeerMemory(me, buffers, lambda channel=0: handle.barrier(channel=channel), (local, handle),
                      flags=flags)


_ulysses_layouts: dict[tuple[Any, ...], tuple[UlyssesSplit, tuple[Any, ...], int]] = {}


def _ulysses_layout(q: Tensor, k: Tensor, v: Tensor, q_tokens: tuple[int, ...],
                    k_tokens: tuple[int, ...]) -> tuple[UlyssesSplit, tuple[Any, ...], int]:
    """The call's :class:`UlyssesSplit` and :func:`peer_layouts`, made at the first call of its
    kind (its shapes, dtype and the ranks' token counts) instead of at every call; at most 64
    kinds are kept."""
    def build() -> tuple[UlyssesSplit, tuple[Any, ...], int]:
        split = UlyssesSplit.of(q_tokens, k_tokens, q.shape[2], k.shape[2])
        return (split, *peer_layouts(q, k, v, split))

    return kept(_ulysses_layouts, (q.shape, k.shape, v.shape, q.dtype, q_tokens, k_tokens), build)


# ------------------------------------------------------------------------------------------------
# Which Ulysses calls go in two halves of the heads (_peer_exchange.ulysses_in_halves)
# ------------------------------------------------------------------------------------------------

# A Ulysses call takes the halves from this much work (4 B Nq Nk H D of the first rank's share):
# ~1 ms of the Hopper kernel, against the ~0.5 ms more host time of the halves' launches (session
# 51); the GPU runs ahead of the host only where its work is the longer.
_HALVES_MIN_WORK = 1e12
_halves_kinds: dict[tuple[Any, ...], Halves | None] = {}


def _halves(call: ParallelCall, q: Tensor, k: Tensor, v: Tensor,
            split: UlyssesSplit) -> Halves | None:
    """The call's :class:`Halves`, made once per kind, or None where Ulysses moves every head
    at once: ``SAGEATTN_PEER_MEMORY=copy``, a mask, a rank with one key head, a call that the
    Hopper kernel does not serve or that is too short to gain (``_HALVES_MIN_WORK``), the CPU."""
    if (call.peer_memory != _PEER_HALVES or q.device.type != "cuda" or call.attn_mask is not None
            or min(split.kv_heads) < 2):
        return None
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, split, call.is_causal, call.scale,
           call.enable_gqa, call.return_lse, tuple(sorted(call.options.items())))
    try:
        hash(key)
    except TypeError:  # (an unhashable option)
        return None
    return kept(_halves_kinds, key, lambda: _plan_halves(call, q, k, v, split))


def _plan_halves(call: ParallelCall, q: Tensor, k: Tensor, v: Tensor,
                 split: UlyssesSplit) -> Halves | None:
    """:func:`_halves`' decision at a kind's first call: the plan of the first rank's share."""
    b, d, dv = q.shape[0], q.shape[3], v.shape[3]
    nq, nk = sum(split.q_tokens), sum(split.k_tokens)
    # The plan reads shapes, dtypes and the device only: views of the first rank's received
    # shapes over this rank's tensors (stride 0) stand in for them.
    first = [t.as_strided(shape, (0, 0, 0, 1)) for t, shape in (
        (q, (b, nq, split.q_heads[0], d)), (k, (b, nk, split.kv_heads[0], d)),
        (v, (b, nk, split.kv_heads[0], dv)))]
    options = call.options
    shard_call = validate(*first, None, 0.0, call.is_causal, call.scale, call.enable_gqa, "NHD",
                          options.get("qk_quant", "auto"), options.get("pv_quant", "auto"),
                          options.get("smooth_k", True), options.get("smooth_q", "auto"),
                          options.get("smooth_v", "auto"), call.return_lse,
                          options.get("strict", False))
    decision = _execute.decide(shard_call)
    if (not decision.quantized or decision.choice.kernel != "wgmma" or shard_call.bottom_right
            or 4 * b * nq * nk * split.q_heads[0] * d < _HALVES_MIN_WORK):
        return None
    return Halves.of(q, k, v, split, _execute.KernelCall.of(shard_call, decision.choice))


# ------------------------------------------------------------------------------------------------
# Ring: every rank's K and V to every rank, once
# ------------------------------------------------------------------------------------------------


class _Packed(NamedTuple):
    """Tensors laid out in one byte buffer (each part 256-byte aligned)."""

    buffer: Tensor                              # uint8 [total]
    layout: list[tuple[int, torch.dtype, tuple[int, ...]] | None]   # offset, dtype, shape

    @staticmethod
    def layout_of(parts: list[Tensor | None]) -> tuple[list[tuple[int, torch.dtype, tuple[int, ...]] | None], int]:
        """Where each part lands, and the bytes of them all."""
        layout: list[tuple[int, torch.dtype, tuple[int, ...]] | None] = []
        total = 0
        for t in parts:
            if t is None:
                layout.append(None)
                continue
            layout.append((total, t.dtype, tuple(t.shape)))
            total += ops.round_up(t.numel() * t.element_size(), ALIGN)
        return layout, total

    def filled(self, parts: list[Tensor | None]) -> _Packed:
        """This packing with ``parts`` (those :meth:`layout_of` laid out) copied into its buffer."""
        for t, where in zip(parts, self.layout):
            if t is not None and where is not None:
                bytes_as(self.buffer, where[0], where[2], where[1]).copy_(t)
        return self

    def unpack(self, row: Tensor) -> list[Tensor | None]:
        """The parts, as views of ``row`` (a buffer of this layout)."""
        out: list[Tensor | None] = []
        for where in self.layout:
            if where is None:
                out.append(None)
                continue
            offset, dtype, shape = where
            out.append(bytes_as(row, offset, shape, dtype))
        return out


class _QuantizedShard(NamedTuple):
    """One rank's K and V as the Hopper kernel reads them (ops.sageattn_wgmma_chain's operands)."""

    k_codes: Tensor
    k_scale: Tensor
    v: Tensor                 # FP8 codes, or (the accurate tier) the 16-bit V [B, H, N, D]
    v_tile_scale: Tensor | None
    v_mean: Tensor | None
    k_mean: Tensor | None


def _quantize_shard(kernel: _execute.KernelCall, k: Tensor, v: Tensor) -> _QuantizedShard:
    """K and V of one shard (``[B, H, N, D]`` views) quantized as ``ops.sageattn_wgmma_chain``
    quantizes them for ``kernel`` (its smoothing sample, tile size and PV)."""
    k, v = (_execute.kernel_input(t, kernel.padded_head_dim) for t in (k, v))
    fp8 = kernel.choice.pv == "fp8"
    smooth_v = kernel.smooth_v and fp8
    k_mean = v_mean = None
    if kernel.smooth_k or smooth_v:
        sample = slice(None, None, kernel.sample_stride)
        stats = ops.smoothing_stats(None, k[:, :, sample] if kernel.smooth_k else None,
                                    v[:, :, sample] if smooth_v else None, smooth_v)
        k_mean = stats.k_mean if kernel.smooth_k else None
        v_mean = stats.v_mean if smooth_v else None
    kv = ops.quantize_kv(k, v if fp8 else None, k_mean, v_mean, None, None, ops.WGMMA_BLOCK_K,
                         "int8", 1.0)
    return _QuantizedShard(kv.k_quant, kv.k_scale, kv.v_fp8 if fp8 else v.contiguous(),
                           kv.v_tile_scale if fp8 else None, v_mean, k_mean)


def _attend_quantized(kernel: _execute.KernelCall, q: Tensor, shard: _QuantizedShard, kv_len: int,
                      is_causal: bool) -> tuple[Tensor, Tensor]:
    """``q`` (``[B, H, N, D]`` view) over one quantized shard: out ``[B, H, N, D]`` (NHD memory
    where the kernel call writes it so) and the float32 LSE."""
    out_nhd = kernel.out_nhd or _execute.heads_inner(q)
    q = _execute.kernel_input(q, kernel.padded_head_dim)
    out, lse = ops.attention_wgmma(q, shard.k_codes, shard.k_scale, shard.v, shard.v_tile_scale,
                                   shard.v_mean, shard.k_mean, kv_len, kernel.sm_scale, is_causal,
                                   out_nhd, True)
    if kernel.padded_head_dim != kernel.head_dim:
        out = _execute._unpad_head_dim(out, kernel.head_dim, out_nhd)
    return out, lse


def _seen_rows_only(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """A part that ran with a key mask (``out [B, H, N, D]``, ``lse [B, H, N]``), its rows that
    see none of its keys set to what merging by LSE expects: LSE -inf, output 0 (whatever an SDPA
    backend wrote there: NaN on some)."""
    unseen = torch.isneginf(lse) | torch.isnan(lse)
    return out.masked_fill(unseen[..., None], 0), lse.masked_fill(unseen, -math.inf)


def _ring_plan(call: ParallelCall, q: Tensor, k: Tensor, v: Tensor,
               even: bool) -> _execute.KernelCall | None:
    """The Hopper kernel call that serves every shard of this ring, or None where the shards
    travel in 16 bits and each runs as sageattn (a mask, another kernel, an exact path, shards
    of different lengths, or ``exchange="input"``)."""
    if not even and call.exchange == "quantized":
        raise NotImplementedError("exchange='quantized' needs the ring's shards of one length (the "
                                  "codes of every shard are gathered in one layout); use 'auto'")
    if call.exchange == "input" or call.attn_mask is not None or not even:
        return None
    shard_call: AttentionCall = validate(
        q, k, v, None, 0.0, call.is_causal, call.scale, call.enable_gqa, "NHD",
        call.options.get("qk_quant", "auto"), call.options.get("pv_quant", "auto"),
        call.options.get("smooth_k", True), call.options.get("smooth_q", "auto"),
        call.options.get("smooth_v", "auto"), True, call.options.get("strict", False))
    decision = _execute.decide(shard_call)
    if not decision.quantized or decision.choice.kernel != "wgmma" or shard_call.bottom_right:
        if call.exchange == "quantized":
            why = decision.fallback or decision.faster_exact or f"the {decision.choice.kernel} kernel"
            raise NotImplementedError(f"exchange='quantized' needs the Hopper kernel for each shard; "
                                      f"here: {why}")
        return None
    return _execute.KernelCall.of(shard_call, decision.choice)


def _shard_causality(is_causal: bool, owner: int, rank: int) -> bool | None:
    """How this rank's queries attend the keys of ``owner``'s shard: all of them (False), under
    the causal mask (True: its own shard, query i of the shard seeing keys up to i), or not at
    all (None: a later shard's keys come after every query here)."""
    if not is_causal:
        return False
    return None if owner > rank else owner == rank


def _ring(call: ParallelCall, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
          group: Any, k_tokens: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Ring attention of NHD ``q`` over every rank's ``k`` and ``v`` (``k_tokens``: every rank's
    key count): (out ``[B, N, H, D]`` in q's dtype, lse ``[B, H, N]`` float32). Shards of
    different lengths travel in the input dtype, each padded to the longest (one all-gather
    takes one size), and attend only their own keys."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    kernel = _ring_plan(call, q, k, v, len(set(k_tokens)) == 1)
    local_keys = k.shape[1]
    if kernel is not None:
        kb, vb = k.transpose(1, 2), v.transpose(1, 2)
        local: list[Tensor | None] = list(_quantize_shard(kernel, kb, vb))
    else:
        pad = max(k_tokens) - local_keys
        local = [torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t.contiguous()
                 for t in (k, v)]
    global _last_ring_bytes
    layout, _last_ring_bytes = _Packed.layout_of(local)
    memory = _peer_memory(call, group, p * _last_ring_bytes, q.device)
    if memory is not None:  # (one host: by the copy engines, no SM, into the peers' memory)
        received = gathered_rows(memory, _last_ring_bytes)
        packed = _Packed(received[rank], layout).filled(local)
        start_all_gather(memory, _last_ring_bytes)
    else:
        buffer = torch.empty(_last_ring_bytes, dtype=torch.uint8, device=q.device)
        packed = _Packed(buffer, layout).filled(local)
        received = torch.empty(p * _last_ring_bytes, dtype=torch.uint8, device=q.device)
        work = dist.all_gather_into_tensor(received, packed.buffer, group=group, async_op=True)
        received = received.view(p, -1)
    if mask is not None and mask.shape[-1] == local_keys and p > 1:
        mask = _all_keys_mask(mask, local_keys, group)

    def attend(shard: list[Tensor | None], owner: int) -> tuple[Tensor, Tensor] | None:
        """q over ``owner``'s keys: (out ``[B, H, N, D]``, lse), or None where it sees none."""
        causal = _shard_causality(call.is_causal, owner, rank)
        if causal is None:
            return None
        if kernel is not None:
            return _attend_quantized(kernel, q.transpose(1, 2), _QuantizedShard(*shard), local_keys,
                                     causal)
        keys = slice(owner * local_keys, (owner + 1) * local_keys)  # (a mask: shards of one length)
        shard_mask = None if mask is None else mask[..., keys]
        k_owner, v_owner = (t[:, :k_tokens[owner]] for t in shard)  # type: ignore[index]
        out, lse = sageattn(q, k_owner, v_owner, shard_mask, 0.0, causal, call.scale,
                            call.enable_gqa, tensor_layout="NHD", return_lse=True, **call.options)
        out = out.transpose(1, 2)
        return _seen_rows_only(out, lse) if mask is not None else (out, lse)

    # Every part is kept and merged once at the end, in one pass (_execute.merge_parts).
    parts = [attend(local, rank)]
    if memory is None:
        work.wait()
    for step in range(1, p):
        owner = (rank + step) % p
        if memory is not None:
            wait_for_row(memory, owner)  # (each owner's row as it lands: no wait for the last)
        parts.append(attend(packed.unpack(received[owner]), owner))
    if memory is not None:
        end_all_gather(memory)
    seen = [part for part in parts if part is not None]
    assert seen  # the local shard always contributes
    out, lse = _execute.merge_parts([o for o, _ in seen], [l for _, l in seen], True)
    return out.transpose(1, 2), lse


def last_ring_bytes() -> int:
    """The bytes this rank sent in its last ring exchange (its K and V shard as they travelled:
    codes, scales and means, or the 16-bit tensors; each part padded to 256 bytes)."""
    return _last_ring_bytes


# ------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------


# Under torch.compile the call is one opaque eager step: traced, Dynamo would specialise on the
# peers' memory's signal counts (a recompile at every call, then eager past the recompile limit),
# trace the agreement's sockets piecewise, and fuse the merge differently from the eager call
# (the ring's output moved by ~1e-7); the kernel inside is one op either way.
@torch.compiler.disable
def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    ring_group: Any = None,
    ulysses_group: Any = None,
    tensor_layout: str = "NHD",
    return_lse: bool = False,
    exchange: str = "auto",
    **options: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`sageattn` over a sequence whose tokens are split across the ranks of
    ``ulysses_group`` and ``ring_group`` (either may be None or of one rank).

    Args:
        query, key, value: this rank's token shard, ``[B, N, H, D]`` (``tensor_layout="NHD"``,
            the default) or ``[B, H, N, D]``; every rank the same shapes, shards in rank order
            (ulysses rank fastest where both groups are given), except that under Ulysses alone
            or the ring alone the shards may differ in length (Ulysses: and any number of heads,
            each rank attending its share).
        attn_mask: None or a key mask (bool, True = attend, or additive), ``[B, keys]`` or
            ``[B, 1, 1, keys]``, over this rank's keys or over all of them (shards of one
            length).
        is_causal: queries see the keys up to their own global position (as many query as key
            tokens per rank).
        scale, enable_gqa: as :func:`sageattn`.
        ring_group, ulysses_group: ``torch.distributed`` process groups.
        return_lse: also return the natural-log LSE, float32 ``[B, H, N]`` (this rank's queries).
        exchange: how K and V travel in the ring: ``"quantized"`` (the Hopper kernel's codes,
            about half of bf16's bytes; an error where that kernel does not serve the call or
            the shards differ in length),
            ``"input"`` (in the input dtype), or ``"auto"`` (quantized where it can be).
        options: sageattn's ``qk_quant``, ``pv_quant``, ``smooth_k``, ``smooth_q``, ``smooth_v``,
            ``strict``.

    Returns:
        This rank's output shard in the input layout (and the LSE with ``return_lse``).
    """
    groups = [g for g in (ulysses_group, ring_group) if _degree(g) > 1]
    try:
        call, fields = _checked(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa, ring_group, ulysses_group, tensor_layout, return_lse,
                                exchange, options)
        record = CallRecord(fields, -1, "")
    except (TypeError, ValueError, NotImplementedError) as error:
        if not groups:
            raise
        record = CallRecord((), dist.get_rank(), f"{type(error).__name__}: {error}")
        _agree(record, groups, (0, 0) if _shards_of_any_length(ulysses_group, ring_group) else ())
        raise  # (not reached: _agree raised the same error)
    q, k, v, mask = call.q, call.k, call.v, call.attn_mask
    shards = _agree(record, groups, (q.shape[1], k.shape[1]) if call.shards_of_any_length else ())
    if not groups:
        return sageattn(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        tensor_layout=tensor_layout, return_lse=return_lse, **options)
    # Every rank's query and key tokens in the first group (where they may differ: the same on
    # every rank of a group anyway).
    p = _degree(groups[0])
    q_tokens, k_tokens = (tuple(zip(*shards)) if call.shards_of_any_length
                          else ((q.shape[1],) * p, (k.shape[1],) * p))
    if mask is not None and (len(set(q_tokens)) > 1 or len(set(k_tokens)) > 1):
        # (on every rank: whether there is a mask is an agreed field)
        raise ValueError("context_parallel_attention: attn_mask needs shards of equal length; "
                         f"got query tokens {list(q_tokens)} and key tokens {list(k_tokens)} over "
                         "the ranks")
    memory = split = None
    if call.ulysses is not None:
        split, layouts, nbytes = _ulysses_layout(q, k, v, q_tokens, k_tokens)
        mask = _all_keys_mask(mask, k.shape[1], call.ulysses)
        halves = _halves(call, q, k, v, split) if call.ring is None else None
        memory = _peer_memory(call, call.ulysses, max(nbytes, 0 if halves is None else halves.nbytes),
                              q.device)
        if halves is not None and memory is not None:
            out, lse = ulysses_in_halves(q, k, v, memory, halves, split, return_lse)
            if lse is not None:
                lse = _lse_heads_to_tokens(lse.contiguous(), call.ulysses, split)
            return _in_layout(out, lse, tensor_layout, return_lse)
        q, k, v = _tokens_to_heads(q, k, v, call.ulysses, memory, layouts, split)
    if call.ring is not None:
        out, lse = _ring(call, q, k, v, mask, call.ring,
                         k_tokens if call.ulysses is None else (k.shape[1],) * _degree(call.ring))
    else:  # Ulysses alone: the one-GPU call on this rank's heads
        result = sageattn(q, k, v, mask, 0.0, call.is_causal, call.scale, call.enable_gqa,
                          tensor_layout="NHD", return_lse=return_lse, **call.options)
        out, lse = result if return_lse else (result, None)
    if split is not None:
        out = _heads_to_tokens(out, call.ulysses, memory, split)
        if lse is not None:
            lse = _lse_heads_to_tokens(lse.contiguous(), call.ulysses, split)
    return _in_layout(out, lse, tensor_layout, return_lse)


def _in_layout(out: Tensor, lse: Tensor | None, tensor_layout: str,
               return_lse: bool) -> Tensor | tuple[Tensor, Tensor]:
    """An NHD output (and the LSE) as :func:`context_parallel_attention` returns them."""
    if tensor_layout == "HND":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out  # type: ignore[return-value]
