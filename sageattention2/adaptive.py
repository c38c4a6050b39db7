"""The adaptive plan (issue 36, item 3; the technical report's "SageAttn-mix",
``shared/paper/adaptive-mix.md``): which attention variant each call site of a model runs,
chosen from measurements on this GPU.

    plan = calibrate(model, run, budget=0.01)   # run(model): a forward, or a denoising loop
    plan.save("plan.json")
    with apply_plan(model, Plan.load("plan.json")):
        run(model)

:func:`calibrate` runs ``run(model)`` with every ``F.scaled_dot_product_attention`` call served
exactly, and measures each call under every variant this GPU runs natively
(:func:`native_variants`): its **error** against the exact output, ``1 - CosSim * (1 - rel.
L1)`` (the report's score, over the flattened output), and its GPU time. A **call site** is the
innermost module whose forward made the call (its qualified name in ``model``) and the call's
index within that forward, ``"blocks.3.attn1#0"``; the **step** counts the top-level forwards
of ``model`` within one ``run`` (a pipeline's denoising steps). For each site and step the plan
takes the fastest variant whose error is within ``budget``; exact SDPA always is. Consecutive
steps with one variant become one range; when ``run`` made a single forward, the entries hold
for every step (an LLM's layers, whatever the number of forwards later).

:func:`apply_plan` makes each site run its variant while applied (it replaces
``F.scaled_dot_product_attention``, as :func:`~sageattention2.integrations.patch_sdpa` does); a
site or step the calibration did not see runs ``sageattn``'s default. The plan file is JSON, one
entry per site and step range, with the measured error and times.

Under ``torch.compile`` a plan whose entries hold for every step (``run`` made one forward)
compiles as one graph with each site's variant fixed (the sites are tracked by module hooks,
which dynamo traces). A plan with step ranges makes the graph specialize on the step: one
compilation per step, past dynamo's recompile limit for a long denoising loop; run those eagerly
(or compile per step range: not built yet).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _plan
from .api import sageattn
from .testing import cosine_similarity, relative_l1

__all__ = ["EXACT", "VARIANTS", "Plan", "PlanEntry", "apply_plan", "calibrate", "call_error",
           "native_variants"]

FORMAT = 1
EXACT = "exact"
# The variants a plan chooses from, as sageattn options; fastest first where all are native.
VARIANTS: dict[str, dict[str, str]] = {
    "int4+fp8": dict(qk_quant="int4", pv_quant="fp8"),   # sm_89+ native (Ada); paper's 4-bit
    "int8+fp8": dict(qk_quant="int8", pv_quant="fp8"),   # the Hopper kernel on sm_90
    "int8+fp16": dict(qk_quant="int8", pv_quant="none"),  # the accurate tier: PV in the input dtype
}
ERROR = "1 - CosSim * (1 - relative L1) of the output against exact SDPA"

Timer = Callable[[str, Callable[[], Any]], float]


def native_variants(target: _plan.Target) -> list[str]:
    """The variants that run as native instructions on ``target`` (``_plan.target_of``): none
    where the kernels cannot run; INT8 QK with FP16/BF16 PV everywhere else; FP8 PV where the
    Hopper kernel or native FP8 ``mma.sync`` serves it; INT4 QK only with native FP8 and INT4
    ``mma.sync`` (Ada, sm_12x). sm_90 emulates FP8 ``mma.sync``, so a plan never picks INT4
    there for speed."""
    if _plan._target_reason(target) is not None:
        return []
    names = ["int8+fp16"]
    if target.wgmma or (target.native_fp8 and target.mma_fp8):
        names.append("int8+fp8")
    if target.native_fp8 and target.mma_fp8:
        names.append("int4+fp8")
    return names


def call_error(out: Tensor, exact: Tensor) -> float:
    """``1 - CosSim * (1 - rel. L1)`` of ``out`` against ``exact`` (the metrics of
    ``sageattention2.testing``): 0 when equal, inf when not finite (a NaN output, or an all-zero
    reference: such a call keeps exact SDPA)."""
    error = 1.0 - cosine_similarity(out.detach(), exact) * (1.0 - relative_l1(out.detach(), exact))
    return max(0.0, error) if math.isfinite(error) else math.inf  # (rounding: -1e-16 when exact)


# ------------------------------------------------------------------------------------------------
# Call sites
# ------------------------------------------------------------------------------------------------


class _SiteTracker:
    """Which module's forward is running (module hooks on the submodules of ``model``): the
    call site of an SDPA call made now, and the step (top-level forwards of ``model``).
    ``only``: hook just these modules (and ``model``): a plan's sites. Hooks on every module of
    MiniLM (6 layers, ~100 modules) cost 0.1 ms per attention call, 20 % of its forward."""

    def __init__(self, model: torch.nn.Module, steps: bool = True, only: set[str] | None = None) -> None:
        self.names: list[str] = []
        self.calls: list[int] = []  # per open forward: SDPA calls it made so far
        self.step = -1
        self.steps = steps  # count them (a compiled graph then specializes on each step)
        self._handles = []
        for name, module in model.named_modules():
            if only is not None and name and name not in only:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not self.names and self.steps:
                self.step += 1
            self.names.append(name)
            self.calls.append(0)
        return hook

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.names.pop()
        self.calls.pop()

    def site(self) -> str | None:
        """The site of an SDPA call made now (and counts it), or None outside ``model``."""
        if not self.names:
            return None
        index = self.calls[-1]
        self.calls[-1] += 1
        return f"{self.names[-1]}#{index}"

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    site: str
    steps: tuple[int, int] | None  # first and last step (inclusive); None: every step
    variant: str                    # EXACT or a key of VARIANTS
    error: float                    # the largest measured error of the variant over the steps
    time_ms: float                  # its mean measured time per call
    exact_ms: float                 # exact SDPA's, for comparison


@dataclasses.dataclass
class Plan:
    budget: float
    gpu: str
    entries: list[PlanEntry]
    variants: dict[str, dict[str, str]] = dataclasses.field(default_factory=lambda: dict(VARIANTS))

    def variant_for(self, site: str | None, step: int,
                    by_site: dict[str, list[PlanEntry]] | None = None) -> str | None:
        """The variant of ``site`` at ``step``, or None where the calibration did not see it
        (``by_site``: this plan's :meth:`_by_site`, computed once by a caller that asks often)."""
        for entry in (self._by_site() if by_site is None else by_site).get(site, ()):  # type: ignore[arg-type]
            if entry.steps is None or entry.steps[0] <= step <= entry.steps[1]:
                return entry.variant
        return None

    def _by_site(self) -> dict[str, list[PlanEntry]]:
        found: dict[str, list[PlanEntry]] = {}
        for entry in self.entries:
            found.setdefault(entry.site, []).append(entry)
        return found

    def summary(self) -> dict[str, int]:
        """Calls (site x step) per variant."""
        counts: dict[str, int] = {}
        for e in self.entries:
            n = 1 if e.steps is None else e.steps[1] - e.steps[0] + 1
            counts[e.variant] = counts.get(e.variant, 0) + n
        return counts

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "gpu": self.gpu, "budget": self.budget, "error": ERROR,
                "variants": self.variants,
                "entries": [dict(site=e.site, steps=None if e.steps is None else list(e.steps),
                                 variant=e.variant, error=round(e.error, 6),
                                 time_ms=round(e.time_ms, 4), exact_ms=round(e.exact_ms, 4))
                            for e in self.entries]}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Plan:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a sageattention2 plan of format {FORMAT}: format "
                             f"{data.get('format')!r}")
        variants = {str(k): dict(v) for k, v in data["variants"].items()}
        entries = []
        for raw in data["entries"]:
            if raw["variant"] != EXACT and raw["variant"] not in variants:
                raise ValueError(f"plan entry {raw['site']!r} names variant {raw['variant']!r}, "
                                 f"which is neither {EXACT!r} nor one of {sorted(variants)}")
            steps = None if raw["steps"] is None else (int(raw["steps"][0]), int(raw["steps"][1]))
            entries.append(PlanEntry(str(raw["site"]), steps, str(raw["variant"]),
                                     float(raw["error"]), float(raw["time_ms"]),
                                     float(raw["exact_ms"])))
        return Plan(float(data["budget"]), str(data["gpu"]), entries, variants)

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @staticmethod
    def load(path: Path | str) -> Plan:
        return Plan.from_json(json.loads(Path(path).read_text()))


