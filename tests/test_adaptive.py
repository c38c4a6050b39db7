"""The adaptive plan (sageattention2/adaptive.py, issue 36 item 3): call sites and steps, the
choice within a budget, the plan file, applying it; variants emulated on the CPU
(sageattention2.reference) with set times, and the real kernels on the GPU."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sageattention2 import _plan, adaptive, reference
from sageattention2.adaptive import EXACT, Plan, PlanEntry

SDPA = F.scaled_dot_product_attention  # (calibrate and apply_plan replace F's while they run)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, outliers: bool = False, calls: int = 1) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.heads, self.outliers, self.calls = heads, outliers, calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.outliers:  # per-token channel outliers, as the outlier family of docs/PROTOCOL.md
            spikes = torch.zeros_like(q)
            spikes[..., ::7, 3] = 10.0
            q, k = q + spikes, k - spikes
        out = sum(F.scaled_dot_product_attention(q, k, v) for _ in range(self.calls))
        return x + out.transpose(1, 2).reshape(b, n, -1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Attention(64, 1), Attention(64, 1, outliers=True),
                                     Attention(64, 1, calls=2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def emulated(qk: str, pv: str) -> Any:
    def variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return reference.sage_attention_reference(q, k, v, qk_dtype=qk, pv_dtype=pv).to(q.dtype)
    return variant


VARIANTS = {"int4+fp8": emulated("int4", "e4m3"), "int8+fp16": emulated("int8", "fp16")}
TIMES = {"int4+fp8": 1.0, "int8+fp16": 2.0, EXACT: 3.0}


def timer(name: str, fn: Any) -> float:
    return TIMES[name]


def calibrated(budget: float, runs: int = 1) -> Plan:
    model = Model()
    x = torch.randn(1, 128, 64)

    def run(m: nn.Module) -> None:
        with torch.no_grad():
            for _ in range(runs):
                m(x)
    return adaptive.calibrate(model, run, budget, variants=VARIANTS, timer=timer)


def test_sites_are_module_paths_and_call_indices() -> None:
    plan = calibrated(budget=1.0)
    assert sorted(e.site for e in plan.entries) == ["layers.0#0", "layers.1#0", "layers.2#0", "layers.2#1"]
    assert all(e.steps is None for e in plan.entries)  # one forward: every step
    assert all(e.variant == "int4+fp8" and e.time_ms == 1.0 and e.exact_ms == 3.0 for e in plan.entries)


def test_the_outlier_layer_gets_the_accurate_variant() -> None:
    """INT4 QK cannot represent the outlier layer's channels (error 0.24 against 0.05 on the
    others; INT8 QK 0.012); within a 0.1 budget that site runs INT8 QK, every other site INT4."""
    plan = calibrated(budget=0.1)
    picks = {e.site: e.variant for e in plan.entries}
    assert picks == {"layers.0#0": "int4+fp8", "layers.1#0": "int8+fp16", "layers.2#0": "int4+fp8",
                     "layers.2#1": "int4+fp8"}
    assert all(e.error <= 0.1 for e in plan.entries)
    strict = calibrated(budget=0.0)  # nothing quantized is error-free
    assert {e.variant for e in strict.entries} == {EXACT}


def test_steps_become_ranges() -> None:
    """Three forwards per run (a denoising loop): sites get step ranges; a step the calibration
    did not see gets no variant (the default runs)."""
    plan = calibrated(budget=0.1, runs=3)
    layer1 = [e for e in plan.entries if e.site == "layers.1#0"]
    assert len(layer1) == 1 and layer1[0].steps == (0, 2) and layer1[0].variant == "int8+fp16"
    assert plan.variant_for("layers.1#0", 2) == "int8+fp16"
    assert plan.variant_for("layers.1#0", 3) is None
    assert plan.variant_for("elsewhere#0", 0) is None
    assert plan.summary() == {"int4+fp8": 9, "int8+fp16": 3}


def test_choice_per_step() -> None:
    """A site whose first and last steps cannot take the fast variant (a diffusion model's
    early and late steps, say) gets a range per run of steps with one variant."""
    measured = {("a#0", step): {EXACT: [(0.0, 3.0)], "int4+fp8": [(error, 1.0)],
                                "int8+fp16": [(0.01, 2.0)]}
                for step, error in ((0, 0.5), (1, 0.02), (2, 0.04), (3, 0.3))}
    plan = adaptive.choose(measured, 0.05, "test")
    assert [(e.steps, e.variant, e.error) for e in plan.entries] == [
        ((0, 0), "int8+fp16", 0.01), ((1, 2), "int4+fp8", 0.04), ((3, 3), "int8+fp16", 0.01)]
    assert plan.entries[1].time_ms == 1.0 and plan.entries[1].exact_ms == 3.0


def test_plan_file_round_trip(tmp_path: Any) -> None:
    plan = calibrated(budget=0.1, runs=2)
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.entries == [PlanEntry(e.site, e.steps, e.variant, round(e.error, 6), e.time_ms, e.exact_ms)
                             for e in plan.entries]
    assert again.budget == 0.1 and again.variants == plan.variants
    bad = plan.to_json()
    bad["entries"][0]["variant"] = "int2"
    with pytest.raises(ValueError, match="int2"):
        Plan.from_json(bad)
    with pytest.raises(ValueError, match="format"):
        Plan.from_json({**plan.to_json(), "format": 99})
    with pytest.raises(ValueError, match="budget"):
        adaptive.calibrate(Model(), lambda m: None, -1.0)


def test_apply_plan_runs_each_sites_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = Plan(0.05, "cpu", [PlanEntry("layers.0#0", None, EXACT, 0, 1, 1),
                              PlanEntry("layers.1#0", None, "int8+fp16", 0, 1, 1),
                              PlanEntry("layers.2#1", (0, 0), "int4+fp8", 0, 1, 1)])
    seen: list[dict[str, Any]] = []
    real = F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append({k: v for k, v in kwargs.items() if k in ("qk_quant", "pv_quant")})
        return real(*args)

    monkeypatch.setattr(adaptive, "sageattn", recording)
    model, x = Model(), torch.randn(1, 128, 64)
    with torch.no_grad():
        want = model(x)
        with adaptive.apply_plan(model, plan) as applied:
            got = model(x)
            model(x)  # step 1: layers.2#1's range has ended
    assert F.scaled_dot_product_attention is real
    torch.testing.assert_close(got, want)
    # step 0: layers.0 exact (not through sageattn), layers.1 int8+fp16, layers.2#0 unseen
    # (default), layers.2#1 int4; step 1: the same but layers.2#1 default
    assert seen == [dict(qk_quant="int8", pv_quant="none"), {}, dict(qk_quant="int4", pv_quant="fp8"),
                    dict(qk_quant="int8", pv_quant="none"), {}, {}]
    assert applied.calls == {EXACT: 2, "int8+fp16": 2, "default": 3, "int4+fp8": 1}


def test_restart_counts_steps_from_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan with step ranges, applied: steps count the model's forwards from the application;
    after .restart() (a pipeline's next run) the next forward is step 0 again, and runs step 0's
    variants."""
    plan = Plan(0.05, "cpu", [PlanEntry("layers.1#0", (0, 0), "int8+fp16", 0, 1, 1),
                              PlanEntry("layers.1#0", (1, 1), "int4+fp8", 0, 1, 1)])
    seen: list[str] = []
    real = F.scaled_dot_product_attention

    def recording(*args: Any, qk_quant: str = "auto", pv_quant: str = "auto", **kwargs: Any) -> torch.Tensor:
        seen.append(f"{qk_quant}+{pv_quant}")
        return real(*args, **kwargs)

    monkeypatch.setattr(adaptive, "sageattn", recording)
    model, x = Model(), torch.randn(1, 16, 64)
    with torch.no_grad(), adaptive.apply_plan(model, plan) as applied:
        model(x)
        model(x)
        model(x)  # step 2: no entry (the default)
        applied.restart()
        model(x)
        model(x)
    layer1 = seen[1::4]  # each forward: layers.0 (default), layers.1, layers.2 twice
    assert layer1 == ["int8+none", "int4+fp8", "auto+auto", "int8+none", "int4+fp8"]


