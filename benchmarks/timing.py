"""The one timing module of the benchmarks and scripts: the protocol of docs/PROTOCOL.md in code
(#speed-inputs, #timing, #tops).

Inputs are q, k, v = randn(B=4, H=32, N, D) fp16 in HND; a time is the median of triton's
do_bench (warmup 25 ms, rep 150 ms, L2 flushed between runs), or of CUDA-event timings where
triton is missing; TOPS = 4 * B * H * N^2 * D / time, halved under the causal mask. Also here:
SDPA per backend, each attention kernel alone on K and V quantized once, the device copy
bandwidth, and the Markdown tables the benchmarks print.

A script in benchmarks/ imports it as ``import timing`` (its folder is on sys.path); a script in
scripts/ puts benchmarks/ on sys.path first. As a command it merges A/B runs of a benchmark:

    python3 benchmarks/timing.py merge A=run1.md B=run2.md A=run3.md
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
from collections import Counter
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

BATCH, HEADS = 4, 32
WARMUP_MS, REP_MS = 25, 150
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Inputs and times
# ---------------------------------------------------------------------------------------------


def anchors_inputs(n: int, d: int, dtype: torch.dtype = torch.float16, batch: int = BATCH,
                   heads: int = HEADS) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of the protocol: randn(batch, heads, n, d) on the GPU, HND."""
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in range(3))
    return q, k, v


def median_ms(fn: Callable[[], object], warmup: int = WARMUP_MS, rep: int = REP_MS) -> float:
    """Median time of fn in milliseconds: triton's do_bench where triton is installed (it also
    flushes L2 between runs), else CUDA events around single calls."""
    try:
        from triton.testing import do_bench
    except ImportError:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        return statistics.median(event_times_ms(fn, max(20, rep // 5)))
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def event_times_ms(fn: Callable[[], object], reps: int) -> list[float]:
    """fn's time in milliseconds, ``reps`` times, each between two CUDA events and synchronized
    (so a call's host time counts where the GPU waits for it)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def tops(ms: float | None, n: int, d: int, causal: bool, batch: int = BATCH, heads: int = HEADS,
         n_kv: int | None = None) -> float:
    """4 * B * H * Nq * Nk * D operations (the QK and the PV product) per ``ms``, halved under the
    causal mask; NaN where there is no time (a backend that cannot run)."""
    if not ms:
        return float("nan")
    return 4 * batch * heads * n * (n_kv or n) * d / (2 if causal else 1) / ms / 1e9


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src)) / 1e6


@contextlib.contextmanager
def environment(assignments: Sequence[str]) -> Iterator[None]:
    """The environment with ``NAME=VALUE`` assignments applied, restored after: launch settings
    the extension reads at each call (SAGEATTN_PDL=0 ...), measured in the same process."""
    env = dict(a.split("=", 1) for a in assignments)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---------------------------------------------------------------------------------------------
# What is timed: SDPA, the attention kernels alone
# ---------------------------------------------------------------------------------------------

SDPA_BACKENDS = ("flash", "cudnn", "default")  # "default": no backend forced (SDPA picks)


def sdpa_ms(backend: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, rep: int = REP_MS,
            enable_gqa: bool = False) -> float | None:
    """Median time of F.scaled_dot_product_attention on one backend of SDPA_BACKENDS (entered
    outside the timed call, so its host cost is not timed), or None where it cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}.get(backend)
    context = sdpa_kernel(forced) if forced is not None else contextlib.nullcontext()
    try:
        with context:
            return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=enable_gqa), rep=rep)
    except RuntimeError:  # "No available kernel": this backend does not serve these inputs here
        return None


def default_kernel() -> tuple[str, str, bool]:
    """(kernel, qk, fp8_v): the attention kernel sageattn's defaults run on this GPU, as
    sageattention2._plan.route picks it (kept out of that private function so that builds of other
    revisions, A/B runs, time the same thing): the Hopper kernel where the build has it for this
    GPU, else the warp-level INT8 kernel with FP8 PV where FP8 mma.sync is native (Ada, sm_12x),
    with PV in the input dtype elsewhere."""
    from sageattention2 import ops

    capability = torch.cuda.get_device_capability()
    if ops.has_op("attention_wgmma") and ops.family_runs_on(ops.WGMMA_FAMILY, capability):
        return "wgmma", "int8", False
    native_fp8 = capability == (8, 9) or capability[0] == 12
    return "mma", "int8", native_fp8 and ops.family_runs_on(ops.MMA_FP8_FAMILY, capability)


