"""``python -m sageattention2 tune``: measure where the quantized kernel is faster than exact
SDPA on this GPU, and write the crossover table that ``qk_quant="auto"`` follows
(``_crossover``).

For each class (head_dim, causal, dtype) and each point of a grid of query lengths x key lengths
x B*H, both calls are timed as an eager forward runs them (``compare_ms``): calls queued back to
back between CUDA events, so that the GPU's time counts, and the host's where it is the longer
(the shortest calls, where exact SDPA wins either way). A point whose work is above
:data:`MAX_WORK` (or that runs out of memory, or that a backend refuses) is not timed; the table
then takes the value of the same lengths with fewer heads.
"""
from __future__ import annotations

import datetime
import json
import re
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import __version__, _crossover, _execute, _plan
from ._timing import queued_ms
from .api import sageattn, validated_call

__all__ = ["AXES", "HEAD_DIMS", "MAX_WORK", "QUICK_AXES", "tune"]

# The grid: lengths where models sit (77 text tokens; 1K-4K image tokens; 16K-32K video and long
# context), B*H from a single small head group to a large batch.
AXES: dict[str, tuple[int, ...]] = {
    "n_q": (1, 64, 256, 1024, 2048, 4096, 8192, 32768),
    "n_k": (77, 256, 512, 1024, 2048, 4096, 8192, 32768),
    "heads": (4, 16, 64, 256),
}
QUICK_AXES: dict[str, tuple[int, ...]] = {
    "n_q": (64, 1024, 4096, 16384),
    "n_k": (77, 512, 2048, 8192, 32768),
    "heads": (4, 32, 256),
}
# head_dims the kernels run as they are (64, 128, 256) and zero-padded (40 -> 64, 80 -> 128:
# SD1.5's; 160 -> 256, which stands for 136-248: docs/DECISIONS.md#d40). A kernel choice that
# does not run one (the accurate tier above 128) is not measured there.
HEAD_DIMS = (40, 64, 80, 128, 160, 256)
DTYPES = ("float16", "bfloat16")
# 4 * Nq * Nk * B*H * D above this (about 3 ms of attention on an H100) is not timed: the same
# lengths with fewer heads stand for it (4 heads of 32K x 32K are timed: 1024 CTAs, the GPU full).
MAX_WORK = 2 ** 41
MAX_TENSOR_BYTES = 2 ** 31
TARGET_MS = 0.5
ROUNDS = 3


