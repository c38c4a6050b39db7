"""Where a suite model's forward spends its GPU time, under default SDPA and under sageattn.

    python scripts/profile_model.py wan [--reps 3] [--top 25]

One forward of a model of the suite (``sageattention2._model_suite``) under torch.profiler, once
per side: each kernel's total time per forward (the mean of --reps profiled forwards), the two
sides' totals side by side, the SDPA calls the forward makes (shapes, strides, what sageattn runs
for each). The difference between the sides is where a speedup goes or comes from.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from sageattention2 import _bench_models, _model_suite
from sageattention2.api import explain
from sageattention2.integrations import patch_sdpa


def kernel_times(forward: Any, reps: int) -> tuple[dict[str, float], float]:
    """Per kernel name and per op that launched GPU work ("op: name", the op's own GPU time),
    GPU ms per forward; and the forward's wall ms (synchronized)."""
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            forward()
        end.record()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:90]] += event.device_time_total / 1e3 / reps
    for op in prof.key_averages():
        if op.self_device_time_total > 0 and op.device_type != torch.autograd.DeviceType.CUDA:
            times["op: " + op.key[:86]] += op.self_device_time_total / 1e3 / reps
    return times, start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=[case.key for case in _model_suite.CASES])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    case = next(case for case in _model_suite.CASES if case.key == args.model)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model, inputs = case.build(device, case.dtype, False)

    def forward() -> Any:
        return model(**inputs)

    with torch.inference_mode():
        calls: list[Any] = []
        with _bench_models.recording_sdpa(calls):
            forward()
        print(f"{case.name}: {len(calls)} SDPA calls per forward")
        seen: collections.Counter[tuple[Any, ...]] = collections.Counter(
            _bench_models.signature(a, k) for a, k in calls)
        for (a, k) in {(_bench_models.signature(a, k)): (a, k) for a, k in calls}.values():
            named = dict(zip(("query", "key"), a)) | k  # diffusers' dispatcher passes keywords
            q, key = named["query"], named["key"]
            plan = explain(*a, **k)
            print(f"  x{seen[_bench_models.signature(a, k)]} q {tuple(q.shape)} stride {q.stride()} "
                  f"k {tuple(key.shape)} mask={k.get('attn_mask') is not None or len(a) > 3} "
                  f"causal={k.get('is_causal', False)}: "
                  f"{plan}")
        sides = {}
        for name, patch in (("sdpa", contextlib.nullcontext), ("sageattn", patch_sdpa)):
            with patch():
                forward()
                torch.cuda.synchronize()
                sides[name] = kernel_times(forward, args.reps)
    (sdpa, sdpa_wall), (sage, sage_wall) = sides["sdpa"], sides["sageattn"]
    for title, ops in (("kernel", False), ("op (its own GPU time)", True)):
        names = sorted((n for n in set(sdpa) | set(sage) if n.startswith("op: ") == ops),
                       key=lambda n: -max(sdpa.get(n, 0), sage.get(n, 0)))
        print(f"\n| {title} | sdpa ms | sageattn ms |\n|---|---|---|")
        for n in names[:args.top]:
            print(f"| {n} | {sdpa.get(n, 0):.3f} | {sage.get(n, 0):.3f} |")
        rest = names[args.top:]
        print(f"| (other {len(rest)}) | {sum(sdpa.get(n, 0) for n in rest):.3f} | "
              f"{sum(sage.get(n, 0) for n in rest):.3f} |")
        print(f"| **GPU total** | {sum(sdpa.get(n, 0) for n in names):.3f} | "
              f"{sum(sage.get(n, 0) for n in names):.3f} |")
    print(f"\nwall per forward: sdpa {sdpa_wall:.3f} ms, sageattn {sage_wall:.3f} ms "
          f"({sdpa_wall / sage_wall:.3f}x)")


if __name__ == "__main__":
    main()
