"""Where exact SDPA is faster than the quantized kernel: the measured crossover that
``qk_quant="auto"`` (the default) follows.

The quantized kernel wins at long sequences (it does half the tensor-core work of FP16 attention,
in INT8 and FP8) but has fixed costs that exact SDPA does not: the preprocessing launches
(smoothing means, K and V quantized), zero-padding of head_dim 40/80 to the kernel's 64/128, and
one 128-key tile per CTA without a split of the key range. At short or few sequences those
costs decide, and SDPA is faster. Where the line runs depends on the GPU, the head_dim, the
mask, the dtype, the lengths and B*H, so it is measured, not modelled: ``python -m
sageattention2 tune`` (``_tune``) times both on a grid of shapes on the GPU at hand and writes a
:class:`CrossoverTable`. Tables for the H100 (the default FP8 tier's and the accurate tier's)
and the H200 (the default tier's) ship in ``sageattention2/crossover/``.

A call with ``qk_quant="auto"`` runs exact SDPA where the table says that SDPA is faster for its
shape (the speedup interpolated between the measured points is below 1), without a warning: the
result is then exact, and faster. The decision is made once per kind of call (the call cache),
so it costs nothing per call. ``qk_quant="int8"``/``"int4"`` always runs the quantized kernel.

A table measures one kernel choice (its ``kernel``): the one default options run
(``<gpu>.json``), or another that options select, e.g. the Hopper kernel's accurate tier
(``pv_quant="none"``: ``<gpu>-wgmma-int8-input.json``, ``tune --pv-quant none``). A call is
decided only by a table of the choice it runs.

Which table a GPU uses for a choice (:func:`table_for`): ``SAGEATTN_CROSSOVER`` names a table
file (used for its own choice; other choices are looked up as below), or is ``off`` (no table:
"auto" always quantizes); else the table ``tune`` wrote for this GPU model
(``$XDG_CACHE_HOME/sageattention2/crossover/``, default ``~/.cache/...``); else the shipped table
of this GPU model; else a shipped table of another GPU of the same compute capability (an H800
uses the H100's: same kernels, similar balance); else none.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ._call import AttentionCall
from ._plan import Capability, KernelChoice, head_dims_of, kernel_head_dim

__all__ = [
    "ENVIRONMENT",
    "FORMAT",
    "SHIPPED",
    "CrossoverTable",
    "clear_cache",
    "exact_is_faster",
    "gpu_slug",
    "table_for",
    "user_dir",
]

FORMAT = 1
ENVIRONMENT = "SAGEATTN_CROSSOVER"
SHIPPED = Path(__file__).resolve().parent / "crossover"
# Speedups below this run exact SDPA. 1: never slower (the target), and a tie goes to the
# exact result.
THRESHOLD = 1.0

ClassKey = tuple[int, bool, str]  # head_dim, causal, dtype name ("float16"/"bfloat16")


def gpu_slug(name: str) -> str:
    """A GPU's name as a file name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def user_dir() -> Path:
    """Where ``tune`` writes the tables it measures."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "sageattention2" / "crossover"


def class_key(head_dim: int, causal: bool, dtype: torch.dtype | str) -> ClassKey:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return head_dim, causal, name


def _position(axis: Sequence[int], value: float) -> tuple[int, int, float]:
    """Where ``value`` falls on a measured ``axis`` (ascending), in log2 coordinates: the two
    neighbouring points and the weight of the second (clamped at the ends)."""
    if value <= axis[0]:
        return 0, 0, 0.0
    if value >= axis[-1]:
        last = len(axis) - 1
        return last, last, 0.0
    hi = next(i for i, a in enumerate(axis) if a >= value)
    lo = hi - 1
    w = (math.log2(value) - math.log2(axis[lo])) / (math.log2(axis[hi]) - math.log2(axis[lo]))
    return lo, hi, w


@dataclass(frozen=True)
class CrossoverTable:
    """Measured speedups of the quantized kernel over exact SDPA (SDPA's time / the quantized
    call's, both GPU time) on one GPU, per class (head_dim, causal, dtype), on a grid of query
    lengths x key lengths x B*H (query heads). Points that were too large to time (``tune``
    caps the work per point) are None in the file and take the value of the same lengths with
    fewer heads (more heads only fill the GPU further)."""

    gpu: str
    capability: Capability
    kernel: KernelChoice
    measured: str
    n_q: tuple[int, ...]
    n_k: tuple[int, ...]
    heads: tuple[int, ...]
    speedups: dict[ClassKey, tuple[float, ...]]  # flattened [n_q][n_k][heads], None filled
    source: str = ""

    # -- the file ----------------------------------------------------------------------------

    @staticmethod
    def from_json(data: dict[str, Any], source: str = "") -> CrossoverTable:
        if data.get("format") != FORMAT:
            raise ValueError(f"{source or 'crossover table'}: format {data.get('format')!r}, "
                             f"this sageattention2 reads format {FORMAT}")
        axes = data["axes"]
        n_q, n_k, heads = (tuple(int(x) for x in axes[name]) for name in ("n_q", "n_k", "heads"))
        speedups = {}
        for entry in data["classes"]:
            key = class_key(int(entry["head_dim"]), bool(entry["causal"]), str(entry["dtype"]))
            speedups[key] = _filled(entry["speedup"], len(n_q), len(n_k), len(heads))
        kernel = KernelChoice(*data["kernel"])
        return CrossoverTable(str(data["gpu"]), tuple(data["capability"]),  # type: ignore[arg-type]
                              kernel, str(data["measured"]), n_q, n_k, heads, speedups, source)

    @staticmethod
    def load(path: Path | str) -> CrossoverTable:
        with open(path) as f:
            return CrossoverTable.from_json(json.load(f), str(path))

    # -- lookup ------------------------------------------------------------------------------

    def class_for(self, head_dim: int, causal: bool, dtype: torch.dtype) -> ClassKey | None:
        """The measured class that stands for a call: same causal flag, the dtype (else the other
        half-precision one: the kernels and SDPA run both alike), and the head_dim itself, else
        the nearest measured one that the kernel runs the same way (the same kernel head_dim,
        zero-padded or not: hd 48 takes hd 40's points, hd 96 takes hd 80's, hd 192 and 248 the
        H100 table's hd 160, which pads to 256 too). A kernel head_dim above every measured one
        (256, in a table from before it was built) takes the largest measured head_dim's points:
        at 256 the Hopper kernel's speedup over cuDNN runs like 128's (0.72x at 1K, 1.19x at 4K;
        docs/DECISIONS.md#d39), closer than running it at every length."""
        built = head_dims_of(self.kernel)
        padded = kernel_head_dim(head_dim, built)
        if padded is None:
            return None
        want = class_key(head_dim, causal, dtype)[2]
        keys = [key for key in self.speedups if key[1] == causal]
        for dtype_name in (want, *sorted({key[2] for key in keys} - {want})):
            same_way = [key for key in keys if key[2] == dtype_name
                        and kernel_head_dim(key[0], built) == padded
                        and (key[0] == padded) == (head_dim == padded)]
            if same_way:
                return min(same_way, key=lambda key: abs(key[0] - head_dim))
        measured = [key for key in keys if kernel_head_dim(key[0], built) is not None]
        if measured and padded > max(kernel_head_dim(key[0], built) or 0 for key in measured):
            top = max(key[0] for key in measured)
            same_dtype = [key for key in measured if key[0] == top and key[2] == want]
            return (same_dtype or [key for key in measured if key[0] == top])[0]
        return None

    def speedup(self, head_dim: int, causal: bool, dtype: torch.dtype, n_q: int, n_k: int,
                heads: int) -> float | None:
        """The quantized kernel's speedup over SDPA for a call, interpolated between the measured
        points (geometrically, in log2 of the lengths and of B*H; clamped to the grid), or None
        where no class stands for it."""
        key = self.class_for(head_dim, causal, dtype)
        if key is None:
            return None
        values = self.speedups[key]
        n_k_len, heads_len = len(self.n_k), len(self.heads)
        log_speedup = 0.0
        for i, wi in _corners(_position(self.n_q, n_q)):
            for j, wj in _corners(_position(self.n_k, n_k)):
                for h, wh in _corners(_position(self.heads, heads)):
                    weight = wi * wj * wh
                    if weight:
                        value = values[(i * n_k_len + j) * heads_len + h]
                        log_speedup += weight * math.log(value)
        return math.exp(log_speedup)

    def describe(self) -> str:
        return f"measured on {self.gpu} ({self.measured}; {self.source or 'in memory'})"


def _corners(position: tuple[int, int, float]) -> Iterable[tuple[int, float]]:
    lo, hi, w = position
    return ((lo, 1.0),) if lo == hi else ((lo, 1.0 - w), (hi, w))


def _filled(nested: Any, n_q: int, n_k: int, heads: int) -> tuple[float, ...]:
    """The flattened [n_q][n_k][heads] speedups, each None (not timed: too large) replaced by the
    value with fewer heads at the same lengths, else with the next shorter query length."""
    flat: list[float | None] = [None if x is None else float(x)
                                for row in nested for cell in row for x in cell]
    if len(flat) != n_q * n_k * heads:
        raise ValueError(f"crossover table: {len(flat)} speedups for a {n_q}x{n_k}x{heads} grid")
    for i in range(n_q):
        for j in range(n_k):
            for h in range(heads):
                index = (i * n_k + j) * heads + h
                if flat[index] is not None:
                    value = flat[index]
                    if not (value > 0 and math.isfinite(value)):  # type: ignore[operator]
                        raise ValueError(f"crossover table: speedup {value} is not positive")
                    continue
                if h > 0:
                    flat[index] = flat[index - 1]
                elif i > 0:
                    flat[index] = flat[((i - 1) * n_k + j) * heads]
                else:
                    raise ValueError("crossover table: the smallest point of a key length has no "
                                     "time")
    return tuple(x for x in flat if x is not None)


# ------------------------------------------------------------------------------------------------
# Which table a device uses
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> CrossoverTable:
    return CrossoverTable.load(path)


def _shipped() -> list[Path]:
    return sorted(SHIPPED.glob("*.json"))


def table_file(slug: str, choice: KernelChoice | None = None) -> str:
    """The file name of a GPU's table: ``<slug>.json`` for the choice default options run
    (``choice`` None), ``<slug>-<kernel>-<qk>-<pv>.json`` for another."""
    return f"{slug}.json" if choice is None else f"{slug}-{choice.kernel}-{choice.qk}-{choice.pv}.json"


@functools.lru_cache(maxsize=None)
def _table_for(setting: str | None, name: str, capability: Capability,
               choice: KernelChoice | None = None) -> CrossoverTable | None:
    """``choice`` None: the GPU's default table (whatever kernel it measured)."""
    def fits(table: CrossoverTable) -> bool:
        return choice is None or table.kernel == choice

    if setting is not None and setting.strip().lower() in ("off", "0", "none", ""):
        return None
    if setting is not None and fits(table := _load(setting)):
        return table
    slug = gpu_slug(name)
    files = [table_file(slug)] if choice is None else [table_file(slug, choice), table_file(slug)]
    for directory in (user_dir(), SHIPPED):
        for file in files:
            if (directory / file).is_file() and fits(table := _load(str(directory / file))):
                return table
    for path in _shipped():  # (a default table is the file named after its GPU alone)
        table = _load(str(path))
        if table.capability == capability and fits(table) and (
                choice is not None or path.stem == gpu_slug(table.gpu)):
            return table
    return None


def table_for(device: torch.device, capability: Capability | None,
              choice: KernelChoice | None = None) -> CrossoverTable | None:
    """The crossover table of a CUDA ``device`` for ``choice`` (None: its default table; see
    the module's docstring), or None."""
    if device.type != "cuda" or capability is None:
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return _table_for(os.environ.get(ENVIRONMENT), _gpu_name(index), capability, choice)


def clear_cache() -> None:
    """Forget the tables read (after ``tune`` wrote one, or a test changed the environment)."""
    _table_for.cache_clear()
    _load.cache_clear()


def exact_is_faster(call: AttentionCall, choice: KernelChoice,
                    capability: Capability | None) -> str | None:
    """Why exact SDPA serves ``call`` although ``choice`` could (it is faster for this shape on
    this GPU), or None: only for ``qk_quant="auto"``, only where a table measured ``choice`` on a
    GPU of this kind, and not for calls that ask for the LSE (SDPA does not return it: the exact
    path computes it in float64, far slower than the kernel, which returns it as it goes)."""
    if not call.qk_quant_auto or call.return_lse:
        return None
    table = table_for(call.q.device, capability, choice)
    if table is None or table.kernel != choice:
        return None
    b, h_q, n_q, _ = call.q.shape
    speedup = table.speedup(call.head_dim, call.is_causal, call.q.dtype, n_q, call.k.shape[2],
                            b * h_q)
    if speedup is None or speedup >= THRESHOLD:
        return None
    return (f"exact SDPA is faster for this shape: the quantized kernel would run at "
            f"{speedup:.2f}x its speed (qk_quant='auto'; crossover {table.describe()}; "
            "qk_quant='int8' forces the kernel)")
