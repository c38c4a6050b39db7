"""``python -m sageattention2 bench --shapes``: the ANCHORS shapes of docs/PROTOCOL.md (B4 H32,
N 1K / 4K / 16K, head_dim 64 and 128, causal or not, float16), one call each: sageattn with the
kernel forced (``qk_quant="int8"``, the full call: preprocessing and kernel), its default
(``qk_quant="auto"``: exact SDPA where the crossover says it is faster), SDPA flash and SDPA
cuDNN, side by side in one process. TOPS = 4 * B * H * N^2 * D / time, halved under the causal
mask; time = the median of CUDA-event timings of single calls after a warm-up (the lab's
``benchmarks/bench_attention.py`` flushes L2 between calls, with triton; figures here run a few
percent higher at 1K). Writes ``shapes.md`` and ``shapes.png`` to --out.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from . import __version__
from ._bench_models import Clock, markdown_table, progress, pyplot
from .api import sageattn

__all__ = ["SHAPES", "run"]

BATCH, HEADS = 4, 32
SHAPES: tuple[tuple[int, int, bool], ...] = tuple(
    (d, n, causal) for d in (64, 128) for n in (1024, 4096, 16384) for causal in (False, True))
COLUMNS = ("sageattn int8", "sageattn auto", "SDPA flash", "SDPA cuDNN")


def median_ms(fn: Callable[[], object], reps: int = 30) -> float:
    """Median of ``reps`` CUDA-event timings of single calls, after 5 calls of warm-up."""
    for _ in range(5):
        fn()
    clock = Clock(torch.device("cuda"))
    return statistics.median(clock.ms(fn) for _ in range(reps))


def _sdpa(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          causal: bool) -> float | None:
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel(backend):
            return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    except RuntimeError:  # this backend does not serve these inputs here
        return None


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """TOPS per shape, one bar per implementation. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    labels = [r["shape"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(COLUMNS)
    for i, column in enumerate(COLUMNS):
        ax.bar([x + i * width for x in range(len(rows))], [r[column] or 0.0 for r in rows],
               width, label=column)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, rotation=45,
                  ha="right", fontsize=7)
    ax.set_ylabel("TOPS")
    ax.set_title(title, fontsize=8, loc="left")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(out: Path | None, shapes: Sequence[tuple[int, int, bool]] = SHAPES) -> list[dict[str, Any]]:
    """Measure ``shapes`` on the current GPU; print the table; write shapes.md/png to ``out``."""
    from torch.nn.attention import SDPBackend

    title = (f"ANCHORS shapes, B{BATCH} H{HEADS} float16, TOPS ({torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, sageattention2 {__version__})")
    rows, bar = [], progress(len(shapes), "shapes")
    for d, n, causal in shapes:
        bar.set_postfix_str(f"hd{d} N{n} {'causal' if causal else ''}")
        q, k, v = (torch.randn(BATCH, HEADS, n, d, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        work = 4 * BATCH * HEADS * n * n * d / (2 if causal else 1)
        times = {
            "sageattn int8": median_ms(lambda: sageattn(q, k, v, is_causal=causal,
                                                        qk_quant="int8")),
            "sageattn auto": median_ms(lambda: sageattn(q, k, v, is_causal=causal)),
            "SDPA flash": _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal),
            "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal),
        }
        row: dict[str, Any] = {"shape": f"hd{d} N{n // 1024}K{' causal' if causal else ''}"}
        row.update({c: None if t is None else work / t / 1e9 for c, t in times.items()})
        rows.append(row)
        bar.update()
    bar.close()

    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    table = markdown_table(["shape", *COLUMNS, "int8 / cuDNN"],
                           [(r["shape"], *(cell(r[c]) for c in COLUMNS),
                             "-" if not r["SDPA cuDNN"] else
                             f"{r['sageattn int8'] / r['SDPA cuDNN']:.2f}x") for r in rows], title)
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "shapes.md").write_text(table + "\n")
        if chart(rows, out / "shapes.png", title):
            print(f"wrote {out / 'shapes.md'} and {out / 'shapes.png'}", file=sys.stderr)
    return rows
