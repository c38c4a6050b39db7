"""``python -m sageattention2 bench --models KEY... --gpus N``: diffusers models under context
parallelism on N GPUs of this host, diffusers' native backends against ours, in one run.

    python -m sageattention2 bench --models wan flux2k --gpus 2 [--reps 5] [--out DIR]

Starts N processes (one per GPU, NCCL; torchrun is not needed). Per model, rank 0 first runs the
whole model alone: PyTorch's default SDPA and our backend (``"sageattention2"``). Then every
context-parallel mode the GPU count allows (Ulysses over all N, the ring over all N, and for
N = 4 ring 2 x Ulysses 2), each with diffusers' native backends that support it (``native``:
Ulysses only, it has no LSE for the ring; ``_native_cudnn``) and ours (``exchange="quantized"``
and ``"input"`` in the ring), and the authors' package through diffusers' ``sage`` backend where
it is installed (``authors_version``; in the ring on inputs of their own storage,
``inputs_on_their_own_storage``), each on a fresh model with the same weights. Reported per
row: the median forward (ms, every rank starting together, the slowest rank's time), the
speedup over the best native row of that model, the scaling over our one-GPU forward, the bytes
each rank sends per ring call (ours), and the output's relative L1 distance to our one-GPU
output; with the authors' rows, a line comparing our best with theirs. Writes ``parallel.md``
(the table) and ``parallel.png`` (every context-parallel row's speedup over its model's best
native row; with matplotlib, the [models] extra) to --out.
"""
from __future__ import annotations

import contextlib
import os
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from . import _bench_models, _model_suite
from .testing import relative_l1

# Models with a diffusers context-parallel plan, at the sizes people run them on several GPUs.
CASES = ("wan", "wan14b", "flux2k")


def _modes(gpus: int) -> list[tuple[str, int, int]]:
    """(name, ring degree, ulysses degree)."""
    modes = [("ulysses", 1, gpus), ("ring", gpus, 1)]
    if gpus == 4:
        modes.append(("ring2 x ulysses2", 2, 2))
    return modes


AUTHORS = "sageattention (authors')"


def authors_version() -> str | None:
    """The version of the authors' SageAttention package (``sageattention``) where it is installed
    and is not this project's drop-in (compat/, version ``...+sageattention2``): diffusers' own
    ``sage`` backend, which supports context parallelism, then runs the authors' kernels, what
    users run under CP today (issue 53's comparison). ``scripts/device_check.sh --authors``
    builds it on the GPU machine."""
    from importlib import metadata

    try:
        version = metadata.version("sageattention")
    except metadata.PackageNotFoundError:
        return None
    return None if "sageattention2" in version else version


def _backends(ring: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(row label, diffusers backend name, register() options)."""
    rows = [("cudnn (native)", "_native_cudnn", {})]
    if ring == 1:
        rows.insert(0, ("SDPA (native)", "native", {}))
        rows.append(("sageattention2", "sageattention2", {}))
    else:
        rows += [("sageattention2, K/V quantized", "sageattention2", {"exchange": "quantized"}),
                 ("sageattention2, K/V bf16", "sageattention2", {"exchange": "input"})]
    if authors_version():
        rows.append((AUTHORS, "sage", {}))
    return rows


@contextlib.contextmanager
def inputs_on_their_own_storage(module: Any) -> Iterator[None]:
    """While active, ``module.sageattn`` (diffusers' handle on the authors' kernel) gets every
    tensor argument that is a view at a storage offset as a clone. Under diffusers' ring, K and V
    of the later steps are such views of the all-gathered buffer, and the authors' kernel reads
    outside them: an illegal memory access that kills the process (Flux at 2048 px on 2 H200s,
    diffusers 0.42.1, session 54; diffusers issue 13506). With the clones, the fix diffusers'
    pull request 13507 proposes, their ring runs; the clones' time counts as theirs."""
    real = module.sageattn

    def on_own_storage(*args: Any, **kwargs: Any) -> Any:
        def own(x: Any) -> Any:
            return x.clone() if isinstance(x, torch.Tensor) and x.storage_offset() else x
        return real(*map(own, args), **{name: own(x) for name, x in kwargs.items()})

    module.sageattn = on_own_storage
    try:
        yield
    finally:
        module.sageattn = real


def versus_authors(rows: list[tuple[Any, ...]]) -> str | None:
    """Our best context-parallel row against the authors' best (rows: (model, GPUs, mode,
    label, ms, ...)), or None without the authors' rows."""
    ours = [r[4] for r in rows if r[3].startswith("sageattention2") and r[4] == r[4]]
    theirs = [r[4] for r in rows if r[3] == AUTHORS and r[4] == r[4]]
    if not ours or not theirs:
        return None
    return (f"{rows[0][0]}, {rows[0][1]} GPUs: our best {min(ours):.1f} ms, the authors' best "
            f"{min(theirs):.1f} ms: {min(theirs) / min(ours):.2f}x")


Row = tuple[str, int, str, str, float, str, torch.Tensor]  # model, GPUs, mode, backend, ms, bytes, out


def report(key: str, single: dict[str, tuple[float, torch.Tensor]],
           rows: list[Row]) -> tuple[list[str], list[dict[str, Any]]]:
    """One model's table lines (its one-GPU rows, then every context-parallel row, then how our
    best compares with the authors' where they ran) and its chart bars: each context-parallel
    row's speedup over the model's best native row (rows that could not run have none)."""
    ours_ms, ours_out = single["sageattention2"]
    native = [r[4] for r in rows if "native" in r[3] and r[4] == r[4]]
    best = min(native) if native else float("nan")
    lines, bars = [], []
    for name, (ms, out) in single.items():
        lines.append(f"| {key} | 1 | - | {name} | {ms:.1f} | - | - | - | "
                     f"{relative_l1(out, ours_out):.4f} |")
    for _, n, mode, label, ms, sent, out in rows:
        error = f"{relative_l1(out, ours_out):.4f}" if out.numel() else "-"
        lines.append(f"| {key} | {n} | {mode} | {label} | {ms:.1f} | {best / ms:.2f}x | "
                     f"{ours_ms / ms:.2f}x | {sent if sent != '0' else '-'} | {error} |")
        if ms == ms and best == best:
            bars.append({"model": f"{key}, {n} GPUs, {mode}: {label}", "speedup": best / ms})
    authors = versus_authors(rows)
    if authors:
        lines.append(f"| {authors} |" + " |" * 8)
    return lines, bars


def _forward_ms(model: torch.nn.Module, inputs: dict[str, Any], reps: int,
                group: Any) -> tuple[float, torch.Tensor]:
    """Median forward over ``reps`` (after one warm-up), every rank of ``group`` starting each
    forward together; the slowest rank's time."""
    times = []
    with torch.no_grad():
        out = model(**inputs)[0]
        for _ in range(reps):
            if group is not None:
                dist.barrier(group=group)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = model(**inputs)[0]
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    ms = torch.tensor([statistics.median(times)], device=out.device)
    if group is not None:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms), out