def test_calibrate_repeats() -> None:
    """calibrate(repeats=2) runs ``run`` twice, the step count restarting each time (two
    forwards per run: steps 0 and 1, not 0 to 3), every call measured under every variant each
    time (the timer asked once per variant, site, step and repeat), and the plan takes the mean
    of the repeats' errors: a variant exact in the first repeat and off by e in the second has
    error e / 2 (and a budget of 0 keeps exact SDPA)."""
    timed: list[str] = []
    errors: list[float] = []

    def noisy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Exact in the first repeat (its 8 calls: 2 forwards x 4 sites), noisy in the second."""
        out = SDPA(q, k, v)
        if len(errors) >= 8:
            out = out + 0.05 * torch.randn(out.shape, generator=torch.Generator().manual_seed(len(errors)))
        errors.append(adaptive.call_error(out, SDPA(q, k, v)))
        return out

    def timing(name: str, fn: Any) -> float:
        timed.append(name)
        return {"noisy": 1.0, EXACT: 3.0}[name]

    model, x = Model(), torch.randn(1, 32, 64)

    def run(m: nn.Module) -> None:
        with torch.no_grad():
            m(x)
            m(x)

    plans = {}
    for budget in (0.0, 1.0):
        errors.clear()
        timed.clear()
        plans[budget] = adaptive.calibrate(model, run, budget, variants={"noisy": noisy},
                                           timer=timing, repeats=2)
        assert len(errors) == 16 and max(errors[:8]) < 1e-12 and min(errors[8:]) > 1e-3
        assert timed.count(EXACT) == timed.count("noisy") == 16
    sites = ["layers.0#0", "layers.1#0", "layers.2#0", "layers.2#1"]
    calls = [(site, step) for step in (0, 1) for site in sites]  # in the order run makes them
    mean = {call: (first + second) / 2 for call, first, second in zip(calls, errors[:8], errors[8:])}
    plan = plans[1.0]
    # (one variant at both steps: one range per site, with the larger of its steps' errors)
    assert sorted((e.site, e.steps, e.variant) for e in plan.entries) == [
        (site, (0, 1), "noisy") for site in sites]
    for e in plan.entries:
        assert e.error == pytest.approx(max(mean[e.site, 0], mean[e.site, 1]), rel=1e-9), e
    assert {e.variant for e in plans[0.0].entries} == {EXACT}


def test_a_plan_for_every_step_compiles_as_one_graph() -> None:
    """torch.compile(fullgraph=True) of a planned model: one graph for ten forwards, each site's
    variant fixed in it (exact SDPA, the sageattn op with the variant's options, the default)."""
    plan = Plan(0.1, "cpu", [PlanEntry("layers.0#0", None, EXACT, 0, 1, 1),
                             PlanEntry("layers.1#0", None, "int8+fp16", 0, 1, 1)])
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    model, x = Model(), torch.randn(1, 128, 64)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(x)
        with adaptive.apply_plan(model, plan):
            compiled = torch.compile(model, backend=backend, fullgraph=True)
            for _ in range(10):
                got = compiled(x)
    torch.testing.assert_close(got, want)
    assert len(graphs) == 1
    attention = [(str(n.target), n.args[9:11] if "sageattn" in str(n.target) else None)
                 for n in graphs[0].graph.nodes if n.op == "call_function"
                 and ("sageattn" in str(n.target) or "scaled_dot_product" in str(n.target))]
    assert attention == [("<built-in function scaled_dot_product_attention>", None),
                         ("sageattention2.sageattn", ("int8", "none")),
                         ("sageattention2.sageattn", ("auto", "auto")),
                         ("sageattention2.sageattn", ("auto", "auto"))]


def test_cli_calibrate(tmp_path: Any) -> None:
    """python -m sageattention2 calibrate on a tiny suite model (CPU: every variant falls back
    to exact SDPA, so every plan is exact): the plans load, the table is written."""
    pytest.importorskip("transformers")
    from sageattention2.__main__ import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["calibrate", "--model", "bert", "--tiny", "--device", "cpu", "--reps", "1",
                     "--budget", "0.01", "--out", str(tmp_path)]) == 0
    plan = Plan.load(tmp_path / "plan_bert_0.01.json")
    assert plan.budget == 0.01 and plan.entries and {e.variant for e in plan.entries} == {EXACT}
    assert "plan, budget 0.01" in (tmp_path / "calibrate_bert.md").read_text()
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", "bert", "--budget", "-1"])


