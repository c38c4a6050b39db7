"""``python -m sageattention2 calibrate``: the adaptive plan (``adaptive``) of a model of the
suite (``_model_suite``: published configs, random weights), at one or more budgets, and the
whole forward under each choice side by side:

    python -m sageattention2 calibrate --model wan --budget 0.003 0.01 [--steps 1] [--out DIR]

Rows: every call exact SDPA, every call the 8-bit kernel (INT8 QK + FP8 PV where this GPU has
it), every call the accurate tier (INT8 QK + FP16/BF16 PV), and the plan at each budget: time
of ``--steps`` forwards (median of --reps), speed-up over exact, the error of the model's output
against the exact one (``adaptive.call_error``), and for a plan how many sites (x steps) each
variant has. Writes
``plan_<model>_<budget>.json`` per budget and ``calibrate_<model>.md`` to --out.
"""
from __future__ import annotations

import contextlib
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from . import _model_suite, adaptive
from ._bench_models import Clock, first_tensor, markdown_table
from .integrations import patch_sdpa


def run(key: str, budgets: Sequence[float], steps: int, reps: int, device: torch.device,
        tiny: bool, out: Path | None) -> list[dict[str, Any]]:
    case = next(c for c in _model_suite.CASES if c.key == key)
    dtype = case.dtype if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model, inputs = case.build(device, dtype, tiny)

    def forwards(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(steps):
                result = first_tensor(m(**inputs))
        return result

    return compare(key, f"{case.name}, {steps} forward(s) per run", model, forwards, budgets, reps,
                   device, out)


def compare(key: str, title: str, model: torch.nn.Module, forwards: Callable[[torch.nn.Module], Tensor],
            budgets: Sequence[float], reps: int, device: torch.device,
            out: Path | None) -> list[dict[str, Any]]:
    """The table of ``run`` for any model whose attention calls reach
    F.scaled_dot_product_attention: ``forwards(model)`` runs it and returns the output compared."""
    clock = Clock(device)
    plans = {budget: adaptive.calibrate(model, forwards, budget) for budget in budgets}
    configurations: list[tuple[str, Callable[[], Any]]] = [
        ("all exact SDPA", contextlib.nullcontext),
        ("all 8-bit (INT8 QK + FP8 PV)", lambda: patch_sdpa(qk_quant="int8", pv_quant="fp8")),
        ("all accurate (INT8 QK + FP16 PV)", lambda: patch_sdpa(qk_quant="int8", pv_quant="none")),
        *((f"plan, budget {budget:g}", lambda p=plan: adaptive.apply_plan(model, p))
          for budget, plan in plans.items()),
    ]
    exact = forwards(model)
    rows = []
    for name, context in configurations:
        with context() as applied:
            got = forwards(model)
            times = []
            for _ in range(reps):
                if isinstance(applied, adaptive.AppliedPlan):
                    applied.restart()
                times.append(clock.ms(lambda: forwards(model)))
        served = applied.plan.summary() if isinstance(applied, adaptive.AppliedPlan) else {}
        rows.append(dict(configuration=name, ms=statistics.median(times),
                         error=adaptive.call_error(got, exact), served=served))
    for row in rows:
        row["speedup"] = rows[0]["ms"] / row["ms"]
    table = markdown_table(
        ["configuration", "ms", "speed-up over exact", "output error vs exact", "plan: sites per variant"],
        [(r["configuration"], f"{r['ms']:.2f}", f"{r['speedup']:.3f}x", f"{r['error']:.2e}",
          ", ".join(f"{k} {v}" for k, v in sorted(r["served"].items())) or "")
         for r in rows],
        f"{title}; error: {adaptive.ERROR}")
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"calibrate_{key}.md").write_text(table + "\n")
        for budget, plan in plans.items():
            print(f"wrote {plan.save(out / f'plan_{key}_{budget:g}.json')}")
    return rows