def _worker(rank: int, gpus: int, port: str, keys: list[str], reps: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=gpus, device_id=torch.device("cuda", rank))
    from diffusers import ContextParallelConfig
    from diffusers.models import attention_dispatch

    from .integrations import diffusers as sage_diffusers
    from . import parallel

    device = torch.device("cuda", rank)
    builders: dict[str, Callable[..., Any]] = {
        c.key: c.build for c in (*_model_suite.CASES, *_model_suite.PARALLEL_CASES)}
    lines = ["| model | GPUs | mode | backend | forward ms | vs best native | scaling vs our 1 GPU | "
             "bytes sent per ring call | rel. L1 vs our 1 GPU |", "|---|---|---|---|---|---|---|---|---|"]
    bars: list[dict[str, Any]] = []
    for key in keys:
        def fresh() -> tuple[torch.nn.Module, dict[str, Any]]:
            torch.manual_seed(0)
            model, inputs = builders[key](device, torch.bfloat16, False)
            return model, dict(inputs, return_dict=False)  # what the plans' output hooks take

        rows: list[Row] = []
        single: dict[str, tuple[float, torch.Tensor]] = {}
        if rank == 0:
            model, inputs = fresh()
            model.set_attention_backend("native")  # (not the process's active backend: ours, later)
            single["SDPA (default)"] = _forward_ms(model, inputs, reps, None)
            sage_diffusers.register()
            model.set_attention_backend("sageattention2")
            single["sageattention2"] = _forward_ms(model, inputs, reps, None)
            if authors_version():
                model.set_attention_backend("sage")
                single[AUTHORS] = _forward_ms(model, inputs, reps, None)
            del model
            torch.cuda.empty_cache()
        dist.barrier()
        traffic: dict[str, int] = {}
        for mode, ring, ulysses in _modes(gpus):
            for label, backend, options in _backends(ring):
                model, inputs = fresh()
                if backend == "sageattention2":
                    sage_diffusers.register(**options)
                model.set_attention_backend(backend)
                model.enable_parallelism(config=ContextParallelConfig(ring_degree=ring,
                                                                      ulysses_degree=ulysses))
                authors_ring = backend == "sage" and ring > 1 and hasattr(attention_dispatch, "sageattn")
                try:
                    with (inputs_on_their_own_storage(attention_dispatch) if authors_ring
                          else contextlib.nullcontext()):
                        ms, out = _forward_ms(model, inputs, reps, dist.group.WORLD)
                    if backend == "sageattention2" and ring > 1:
                        traffic[label] = parallel.last_ring_bytes()
                except Exception as error:  # noqa: BLE001 (a backend that cannot run this mode)
                    ms, out = float("nan"), torch.empty(0)
                    if rank == 0:
                        print(f"{key} {mode} {label}: {type(error).__name__}: {error}"[:300],
                              file=sys.stderr)
                rows.append((key, gpus, mode, label, ms, f"{traffic.get(label, 0)}", out))
                del model
                torch.cuda.empty_cache()
        if rank == 0:
            model_lines, model_bars = report(key, single, rows)
            lines += model_lines
            bars += model_bars
            print("\n".join(model_lines), flush=True)
        dist.barrier()
    if rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "parallel.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        title = (f"Context parallelism, {gpus} x {torch.cuda.get_device_name(device)} "
                 f"(torch {torch.__version__})")
        if bars and _bench_models.chart(bars, Path(out_dir) / "parallel.png", title,
                                        "forward speedup over diffusers' best native CP row"):
            print(f"wrote {Path(out_dir) / 'parallel.png'}")
    dist.destroy_process_group()


def run(keys: list[str], gpus: int, reps: int, out: Path | None) -> None:
    unknown = sorted(set(keys) - set(CASES))
    if unknown:
        raise ValueError(f"bench --gpus: unknown model(s) {', '.join(unknown)}; "
                         f"context parallelism runs {', '.join(CASES)}")
    if torch.cuda.device_count() < gpus:
        raise RuntimeError(f"bench --gpus {gpus}: this machine has {torch.cuda.device_count()} GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    torch.multiprocessing.spawn(_worker, args=(gpus, port, keys, reps, str(out or ".")), nprocs=gpus)
