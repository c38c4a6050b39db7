"""``python -m sageattention2 bench --models``: whole-model forwards (or, with ``--train``,
training steps) under PyTorch's default SDPA and under sageattn (``patch_sdpa``), side by side in
one process: the model suite (``_model_suite``).

    python -m sageattention2 bench --models [KEY ...] [--train] [--reps 10] [--out DIR]
    python -m sageattention2 bench --models --tiny --device cpu   (every call site, in seconds)

Per model: the median forward time under each (the two alternate, forward by forward, so drift
cancels), the speedup, the attention share of the default forward (every SDPA call of one forward
replayed alone, timed, summed, over the forward's time), the attention calls per forward and how
many ran the quantized kernels, and the cosine similarity of the model's output to the default
one. Writes ``models.md`` (the table) and ``models.png`` (a chart) to --out. Needs diffusers,
transformers, matplotlib and tqdm: ``pip install "sageattention2[models]"``.

``--train`` (issue 51): a training step instead of the forward, random weights in train mode, a
step being the forward, the backward of a fixed random output gradient, and AdamW's update;
sageattn's mode runs its quantized training path (``SAGEATTN_TRAINING=quantized``, opt-in:
``_backward``). The attention share is then the recorded calls' forward and backward, and the
cosine is that of all parameter gradients of one step under each mode, at the same weights.
Writes ``models_train.md`` and ``models_train.png``.
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.nn.functional as F

from . import __version__, _model_suite
from ._backward import TRAINING_ENVIRONMENT
from ._timing import queued_ms
from .api import explain
from .integrations import patch_sdpa
from .testing import cosine_similarity

# Recorded SDPA calls: their positional and keyword arguments.
Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]


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
def recording_sdpa(calls: Calls) -> Iterator[None]:
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


def routed_quantized(calls: Calls) -> int:
    """How many of the recorded calls sageattn serves with a quantized kernel (``explain``; on
    inputs that require grad, as sageattn's training path decides)."""
    return sum(1 for args, kwargs in calls if explain(*args, **kwargs).quantized)


def detached(calls: Calls) -> Calls:
    """Recorded calls of a training forward on their tensors detached, each requiring grad as
    it did: the same inputs without the spent graph behind them (which they would keep alive)."""
    def leaf(x: Any) -> Any:
        return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
    return [(tuple(map(leaf, args)), {k: leaf(v) for k, v in kwargs.items()})
            for args, kwargs in calls]


@contextlib.contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    """``$name`` set to ``value`` for the duration, then restored (unset where it was), also on
    an exception."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


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


def replay(args: tuple[Any, ...], kwargs: dict[str, Any], backward: bool) -> Callable[[], Any]:
    """A recorded call to run again alone: its forward, and with ``backward`` its backward too (of
    a fixed random output gradient, to the inputs that require grad)."""
    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(*args, **kwargs)
    if not backward:
        return forward
    inputs = [x for x in (*args, *kwargs.values())
              if isinstance(x, torch.Tensor) and x.requires_grad]
    grad = torch.randn_like(forward())
    return lambda: torch.autograd.grad(forward(), inputs, grad)


def attention_ms(calls: Calls, clock: Clock, reps: int, backward: bool = False) -> float:
    """The time of the recorded SDPA calls, each replayed alone (``replay``): calls of one
    signature are timed once (the median of ``reps`` runs) and counted as often as they occur."""
    groups: dict[tuple[Any, ...], tuple[tuple[Any, ...], dict[str, Any], int]] = {}
    for args, kwargs in calls:
        key = signature(args, kwargs)
        first = groups.get(key)
        groups[key] = (args, kwargs, 1 if first is None else first[2] + 1)
    total = 0.0
    for args, kwargs, count in groups.values():
        run = replay(args, kwargs, backward)
        run()
        total += statistics.median(clock.ms(run) for _ in range(reps)) * count
    return total


MAX_REPS = 400


def alternate(fn: Callable[[], Any], clock: Clock, reps: int, seconds: float,
              baseline: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
              ) -> tuple[list[float], list[float]]:
    """The times of ``fn`` under default SDPA (inside ``baseline``) and under sageattn
    (``patch_sdpa``): ``reps`` each
    at least, more where ``fn`` is short, up to ``seconds`` of timing per mode (a host-bound 5-25
    ms forward moves by several percent between medians of 6). The two alternate, so that drift
    hits both alike, and which goes first swaps every other time: a host-bound forward's time
    depends on what ran just before it."""
    default_ms: list[float] = []
    sage_ms: list[float] = []
    runs = reps
    while len(default_ms) < runs:
        for sage in ((False, True) if len(default_ms) % 2 == 0 else (True, False)):
            if sage:
                with patch_sdpa():
                    sage_ms.append(clock.ms(fn))
            else:
                with baseline():
                    default_ms.append(clock.ms(fn))
        if len(default_ms) == 1 and seconds > 0:
            runs = min(MAX_REPS, max(reps, math.ceil(seconds * 1e3 / max(default_ms[0], 1e-3))))
    return default_ms, sage_ms


def built(case: _model_suite.ModelCase, device: torch.device,
          tiny: bool) -> tuple[torch.nn.Module, _model_suite.Inputs]:
    """The case's model (random weights, seeded) and inputs, in its dtype on a GPU and in float32
    on a CPU."""
    torch.manual_seed(0)
    return case.build(device, case.dtype if device.type == "cuda" else torch.float32, tiny)


def summary(case: _model_suite.ModelCase, default_ms: list[float], sage_ms: list[float],
            attention: float, calls: Calls, quantized: int, cosine: float) -> dict[str, Any]:
    """One row: the median times, their speedup, the attention share of the default time."""
    default, sage = statistics.median(default_ms), statistics.median(sage_ms)
    return dict(model=case.name, default_ms=default, sage_ms=sage, speedup=default / sage,
                attention_share=attention / default, calls=len(calls), quantized=quantized,
                cosine=cosine, reps=len(default_ms))


def measure(case: _model_suite.ModelCase, device: torch.device, tiny: bool, reps: int,
            seconds: float = 0.0) -> dict[str, Any]:
    """The row of a forward, timed by ``alternate``; the cosine is of the model's output."""
    model, inputs = built(case, device, tiny)
    clock = Clock(device)

    def forward() -> Any:
        return model(**inputs)

    with torch.inference_mode():
        calls: Calls = []
        with recording_sdpa(calls):
            want = first_tensor(forward())
        with patch_sdpa():
            got = first_tensor(forward())  # also the warm-up of sageattn's path
        forward()
        default_ms, sage_ms = alternate(forward, clock, reps, seconds)
        return summary(case, default_ms, sage_ms, attention_ms(calls, clock, reps), calls,
                       routed_quantized(calls), cosine_similarity(got, want))


def gradients_cosine(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """``cosine_similarity`` of two lists of gradients as if each were concatenated, from float64
    sums taken tensor by tensor: a concatenated float64 copy of a suite model's gradients takes
    GBs."""
    dot = got_sq = want_sq = torch.zeros((), dtype=torch.float64, device=got[0].device)
    for a, b in zip(got, want, strict=True):
        a, b = a.double(), b.double()
        dot = dot + (a * b).sum()
        got_sq, want_sq = got_sq + a.square().sum(), want_sq + b.square().sum()
    return float(dot / (got_sq.sqrt() * want_sq.sqrt()))


def measure_train(case: _model_suite.ModelCase, device: torch.device, tiny: bool, reps: int,
                  seconds: float = 0.0) -> dict[str, Any]:
    """The row of a training step, timed by ``alternate``: the forward in train mode, the
    backward of a fixed random gradient of the main output, AdamW's update. The cosine is of all
    parameter gradients of one step under each mode at the same weights (before any update).
    ``SAGEATTN_TRAINING=quantized`` (sageattn's opt-in training path) holds throughout: only
    sageattn reads it, so default SDPA's steps and the replayed calls run as without it."""
    model, inputs = built(case, device, tiny)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    clock = Clock(device)
    with torch.no_grad():
        grad = torch.randn_like(first_tensor(model(**inputs)), dtype=torch.float32)

    def backward() -> None:
        (first_tensor(model(**inputs)).float() * grad).sum().backward()

    def step() -> None:
        backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def gradients() -> list[torch.Tensor]:
        """One forward and backward's parameter gradients (zeros where none), taken away; from
        the same random state each time (the same dropout masks: BERT's and Llama's configs)."""
        torch.manual_seed(0)
        backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
        optimizer.zero_grad(set_to_none=True)
        return grads

    failure = default_step_failure(case, device, tiny)
    baseline = without_cudnn if failure else contextlib.nullcontext
    note = f"default SDPA's step raised ({failure}): SDPA without cuDNN" if failure else None
    with environment(TRAINING_ENVIRONMENT, "quantized"):
        calls: Calls = []
        with baseline(), recording_sdpa(calls):
            want = gradients()
        with patch_sdpa():
            got = gradients()  # also the warm-up of sageattn's path
        cosine = gradients_cosine(got, want)
        del want, got
        calls = detached(calls)
        with baseline():
            step()  # the warm-up of the update (AdamW's state is made here)
        default_ms, sage_ms = alternate(step, clock, reps, seconds, baseline)
        with baseline():
            attention = attention_ms(calls, clock, reps, backward=True)
        return dict(summary(case, default_ms, sage_ms, attention, calls, routed_quantized(calls),
                            cosine), note=note)


def default_step_failure(case: _model_suite.ModelCase, device: torch.device,
                         tiny: bool) -> str | None:
    """The first line of the error default SDPA's training step of ``case`` raises (None where it
    runs). PyTorch's cuDNN attention backward fails in some suite models' steps on an H200 with
    torch 2.11 (Wan's and Flux's in sessions 41-42: ``mha_graph.execute(...).is_good()``, an
    illegal memory access; pytorch/pytorch#190321, whose workaround is SDPA without cuDNN). An
    illegal access leaves the CUDA context unusable, so on a GPU the step is tried in a child
    process; on the CPU, in this one."""
    if device.type != "cuda":
        return _default_step_error(case.key, str(device), tiny)
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(_default_step_error, case.key, str(device), tiny).result()
        except concurrent.futures.process.BrokenProcessPool as exc:
            return f"the process died: {exc}"


def _default_step_error(key: str, device: str, tiny: bool) -> str | None:
    (case,) = (c for c in _model_suite.CASES if c.key == key)
    model, inputs = built(case, torch.device(device), tiny)
    model.train()
    try:
        out = first_tensor(model(**inputs)).float()
        out.sum().backward()
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:120]
    return None


def without_cudnn() -> ContextManager[Any]:
    """SDPA's backends other than cuDNN's (the training baseline where cuDNN's fails)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def pyplot() -> Any:
    """matplotlib.pyplot on the file backend, or None without matplotlib (the [models] extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def chart(rows: list[dict[str, Any]], path: Path, title: str, xlabel: str) -> bool:
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
    ax.set_xlabel(xlabel)
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
        out: Path | None, seconds: float = 0.0, train: bool = False) -> list[dict[str, Any]]:
    """Measure the cases named by ``keys`` (all when None or empty): their forwards, or with
    ``train`` their training steps; print the table (and the geometric-mean speedup), write
    models.md and models.png (models_train.md and .png) to ``out``; return the rows. Tiny
    models time exactly ``reps`` (they check the call sites, not the times)."""
    cases = [c for c in _model_suite.CASES if not keys or c.key in keys]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    what, stem = ("Training step", "models_train") if train else ("Whole forward", "models")
    title = f"{what} ({gpu}, torch {torch.__version__}, sageattention2 {__version__})"
    rows, bar = [], progress(len(cases), "models")
    for case in cases:
        bar.set_postfix_str(case.key)
        rows.append((measure_train if train else measure)(case, device, tiny, reps,
                                                          0.0 if tiny else seconds))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the last model's weights and activations are garbage now
        bar.update()
    bar.close()
    geomean = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows))
    ms = "step ms" if train else "ms"
    table = markdown_table(
        ["model", f"default SDPA {ms}", f"sageattn {ms}", "speedup", "attention share",
         "attention calls", "quantized", "gradient cosine" if train else "output cosine",
         "steps timed" if train else "forwards timed"],
        [(r["model"], f"{r['default_ms']:.2f}", f"{r['sage_ms']:.2f}", f"{r['speedup']:.3f}x",
          f"{100 * r['attention_share']:.0f} %", r["calls"], r["quantized"], f"{r['cosine']:.5f}",
          r["reps"])
         for r in rows], title)
    step = " (a step: forward, backward, AdamW)" if train else ""
    table += f"\n\ngeomean speedup {geomean:.3f}x over {len(rows)} models{step}"
    table += "".join(f"\n\n{r['model']}: {r['note']}" for r in rows if r.get("note"))
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.md").write_text(table + "\n")
        xlabel = ("training-step speedup over default SDPA (forward + backward + AdamW)" if train
                  else "whole-forward speedup over default SDPA")
        if chart(rows, out / f"{stem}.png", title, xlabel):
            print(f"wrote {out / f'{stem}.md'} and {out / f'{stem}.png'}")
    return rows