def compare_ms(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """Time per call of two callables, in milliseconds, as an eager forward sees them: calls
    queued back to back (as many as fill :data:`TARGET_MS`), the two in turn
    :data:`ROUNDS` times, the best of each kept (interference only ever adds time)."""
    for fn in (first, second, first, second):  # warm: the call cache, SDPA's plans
        fn()
    estimate = max(queued_ms(first, 1), queued_ms(second, 1), 1e-3)
    calls = max(2, min(32, round(TARGET_MS / estimate)))
    times: list[list[float]] = [[], []]
    for _ in range(ROUNDS):
        for fn, measured in zip((first, second), times):
            measured.append(queued_ms(fn, calls))
    return min(times[0]), min(times[1])


def _warm_gpu(seconds: float = 1.0) -> None:
    """Bring the GPU to its working clocks (an idle H100 sits at a fraction of them)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _point(n_q: int, n_k: int, heads: int, head_dim: int, causal: bool,
           dtype: torch.dtype, pv_quant: str = "auto") -> float | None:
    """SDPA's time over the quantized call's at one point, or None where it is not timed."""
    kernel_dim = _plan.kernel_head_dim(head_dim, _plan.ANY_KERNEL_HEAD_DIMS) or head_dim
    work = 4 * n_q * n_k * heads * kernel_dim // (2 if causal else 1)
    if work > MAX_WORK or max(n_q, n_k) * heads * head_dim * 2 > MAX_TENSOR_BYTES:
        return None
    try:
        q = torch.randn(1, heads, n_q, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(1, heads, n_k, head_dim, device="cuda", dtype=dtype)
                for _ in range(2))
        exact_ms, quantized_ms = compare_ms(
            lambda: _execute._exact_sdpa(q, k, v, is_causal=causal),
            lambda: sageattn(q, k, v, is_causal=causal, qk_quant="int8", pv_quant=pv_quant))
    except RuntimeError:  # out of memory, or a shape an SDPA backend refuses: not timed
        torch.cuda.empty_cache()
        return None
    return exact_ms / quantized_ms


def _kernel_choice(dtype: torch.dtype, pv_quant: str = "auto") -> _plan.KernelChoice:
    """The kernel that a call with ``pv_quant`` runs on this GPU (what the table is for)."""
    q = torch.empty(1, 1, 128, 128, device="cuda", dtype=dtype)
    decision = _execute.decide(validated_call(q, q, q, qk_quant="int8", pv_quant=pv_quant))
    if decision.fallback is not None:
        raise RuntimeError(f"nothing to tune: the quantized kernels cannot run here "
                           f"({decision.fallback})")
    return decision.choice


def tune(axes: dict[str, Sequence[int]] | None = None,
         head_dims: Sequence[int] = HEAD_DIMS, dtypes: Sequence[str] = DTYPES,
         causal: Sequence[bool] = (False, True), out: Path | str | None = None,
         log: Callable[[str], None] = print, base: Path | str | None = None,
         pv_quant: str = "auto") -> Path:
    """Measure the crossover table of the current GPU and write it (default: the user table
    that sageattn then uses on this GPU model, ``_crossover.user_dir()``). Returns its path.
    ``pv_quant``: of the calls measured; "none" measures the accurate tier, whose table is
    another file (``_crossover.table_file``).
    ``base``: a table of this GPU model on the same axes whose other classes the new table
    keeps (re-measure only what a kernel change touched: the non-causal classes in 97 s on an
    H100 where all take 6 minutes)."""
    if not torch.cuda.is_available():
        raise RuntimeError("tune needs a CUDA GPU")
    axes = dict(AXES if axes is None else axes)
    n_q, n_k, heads = (tuple(sorted(axes[name])) for name in ("n_q", "n_k", "heads"))
    name = torch.cuda.get_device_name()
    capability = torch.cuda.get_device_capability()
    choice = _kernel_choice(getattr(torch, dtypes[0]), pv_quant)
    skipped = [h for h in head_dims if _plan.kernel_head_dim(h, _plan.head_dims_of(choice)) is None]
    head_dims = [h for h in head_dims if h not in skipped]
    if skipped:
        log(f"not measured: head_dim {', '.join(map(str, skipped))} (the {'/'.join(choice)} kernel "
            f"does not run it)")
    if not head_dims:
        raise ValueError(f"nothing to tune: the {'/'.join(choice)} kernel runs none of head_dim "
                         f"{', '.join(map(str, skipped))}")
    measuring = {(h, c, d) for h in head_dims for c in causal for d in dtypes}
    classes: list[dict] = [] if base is None else [
        c for c in _base_classes(Path(base), name, {"n_q": list(n_q), "n_k": list(n_k),
                                                     "heads": list(heads)})
        if (c["head_dim"], c["causal"], c["dtype"]) not in measuring]
    kept = len(classes)
    table = {
        "format": _crossover.FORMAT, "gpu": name, "capability": list(capability),
        "kernel": list(choice),
        "measured": f"{datetime.date.today().isoformat()}, torch {torch.__version__}, "
                    f"sageattention2 {__version__}"
                    + ("" if base is None else f" ({kept} classes kept from {Path(base).name})"),
        "axes": {"n_q": list(n_q), "n_k": list(n_k), "heads": list(heads)},
        "classes": classes,
    }
    path = Path(out) if out is not None else (_crossover.user_dir() / _crossover.table_file(
        _crossover.gpu_slug(name), None if pv_quant == "auto" else choice))
    path.parent.mkdir(parents=True, exist_ok=True)
    _warm_gpu()
    started = time.monotonic()
    total = len(head_dims) * len(dtypes) * len(causal)
    for head_dim in head_dims:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for is_causal in causal:
                grid = [[[_point(a, b, h, head_dim, is_causal, dtype, pv_quant) for h in heads]
                         for b in n_k] for a in n_q]
                classes.append({"head_dim": head_dim, "causal": is_causal, "dtype": dtype_name,
                                "speedup": [[[None if x is None else round(x, 3) for x in cell]
                                             for cell in row] for row in grid]})
                timed = [x for row in grid for cell in row for x in cell if x is not None]
                wins = sum(x >= _crossover.THRESHOLD for x in timed)
                path.write_text(_dumps(table) + "\n")  # each class as it is done
                log(f"[{len(classes) - kept}/{total}] head_dim {head_dim}, causal={is_causal}, "
                    f"{dtype_name}: quantized faster at {wins} of {len(timed)} timed points "
                    f"(speedup {min(timed):.2f}-{max(timed):.2f}x; "
                    f"{time.monotonic() - started:.0f} s)")
    _crossover.CrossoverTable.load(path)  # it reads back
    _crossover.clear_cache()
    _execute.clear_call_cache()
    return path


def _base_classes(path: Path, gpu: str, axes: dict[str, list[int]]) -> list[dict]:
    """The classes of the table at ``path``, which must be of ``gpu`` on ``axes``."""
    data = json.loads(path.read_text())
    if data.get("gpu") != gpu or data.get("axes") != axes:
        raise ValueError(f"tune --base {path}: its table is of {data.get('gpu')!r} on axes "
                         f"{data.get('axes')}, this run of {gpu!r} on {axes}: nothing to keep")
    return list(data["classes"])


def _dumps(table: dict) -> str:
    """JSON with each query length's row of speedups on one line (readable; diffs by row)."""
    def flat(match: re.Match[str]) -> str:
        return re.sub(r"\s+", " ", match.group(0)).replace("[ ", "[").replace(" ]", "]")

    text = json.dumps(table, indent=1)
    text = re.sub(r"\[[^\[\]{}]*\]", flat, text)  # lists of numbers: one line each
    return re.sub(r"\[(?:\s*\[[^\[\]{}]*\],?)+\s*\]", flat, text)  # and lists of those