def test_native_variants() -> None:
    """No emulated variant is offered for speed: INT4 (and FP8 mma.sync) only where native."""
    assert adaptive.native_variants(_plan.default_build_target((9, 0))) == ["int8+fp16", "int8+fp8"]
    assert adaptive.native_variants(_plan.default_build_target((8, 9))) == [
        "int8+fp16", "int8+fp8", "int4+fp8"]
    assert adaptive.native_variants(_plan.default_build_target((8, 0))) == ["int8+fp16"]
    assert adaptive.native_variants(_plan.target_of(torch.device("cpu"))) == []


@pytest.mark.gpu
def test_calibrate_on_the_gpu(attention_kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real variants of this GPU (adaptive.native_variants), measured by calibrate with set
    times (each quantized variant faster than exact SDPA, the fastest the last native one; real
    times would make a plan of this small model depend on the GPU's speed, and a plan of exact
    SDPA everywhere proves nothing when applied): within a loose budget every site takes the
    fastest variant, with its measured error; at budget 0 every site keeps exact SDPA. Applied,
    the loose plan runs that variant at every site: the plan's counter, the quantized kernel's
    op called once per site (no fallback to exact SDPA, no warning), and the output differs
    from the exact model's by less than the error the plan allows."""
    from sageattention2 import ops
    from sageattention2.api import SageAttentionFallbackWarning

    model = Model().cuda().half()
    x = torch.randn(1, 2048, 64, device="cuda", dtype=torch.float16)
    offered = adaptive.native_variants(_plan.target_of(x.device))
    assert offered, "the attention kernel runs here: INT8 QK at least"
    times = {EXACT: 10.0, **{name: 5.0 - i for i, name in enumerate(offered)}}  # the last fastest

    def run(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(x)
    launches: list[str] = []
    for name in ("sageattn_wgmma", "sageattn_mma"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name, **kw:
                            launches.append(_name) or _real(*a, **kw))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loose = adaptive.calibrate(model, run, budget=0.5, timer=lambda name, fn: times[name])
        tight = adaptive.calibrate(model, run, budget=0.0, timer=lambda name, fn: times[name])
        want = run(model)
        launches.clear()
        with adaptive.apply_plan(model, loose) as applied:
            got = run(model)
    assert {e.variant for e in tight.entries} == {EXACT}
    sites = ["layers.0#0", "layers.1#0", "layers.2#0", "layers.2#1"]
    assert sorted((e.site, e.variant) for e in loose.entries) == [(s, offered[-1]) for s in sites]
    assert all(0 < e.error <= 0.5 and e.time_ms == times[offered[-1]] for e in loose.entries)
    assert applied.calls == {offered[-1]: 4}
    assert len(launches) == 4, launches
    assert not [w for w in record if issubclass(w.category, SageAttentionFallbackWarning)]
    assert not torch.equal(got, want)
    assert adaptive.call_error(got, want) < 0.05