def wgmma_kernel_call(q: Tensor, k: Tensor, v: Tensor, causal: bool, pv: str = "fp8") -> Callable[[], object]:
    """attention_wgmma alone (it quantizes Q itself) on K and V quantized once as sageattn's
    Hopper path does (K smoothed, V with one FP8 scale per tile; ``pv`` "input": the accurate
    tier, V as it is), as a callable to time."""
    from sageattention2 import ops

    stats = ops.smoothing_stats(None, k, None, False)
    fp8 = pv == "fp8"
    kv = ops.quantize_kv(k, v if fp8 else None, stats.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    scale = q.shape[-1] ** -0.5
    v_in, v_scale = (kv.v_fp8, kv.v_tile_scale) if fp8 else (v, None)
    return lambda: ops.attention_wgmma(q, kv.k_quant, kv.k_scale, v_in, v_scale, None, None,
                                       k.shape[2], scale, causal, False, False)


def mma_kernel_call(q: Tensor, k: Tensor, v: Tensor, causal: bool, qk: str = "int8",
                    fp8_v: bool = False) -> Callable[[], object]:
    """attention_mma alone (it quantizes Q itself) on K and V prepared once as sageattn's
    defaults prepare them (K smoothed; Q smoothed for INT4 only; FP8 V per channel), as a
    callable to time."""
    from sageattention2 import ops

    scale = q.shape[-1] ** -0.5
    smooth_q = qk == "int4"
    stats = ops.smoothing_stats(q if smooth_q else None, k, v if fp8_v else None, False)
    q_mean = stats.q_mean if smooth_q else None
    kv = ops.quantize_kv(k, v if fp8_v else None, stats.k_mean, None, stats.v_scale if fp8_v else None,
                         q_mean, ops.MMA_BLOCK_K, qk, scale * LOG2E)
    pv = (kv.v_fp8, stats.v_scale, None) if fp8_v else (v, None, None)
    delta_s = kv.delta_s if smooth_q else None
    return lambda: ops.attention_mma(q, q_mean, kv.k_quant, kv.k_scale, delta_s, *pv, stats.k_mean, qk,
                                     k.shape[2], scale, causal, False, False)


def kernel_call(q: Tensor, k: Tensor, v: Tensor, causal: bool, pv_quant: str = "auto") -> Callable[[], object]:
    """The kernel of default_kernel() alone, as a callable to time (``pv_quant`` "none": its PV
    in the input dtype, the Hopper kernel's accurate tier)."""
    kernel, qk, fp8_v = default_kernel()
    if kernel == "wgmma":
        return wgmma_kernel_call(q, k, v, causal, "input" if pv_quant == "none" else "fp8")
    return mma_kernel_call(q, k, v, causal, qk, fp8_v and pv_quant != "none")


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


class Table:
    """A Markdown table printed row by row as it is measured (a long run shows progress, and a
    timeout keeps what was measured), kept for ``write``."""

    def __init__(self, columns: Sequence[str], title: str | None = None) -> None:
        self.lines = [] if title is None else [title, ""]
        self.lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        print("\n".join(self.lines), flush=True)

    def row(self, *cells: object) -> None:
        line = "| " + " | ".join(format_cell(c) for c in cells) + " |"
        self.lines.append(line)
        print(line, flush=True)

    def write(self, path: str | None) -> None:
        if path:
            with open(path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def format_cell(cell: object) -> str:
    """Floats as whole numbers (TOPS, microseconds), NaN as "-"."""
    if isinstance(cell, float):
        return "-" if cell != cell else f"{cell:.0f}"
    return str(cell)


def read_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first Markdown table in ``text``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    rows = [r for r in cells[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r)]
    return cells[0], rows


def merge_runs(runs: Sequence[tuple[str, str]], keys: int = 3) -> str:
    """One Markdown table of several runs of the same benchmark (``(label, table text)`` in the
    order they ran, e.g. A, B, A), rows matched on their first ``keys`` cells: each numeric
    column once per run, then, for each label after the first, the ratio of its median to the
    first label's median (B/A > 1: B is faster, the columns being TOPS)."""
    tables = [(label, *read_table(text)) for label, text in runs]
    header = tables[0][1]
    numeric = [i for i in range(keys, len(header)) if " / " not in header[i]]  # not the ratio columns
    labels = list(dict.fromkeys(label for label, _, _ in tables))
    by_key = [{tuple(r[:keys]): r for r in rows} for _, _, rows in tables]
    seen: Counter[str] = Counter()
    run_names = []  # A, B, A2: a label again gets its run's number
    for label, _, _ in tables:
        seen[label] += 1
        run_names.append(label if seen[label] == 1 else f"{label}{seen[label]}")
    columns = header[:keys]
    for i in numeric:
        columns += [f"{header[i]} {name}" for name in run_names]
        columns += [f"{header[i]} {label}/{labels[0]}" for label in labels[1:]]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for key in by_key[0]:
        cells = list(key)
        for i in numeric:
            values = [table.get(key, [""] * len(header))[i] for table in by_key]
            cells += values
            medians = {label: _median([v for (lab, _, _), v in zip(tables, values) if lab == label])
                       for label in labels}
            for label in labels[1:]:
                a, b = medians[labels[0]], medians[label]
                cells.append(f"{b / a:.3f}" if a and b else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(values: list[str]) -> float | None:
    numbers = [float(v.rstrip("x")) for v in values if re.fullmatch(r"[0-9.]+x?", v)]
    return statistics.median(numbers) if numbers else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="one table of several runs of a benchmark (A/B)")
    merge.add_argument("runs", nargs="+", metavar="LABEL=TABLE.md", help="in the order they ran")
    merge.add_argument("--keys", type=int, default=3, help="leading columns that identify a row")
    args = parser.parse_args(argv)
    runs = []
    for run in args.runs:
        label, _, path = run.partition("=")
        with open(path) as f:
            runs.append((label, f.read()))
    print(merge_runs(runs, args.keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