# (site, step) -> variant -> [(error, ms)] per measured call
Measurements = dict[tuple[str, int], dict[str, list[tuple[float, float]]]]


def choose(measured: Measurements, budget: float, gpu: str,
           variants: Mapping[str, Mapping[str, str]] | None = None) -> Plan:
    """The plan of ``measured``: per site and step the fastest variant (mean time) whose mean
    error is within ``budget``; consecutive steps with one variant merged."""
    single_step = all(step == 0 for _, step in measured)
    picks: dict[str, list[tuple[int, str, float, float, float]]] = {}
    for (site, step), per_variant in sorted(measured.items()):
        means = {name: (statistics.fmean(e for e, _ in runs), statistics.fmean(t for _, t in runs))
                 for name, runs in per_variant.items()}
        exact_ms = means[EXACT][1]
        eligible = [(ms, name) for name, (err, ms) in means.items() if err <= budget]
        ms, name = min(eligible)
        picks.setdefault(site, []).append((step, name, means[name][0], ms, exact_ms))
    entries = []
    for site, rows in picks.items():
        start = 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i][1] != rows[start][1] or rows[i][0] != rows[i - 1][0] + 1:
                run = rows[start:i]
                steps = None if single_step else (run[0][0], run[-1][0])
                entries.append(PlanEntry(site, steps, run[0][1], max(r[2] for r in run),
                                         statistics.fmean(r[3] for r in run),
                                         statistics.fmean(r[4] for r in run)))
                start = i
    return Plan(budget, gpu, entries, {k: dict(v) for k, v in (variants or VARIANTS).items()})


