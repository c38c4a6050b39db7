"""``python -m sageattention2 bench --models``: whole-model forwards under PyTorch's default SDPA
and under sageattn (``patch_sdpa``), side by side in one process: the model suite
(``_model_suite``).

    python -m sageattention2 bench --models [KEY ...] [--reps 10] [--out DIR]
    python -m sageattention2 bench --models --tiny --device cpu   (every call site, in seconds)

Per model: the median forward time under each (the two alternate, forward by forward, so drift
cancels), the speedup, the attention share of the default forward (every SDPA call of one forward
replayed alone, timed, summed, over the forward's time), the attention calls per forward and how
many ran the quantized kernels, and the cosine similarity of the model's output to the default
one. Writes ``models.md`` (the table) and ``models.png`` (a chart) to --out. Needs diffusers,
transformers, matplotlib and tqdm: ``pip install "sageattention2[models]"``.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from . import __version__, _model_suite
from ._timing import queued_ms
from .api import explain
from .integrations import patch_sdpa
from .testing import cosine_similarity


def progress(total: int, desc: str) -> Any:
    """A tqdm bar when tqdm is installed (the [models] extra), else one line per step."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        class Plain:
            def update(self, n: int = 1) -> None:
                pass

            def set_postfix_str(self, s: str) -> None:
                print(f"  {desc}: {s}", file=sys.stderr, flush=True)

            def close(self) -> None:
                pass
        return Plain()


def first_tensor(output: Any) -> torch.Tensor:
    """The model's main output: ``sample`` of diffusers, ``last_hidden_state`` of transformers
    (both are item 0 of their output classes)."""
    return output if isinstance(output, torch.Tensor) else output[0]


@contextlib.contextmanager
def recording_sdpa(calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Iterator[None]:
    """Records every F.scaled_dot_product_attention call (its arguments) while running it."""
    real = F.scaled_dot_product_attention

    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = record
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two SDPA calls cost the same: tensor shapes, strides and dtypes, the rest."""
    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
        return x
    return tuple(map(describe, args)) + tuple(sorted((k, describe(v)) for k, v in kwargs.items()))


def routed_quantized(calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> int:
    """How many of the recorded calls sageattn serves with a quantized kernel (``explain``)."""
    return sum(1 for args, kwargs in calls if explain(*args, **kwargs).quantized)


class Clock:
    """Wall time of a callable: CUDA events around it on a GPU (synchronized, so host-bound
    forwards count their host time), perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def ms(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        return queued_ms(fn)


def attention_ms(calls: list[tuple[tuple[Any, ...], dict[str, Any]]], clock: Clock, reps: int) -> float:
    """The time of the recorded SDPA calls, each replayed alone: calls of one signature are timed
    once (the median of ``reps`` runs) and counted as often as they occur."""
    groups: dict[tuple[Any, ...], tuple[tuple[Any, ...], dict[str, Any], int]] = {}
    for args, kwargs in calls:
        key = signature(args, kwargs)
        first = groups.get(key)
        groups[key] = (args, kwargs, 1 if first is None else first[2] + 1)
    total = 0.0
    for args, kwargs, count in groups.values():
        run = lambda: F.scaled_dot_product_attention(*args, **kwargs)  # noqa: E731
        run()
        total += statistics.median(clock.ms(run) for _ in range(reps)) * count
    return total


MAX_REPS = 400


def measure(case: _model_suite.ModelCase, device: torch.device, tiny: bool, reps: int,
            seconds: float = 0.0) -> dict[str, Any]:
    """One row. ``reps`` timed forwards per mode at least, more where a forward is short, up to
    ``seconds`` of timing per mode (a host-bound 5-25 ms forward moves by several percent
    between medians of 6)."""
    dtype = case.dtype if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model, inputs = case.build(device, dtype, tiny)
    clock = Clock(device)

    def forward() -> Any:
        return model(**inputs)

    with torch.inference_mode():
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        with recording_sdpa(calls):
            want = first_tensor(forward())
        with patch_sdpa():
            got = first_tensor(forward())  # also the warm-up of sageattn's path
        forward()
        default_ms, sage_ms = [], []
        runs = reps
        while len(default_ms) < runs:
            # Alternate, so that drift hits both alike, and swap which goes first every other
            # time: a host-bound forward's time depends on what ran just before it.
            for sage in ((False, True) if len(default_ms) % 2 == 0 else (True, False)):
                if sage:
                    with patch_sdpa():
                        sage_ms.append(clock.ms(forward))
                else:
                    default_ms.append(clock.ms(forward))
            if len(default_ms) == 1 and seconds > 0 and not tiny:
                runs = min(MAX_REPS, max(reps, math.ceil(seconds * 1e3 / max(default_ms[0], 1e-3))))
        attention = attention_ms(calls, clock, reps)
        quantized = routed_quantized(calls)
    row = dict(model=case.name, default_ms=statistics.median(default_ms), sage_ms=statistics.median(sage_ms),
               calls=len(calls), quantized=quantized, cosine=cosine_similarity(got, want), reps=len(default_ms))
    row["speedup"] = row["default_ms"] / row["sage_ms"]
    row["attention_share"] = attention / row["default_ms"]
    return row


def pyplot() -> Any:
    """matplotlib.pyplot on the file backend, or None without matplotlib (the [models] extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Speedup per model as horizontal bars, the 1.0 line marked. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    names = [r["model"] for r in rows][::-1]
    speedups = [r["speedup"] for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    colors = ["#2a9d8f" if s >= 1.0 else "#e76f51" for s in speedups]
    ax.barh(names, speedups, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(0, max(speedups) * 1.15)
    for y, s in enumerate(speedups):
        ax.text(s + 0.01, y, f"{s:.2f}x", va="center", fontsize=8)
    ax.set_xlabel("whole-forward speedup over default SDPA")
    ax.set_title(title, fontsize=8, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]], title: str) -> str:
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def run(keys: Sequence[str] | None, device: torch.device, tiny: bool, reps: int,
        out: Path | None, seconds: float = 0.0) -> list[dict[str, Any]]:
    """Measure the cases named by ``keys`` (all when None or empty), print the table (and the
    geometric-mean speedup), write models.md and models.png to ``out``; return the rows."""
    cases = [c for c in _model_suite.CASES if not keys or c.key in keys]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    title = f"Whole forward ({gpu}, torch {torch.__version__}, sageattention2 {__version__})"
    rows, bar = [], progress(len(cases), "models")
    for case in cases:
        bar.set_postfix_str(case.key)
        rows.append(measure(case, device, tiny, reps, seconds))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last model's weights and activations are garbage now
        bar.update()
    bar.close()
    geomean = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows))
    table = markdown_table(
        ["model", "default SDPA ms", "sageattn ms", "speedup", "attention share",
         "attention calls", "quantized", "output cosine", "forwards timed"],
        [(r["model"], f"{r['default_ms']:.2f}", f"{r['sage_ms']:.2f}", f"{r['speedup']:.3f}x",
          f"{100 * r['attention_share']:.0f} %", r["calls"], r["quantized"], f"{r['cosine']:.5f}",
          r["reps"])
         for r in rows], title)
    table += f"\n\ngeomean speedup {geomean:.3f}x over {len(rows)} models"
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "models.md").write_text(table + "\n")
        if chart(rows, out / "models.png", title):
            print(f"wrote {out / 'models.md'} and {out / 'models.png'}")
    return rows