# ------------------------------------------------------------------------------------------------
# Calibration and application
# ------------------------------------------------------------------------------------------------


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def gpu_timer(device: torch.device, reps: int = 5) -> Timer:
    """Median of ``reps`` single-call times on ``device``: CUDA events on a GPU, the host clock
    elsewhere."""
    def timer(name: str, fn: Callable[[], Any]) -> float:
        fn()  # warm: the first call of a kind validates and routes it
        if device.type != "cuda":
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        from ._timing import queued_ms

        return statistics.median(queued_ms(fn) for _ in range(reps))
    return timer


def calibrate(model: torch.nn.Module, run: Callable[[torch.nn.Module], Any], budget: float, *,
              variants: Mapping[str, Callable[..., Tensor]] | None = None,
              timer: Timer | None = None, repeats: int = 1) -> Plan:
    """Measure every SDPA call of ``run(model)`` (``repeats`` times, the step count restarting
    each time; errors and times averaged) under each variant and choose (see the module).
    ``variants``: name -> a function with SDPA's signature; default: :func:`native_variants`
    of the model's device, run as ``sageattn`` with :data:`VARIANTS`' options."""
    if not budget >= 0:
        raise ValueError(f"budget must be a non-negative error, got {budget!r}")
    device = _device_of(model)
    if variants is None:
        variants = {name: functools.partial(sageattn, **VARIANTS[name])
                    for name in native_variants(_plan.target_of(device))}
    timer = timer or gpu_timer(device)
    real = F.scaled_dot_product_attention
    measured: Measurements = {}
    tracker = _SiteTracker(model)

    def calibrating(*args: Any, **kwargs: Any) -> Tensor:
        exact = real(*args, **kwargs)
        site = tracker.site()
        if site is None:
            return exact
        runs = measured.setdefault((site, tracker.step), {})
        runs.setdefault(EXACT, []).append((0.0, timer(EXACT, lambda: real(*args, **kwargs))))
        for name, fn in variants.items():
            error = call_error(fn(*args, **kwargs), exact)
            runs.setdefault(name, []).append((error, timer(name, lambda: fn(*args, **kwargs))))
        return exact

    F.scaled_dot_product_attention = calibrating
    try:
        for _ in range(repeats):
            tracker.step = -1
            run(model)
    finally:
        F.scaled_dot_product_attention = real
        tracker.remove()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return choose(measured, budget, gpu)


class AppliedPlan:
    """What :func:`apply_plan` returns: a context manager; :meth:`remove` undoes it."""

    def __init__(self, model: torch.nn.Module, plan: Plan) -> None:
        self.plan = plan
        # Only the plan's site modules are tracked: a call made in the same modules as during
        # calibration finds its site (a module the plan does not name counts as its nearest
        # tracked ancestor).
        sites = {entry.site.rsplit("#", 1)[0] for entry in plan.entries}
        self._tracker = _SiteTracker(model, steps=any(e.steps is not None for e in plan.entries),
                                     only=sites)
        self._previous = F.scaled_dot_product_attention
        self.calls: dict[str, int] = {}  # variant (or "default") -> eager calls served

        by_site = plan._by_site()

        def planned(*args: Any, **kwargs: Any) -> Tensor:
            site = self._tracker.site()
            name = plan.variant_for(site, self._tracker.step if self._tracker.steps else 0, by_site)
            if not torch.compiler.is_compiling():  # (a count in a graph would specialize it)
                self.calls[name or "default"] = self.calls.get(name or "default", 0) + 1
            if name == EXACT:
                return self._previous(*args, **kwargs)
            return sageattn(*args, **kwargs, **(plan.variants[name] if name else {}))

        F.scaled_dot_product_attention = planned
        self._planned = planned

    def restart(self) -> None:
        """Count steps from 0 again (before each run of a pipeline)."""
        self._tracker.step = -1

    def remove(self) -> None:
        if F.scaled_dot_product_attention is self._planned:
            F.scaled_dot_product_attention = self._previous
        self._tracker.remove()

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_plan(model: torch.nn.Module, plan: Plan) -> AppliedPlan:
    """Make each call site of ``model`` run its variant of ``plan`` (exact SDPA, or ``sageattn``
    with the variant's options; unseen sites and steps: ``sageattn``'s default) until removed
    (``with apply_plan(model, plan): ...`` or ``.remove()``). Steps count from its
    application; ``.restart()`` before each further run of a pipeline."""
    return AppliedPlan(model, plan)
