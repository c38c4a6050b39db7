"""qk_quant="auto" and the measured crossover (sageattention2/_crossover.py, _tune.py): the
table's file, its interpolation and the class that stands for a call, which table a GPU uses,
the decision (exact SDPA without a warning where it is faster, the kernel where asked for), the
shipped H100 table, what ``tune`` writes (its timing fixed: no test depends on a measured speed),
and sageattn following a table written here on the GPU."""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import sageattention2
from helpers import DEFAULT_BUILD, ORIGINAL_SDPA, pretend_gpu, qkv, validated
from sageattention2 import _crossover, _execute, _plan, _tune
from sageattention2._crossover import CrossoverTable
from sageattention2.testing import cosine_similarity

N_Q, N_K, HEADS = (64, 1024, 16384), (77, 1024), (4, 64)


def grid(value: Any) -> list:
    """[n_q][n_k][heads] of ``value(i, j, h)``."""
    return [[[value(i, j, h) for h in range(len(HEADS))] for j in range(len(N_K))]
            for i in range(len(N_Q))]


def table_json(classes: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    # Speedup 2^(i + j + h - 2): below 1 at the small corner, above at the large one.
    speedup = grid(lambda i, j, h: 2.0 ** (i + j + h - 2))
    data = {
        "format": _crossover.FORMAT, "gpu": "NVIDIA Pretend GPU", "capability": [9, 0],
        "kernel": list(_plan.WGMMA), "measured": "2026-11-25, test",
        "axes": {"n_q": list(N_Q), "n_k": list(N_K), "heads": list(HEADS)},
        "classes": classes if classes is not None else [
            {"head_dim": d, "causal": c, "dtype": t, "speedup": speedup}
            for d in (40, 64, 80, 128) for c in (False, True) for t in ("float16",)],
    }
    data.update(fields)
    return data


def test_points_interpolation_and_clamping() -> None:
    table = CrossoverTable.from_json(table_json())
    at = table.speedup
    for i, n_q in enumerate(N_Q):
        for j, n_k in enumerate(N_K):
            for h, heads in enumerate(HEADS):
                assert at(64, False, torch.float16, n_q, n_k, heads) == pytest.approx(
                    2.0 ** (i + j + h - 2))
    # Geometric in log2 of each axis: halfway (in log2) between n_q 64 and 1024 is 256.
    assert at(64, False, torch.float16, 256, 77, 4) == pytest.approx(2.0 ** -1.5)
    assert at(64, False, torch.float16, 64, 77, 16) == pytest.approx(2.0 ** -1.5)
    # Clamped outside the grid.
    assert at(64, False, torch.float16, 1, 8, 1) == pytest.approx(0.25)
    assert at(64, False, torch.float16, 10 ** 6, 10 ** 6, 10 ** 4) == pytest.approx(4.0)


def test_untimed_points_take_fewer_heads() -> None:
    speedup = grid(lambda i, j, h: None if h == 1 else 0.5 + i + j)
    speedup[1][0][0] = None  # no time even with the fewest heads: the shorter query length's
    table = CrossoverTable.from_json(table_json(
        [{"head_dim": 64, "causal": False, "dtype": "float16", "speedup": speedup}]))
    assert table.speedup(64, False, torch.float16, 16384, 1024, 64) == pytest.approx(3.5)
    assert table.speedup(64, False, torch.float16, 1024, 77, 4) == pytest.approx(0.5)
    speedup[0][0][0] = None
    with pytest.raises(ValueError, match="no time"):
        CrossoverTable.from_json(table_json(
            [{"head_dim": 64, "causal": False, "dtype": "float16", "speedup": speedup}]))


@pytest.mark.parametrize("change, match", [
    (dict(format=99), "format 99"),
    (dict(axes={"n_q": [1, 2], "n_k": list(N_K), "heads": list(HEADS)}), "speedups for a 2x2x2"),
    (dict(classes=[{"head_dim": 64, "causal": False, "dtype": "float16",
                    "speedup": grid(lambda i, j, h: -1.0)}]), "not positive"),
])
def test_bad_tables_are_refused(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CrossoverTable.from_json(table_json(**change))


def test_the_class_that_stands_for_a_call() -> None:
    classes = [{"head_dim": d, "causal": c, "dtype": "bfloat16", "speedup": grid(lambda *_: 1.0)}
               for d in (40, 64, 80, 128) for c in (False,)]
    table = CrossoverTable.from_json(table_json(classes))
    stands = table.class_for
    assert stands(64, False, torch.bfloat16) == (64, False, "bfloat16")
    assert stands(128, False, torch.float16) == (128, False, "bfloat16")  # the other half type
    assert stands(48, False, torch.bfloat16) == (40, False, "bfloat16")   # zero-padded to 64
    assert stands(32, False, torch.bfloat16) == (40, False, "bfloat16")
    assert stands(96, False, torch.bfloat16) == (80, False, "bfloat16")   # zero-padded to 128
    assert stands(120, False, torch.bfloat16) == (80, False, "bfloat16")
    assert stands(64, True, torch.bfloat16) is None   # no causal class
    # Above every measured kernel head_dim (256: the Hopper kernel's FP8 tier), the largest
    # measured head_dim's points; above 256 nothing runs.
    assert stands(136, False, torch.bfloat16) == (128, False, "bfloat16")
    assert stands(256, False, torch.float16) == (128, False, "bfloat16")
    assert stands(264, False, torch.bfloat16) is None
    only_64 = CrossoverTable.from_json(table_json(classes[1:2]))
    assert only_64.class_for(40, False, torch.bfloat16) is None  # padded: not measured


def test_which_table_a_gpu_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    shipped.mkdir()
    monkeypatch.setattr(_crossover, "SHIPPED", shipped)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    _crossover.clear_cache()

    def write(path: Path, gpu: str, capability: list[int], kernel: Any = _plan.WGMMA) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table_json(gpu=gpu, capability=capability, kernel=list(kernel))))

    def used(setting: str | None, name: str, capability: tuple[int, int],
             choice: Any = None) -> str | None:
        _crossover.clear_cache()
        table = _crossover._table_for(setting, name, capability, choice)
        return None if table is None else f"{table.gpu} {table.kernel.pv}" if choice else table.gpu

    assert used(None, "NVIDIA H200", (9, 0)) is None  # nothing measured
    write(shipped / "nvidia-h100-80gb-hbm3.json", "NVIDIA H100 80GB HBM3", [9, 0])
    assert used(None, "NVIDIA H100 80GB HBM3", (9, 0)) == "NVIDIA H100 80GB HBM3"
    assert used(None, "NVIDIA H200", (9, 0)) == "NVIDIA H100 80GB HBM3"  # same capability
    assert used(None, "NVIDIA GeForce RTX 4090", (8, 9)) is None
    write(_crossover.user_dir() / "nvidia-h200.json", "NVIDIA H200", [9, 0])  # tune's
    assert used(None, "NVIDIA H200", (9, 0)) == "NVIDIA H200"
    assert used("off", "NVIDIA H200", (9, 0)) is None
    write(tmp_path / "mine.json", "mine", [9, 0])
    assert used(str(tmp_path / "mine.json"), "NVIDIA H200", (9, 0)) == "mine"
    assert _crossover.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    # The accurate tier's table: a file of its own, found for its choice only.
    accurate = _plan.WGMMA_INPUT
    assert _crossover.table_file("nvidia-h100-80gb-hbm3", accurate) == \
        "nvidia-h100-80gb-hbm3-wgmma-int8-input.json"
    assert used(None, "NVIDIA H100 80GB HBM3", (9, 0), accurate) is None  # not measured yet
    write(shipped / "nvidia-h100-80gb-hbm3-wgmma-int8-input.json", "NVIDIA H100 80GB HBM3", [9, 0],
          accurate)
    assert used(None, "NVIDIA H100 80GB HBM3", (9, 0), accurate) == "NVIDIA H100 80GB HBM3 input"
    assert used(None, "NVIDIA H200", (9, 0), accurate) == "NVIDIA H100 80GB HBM3 input"  # capability
    assert used(None, "NVIDIA H100 80GB HBM3", (9, 0), _plan.WGMMA) == "NVIDIA H100 80GB HBM3 fp8"
    assert used(None, "NVIDIA H100 80GB HBM3", (9, 0)) == "NVIDIA H100 80GB HBM3"
    # A named table serves its own choice; another choice is looked up as usual.
    assert used(str(tmp_path / "mine.json"), "NVIDIA H200", (9, 0), accurate) == \
        "NVIDIA H100 80GB HBM3 input"
    assert used("off", "NVIDIA H100 80GB HBM3", (9, 0), accurate) is None


@pytest.fixture
def pretend_h100_with_table(monkeypatch: pytest.MonkeyPatch) -> CrossoverTable:
    """CPU calls routed as on an H100 with the default build, and the test table."""
    table = CrossoverTable.from_json(table_json())
    pretend_gpu(monkeypatch, (9, 0), DEFAULT_BUILD)
    monkeypatch.setattr(_crossover, "table_for", lambda device, capability, choice=None: table)
    return table


@pytest.mark.parametrize("strict", [False, True])
def test_auto_runs_exact_sdpa_where_it_is_faster(pretend_h100_with_table: CrossoverTable,
                                                 strict: bool) -> None:
    """A shape the table says SDPA is faster at runs exact SDPA: the result is SDPA's, bit for
    bit, with no warning (not a fallback; strict does not refuse it); explain says why."""
    q, k, v = qkv(b=1, hq=4, nq=64, nk=77, d=64, dtype=torch.float16)
    expected = ORIGINAL_SDPA(q, k, v)
    for _ in range(2):  # the first call decides, the second reuses the decision
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(sageattention2.sageattn(q, k, v, strict=strict), expected)
    explanation = sageattention2.explain(q, k, v)
    assert not explanation.quantized and explanation.kernel == "exact SDPA"
    assert "exact SDPA is faster for this shape" in explanation.reason
    assert "0.25x" in explanation.reason and "NVIDIA Pretend GPU" in explanation.reason
    decision = _execute.decide(validated(q, k, v))
    assert decision.fallback is None and not decision.quantized


def test_calls_asking_for_the_lse_keep_the_kernel(pretend_h100_with_table: CrossoverTable) -> None:
    """SDPA returns no LSE: an exact call computes it in float64, slower than any kernel."""
    q, k, v = qkv(b=1, hq=4, nq=64, nk=77, d=64, dtype=torch.float16)
    assert not sageattention2.explain(q, k, v).quantized
    assert sageattention2.explain(q, k, v, return_lse=True).kernel == "attention_wgmma"


def test_auto_runs_the_kernel_where_it_is_faster(pretend_h100_with_table: CrossoverTable) -> None:
    big = torch.empty(1, 64, 16384, 128, dtype=torch.float16)
    assert sageattention2.explain(big, big, big) == (True, "attention_wgmma", "int8", "fp8", None)


def test_explicit_qk_quant_always_runs_the_kernel(pretend_h100_with_table: CrossoverTable) -> None:
    q, k, v = qkv(b=1, hq=4, nq=64, nk=77, d=64, dtype=torch.float16)
    assert sageattention2.explain(q, k, v, qk_quant="int8").kernel == "attention_wgmma"
    assert sageattention2.explain(q, k, v, qk_quant="int4").kernel == "attention_mma"


def test_a_table_of_another_kernel_does_not_decide(pretend_h100_with_table: CrossoverTable) -> None:
    """The table measured the Hopper kernel's FP8 tier: a call that options route to the
    warp-level kernel (here Q smoothed per head) or to the accurate tier (PV in the input dtype)
    is not decided by it."""
    q, k, v = qkv(b=1, hq=4, nq=64, nk=77, d=64, dtype=torch.float16)
    explanation = sageattention2.explain(q, k, v, pv_quant="none", smooth_q="head")
    assert explanation.quantized and explanation.kernel == "attention_mma"
    explanation = sageattention2.explain(q, k, v, pv_quant="none")
    assert explanation.quantized and explanation.kernel == "attention_wgmma"


def test_the_accurate_tiers_table_decides_its_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a table of the accurate tier (tune --pv-quant none), pv_quant="none" calls run exact
    SDPA where it says SDPA is faster; default calls are decided by the default table only."""
    tables = {_plan.WGMMA: CrossoverTable.from_json(table_json()),
              _plan.WGMMA_INPUT: CrossoverTable.from_json(table_json(
                  kernel=list(_plan.WGMMA_INPUT), gpu="NVIDIA Pretend GPU, accurate"))}
    pretend_gpu(monkeypatch, (9, 0), DEFAULT_BUILD)
    monkeypatch.setattr(_crossover, "table_for",
                        lambda device, capability, choice=None: tables.get(choice))
    q, k, v = qkv(b=1, hq=4, nq=64, nk=77, d=64, dtype=torch.float16)
    explanation = sageattention2.explain(q, k, v, pv_quant="none")
    assert not explanation.quantized and "accurate" in explanation.reason
    explanation = sageattention2.explain(q, k, v)
    assert not explanation.quantized and "accurate" not in explanation.reason


def test_a_fallback_is_still_a_fallback(pretend_h100_with_table: CrossoverTable) -> None:
    """Where the kernels cannot serve a call, the fallback's reason (and warning) wins."""
    q, k, v = qkv(b=1, hq=4, nq=64, nk=77, d=64, dtype=torch.float16)
    decision = _execute.decide(validated(q, k, v, dropout_p=0.5))
    assert decision.fallback is not None and decision.faster_exact is None


def test_json_layout_reads_back() -> None:
    data = table_json()
    text = _tune._dumps(data)
    assert json.loads(text) == data
    rows = [line for line in text.splitlines() if line.strip().startswith("[[")]
    assert len(rows) == len(N_Q) * len(data["classes"])  # one line per query length


def test_tune_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        _tune.tune()


def test_tune_keeps_the_base_tables_other_classes(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """tune --causal no --base SHIPPED: the non-causal classes re-measured (here a pretended
    GPU whose every point reads 1.5), the causal ones kept as they were; a base of another GPU
    or grid is refused. (The CLI passes --causal and --base through.)"""
    shipped = _crossover.SHIPPED / "nvidia-h100-80gb-hbm3.json"
    base = json.loads(shipped.read_text())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: base["gpu"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(_tune, "_kernel_choice", lambda dtype, pv_quant="auto": _plan.WGMMA)
    monkeypatch.setattr(_tune, "_warm_gpu", lambda: None)
    monkeypatch.setattr(_tune, "_point", lambda *a: 1.5)
    from sageattention2.__main__ import main

    out = tmp_path / "merged.json"
    assert main(["tune", "--head-dims", "64", "--dtypes", "float16", "--causal", "no",
                 "--base", str(shipped), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    key = lambda c: (c["head_dim"], c["causal"], c["dtype"])  # noqa: E731
    new = {key(c): c for c in merged["classes"]}
    assert set(new) == {key(c) for c in base["classes"]}
    assert {x for row in new[(64, False, "float16")]["speedup"] for cell in row for x in cell} == {1.5}
    assert all(new[key(c)] == c for c in base["classes"] if key(c) != (64, False, "float16"))
    assert f"{len(base['classes']) - 1} classes kept" in merged["measured"]
    with pytest.raises(ValueError, match="nothing to keep"):
        _tune.tune(axes=_tune.QUICK_AXES, head_dims=(64,), dtypes=("float16",), causal=(False,),
                   out=tmp_path / "other.json", base=shipped)


def test_tune_writes_what_it_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """tune on a small grid (axes given unsorted), on a pretended GPU whose timing is fixed
    (_point: a speedup made of the point's lengths and heads, so that each point's value is its
    own; the largest point not timed): the table it writes reads back with each value where its
    query length, key length and B*H put it (rounded to 3 decimals), the untimed point filled
    from fewer heads, of this GPU and the kernel the calls ran; the log counts the points where
    the kernel is faster."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Pretend GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(_tune, "_kernel_choice", lambda dtype, pv_quant="auto": _plan.WGMMA)
    monkeypatch.setattr(_tune, "_warm_gpu", lambda: None)

    def speedup(n_q: int, n_k: int, heads: int) -> float:
        return (3 * n_q + 5 * n_k + 7 * heads) / 10000 + 0.0004  # 0.0004: rounded away

    def point(n_q: int, n_k: int, heads: int, head_dim: int, causal: bool, dtype: torch.dtype,
              pv_quant: str = "auto") -> float | None:
        assert (head_dim, causal, dtype, pv_quant) == (64, False, torch.float16, "auto")
        return None if (n_q, n_k, heads) == (4096, 4096, 64) else speedup(n_q, n_k, heads)

    monkeypatch.setattr(_tune, "_point", point)
    lines: list[str] = []
    axes = {"n_q": (4096, 64), "n_k": (77, 4096, 512), "heads": (64, 4)}
    path = _tune.tune(axes=axes, head_dims=(64,), dtypes=("float16",), causal=(False,),
                      out=tmp_path / "table.json", log=lines.append)
    table = CrossoverTable.load(path)
    assert (table.gpu, table.capability, table.kernel) == ("NVIDIA Pretend GPU", (9, 0), _plan.WGMMA)
    assert (table.n_q, table.n_k, table.heads) == ((64, 4096), (77, 512, 4096), (4, 64))
    assert list(table.speedups) == [(64, False, "float16")]
    for n_q in table.n_q:
        for n_k in table.n_k:
            for heads in table.heads:
                timed = (n_q, n_k, heads) != (4096, 4096, 64)
                want = round(speedup(n_q, n_k, heads if timed else 4), 3)
                assert table.speedup(64, False, torch.float16, n_q, n_k, heads) == \
                    pytest.approx(want, rel=1e-12), (n_q, n_k, heads)
    wins = sum(speedup(a, b, h) >= 1 for a in table.n_q for b in table.n_k for h in table.heads
               if (a, b, h) != (4096, 4096, 64))
    assert 0 < wins < 11
    assert f"quantized faster at {wins} of 11 timed points" in lines[-1]


# ------------------------------------------------------------------------------------------------
# The shipped tables
# ------------------------------------------------------------------------------------------------

SHIPPED = sorted(_crossover.SHIPPED.glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_table(path: Path) -> None:
    """Each shipped table reads, is named for its GPU and the kernel it measured (the one a
    default call runs on its GPU, or the accurate tier's: _crossover.table_file), has a class
    for every head_dim and mask that tune measures (in one dtype at least: the other's calls
    take it), and agrees with what we know of the kernel: it wins at long sequences and loses
    on tiny calls."""
    table = CrossoverTable.load(path)
    assert table.kernel in (_plan.WGMMA, _plan.WGMMA_INPUT) and table.capability == (9, 0)
    slug = _crossover.gpu_slug(table.gpu)
    assert path.name == _crossover.table_file(slug, None if table.kernel == _plan.WGMMA else table.kernel)
    runs = [h for h in _tune.HEAD_DIMS
            if _plan.kernel_head_dim(h, _plan.head_dims_of(table.kernel)) is not None]
    assert runs and (table.kernel != _plan.WGMMA or runs == list(_tune.HEAD_DIMS))
    for head_dim in runs:
        for causal in (False, True):
            for dtype in _tune.DTYPES:
                key = table.class_for(head_dim, causal, getattr(torch, dtype))
                assert key is not None and key[:2] == (head_dim, causal)
    for key in table.speedups:
        head_dim, causal, dtype = key
        long = table.speedup(head_dim, causal, getattr(torch, dtype), 32768, 32768, 64)
        tiny = table.speedup(head_dim, causal, getattr(torch, dtype), 64, 128, 4)
        # (The accurate tier pays hd40's padding to 64 with 16-bit PV: its causal 32K calls
        # measured 0.96x there; and hd160 padded to 256 does 1.6x the work, more than the FP8
        # tier gains at 256: 0.95x at 32K, docs/DECISIONS.md#d40.)
        padded = _plan.kernel_head_dim(head_dim, _plan.head_dims_of(table.kernel))
        wins_long = padded == head_dim or (table.kernel == _plan.WGMMA and padded is not None and padded <= 128)
        assert (long > 1.0 or not wins_long) and tiny < 1.0, (key, long, tiny)


def test_an_h100_table_ships() -> None:
    assert any(path.stem.startswith("nvidia-h100") for path in SHIPPED)


# ------------------------------------------------------------------------------------------------
# On the GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_sageattn_follows_a_written_table_on_the_gpu(attention_kernel: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With a table written here for the kernel that default float16 calls run on this GPU
    (SAGEATTN_CROSSOVER names it; the test table's speedups, 2^(i + j + h - 2): SDPA 4x faster at
    the smallest point, the kernel 4x faster at the largest), each default call runs what the
    table says for its shape: exact SDPA's result, bit for bit, at 64 x 77 keys and 4 heads, the
    kernel at 16K x 1K and 64 heads; an explicit qk_quant runs the kernel at both. No measured
    time decides anything here (tune's measuring is the benchmarks' business)."""
    choice = _tune._kernel_choice(torch.float16)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table_json(
        gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
        kernel=list(choice))))
    monkeypatch.setenv(_crossover.ENVIRONMENT, str(path))
    _crossover.clear_cache()
    _execute.clear_call_cache()
    table = CrossoverTable.load(path)
    for (n_q, n_k, heads), quantized in (((64, 77, 4), False), ((16384, 1024, 64), True)):
        q = torch.randn(1, heads, n_q, 64, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(1, heads, n_k, 64, device="cuda", dtype=torch.float16)
                for _ in range(2))
        assert _execute.decide(validated(q, k, v)).choice == table.kernel
        assert table.speedup(64, False, torch.float16, n_q, n_k, heads) == \
            pytest.approx(4.0 if quantized else 0.25)
        explanation = sageattention2.explain(q, k, v)
        assert explanation.quantized == quantized, explanation
        assert quantized or "exact SDPA is faster" in explanation.reason
        assert sageattention2.explain(q, k, v, qk_quant="int8").quantized
        out = sageattention2.sageattn(q, k, v)
        want = ORIGINAL_SDPA(q, k, v)
        if quantized:
            assert cosine_similarity(out.float(), want.float()) >= 0.99
        else:
            assert torch.equal(out, want)


def test_tune_of_the_accurate_tier_writes_its_own_table(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """tune --pv-quant none measures the calls with pv_quant="none" and writes the table beside
    the default one (its own file), where sageattn looks it up for that choice; a head_dim that
    tier does not run (256) is not measured."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Pretend GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    asked: list[str] = []

    def choice(dtype: torch.dtype, pv_quant: str = "auto") -> Any:
        asked.append(pv_quant)
        return _plan.WGMMA_INPUT if pv_quant == "none" else _plan.WGMMA

    points: list[str] = []
    monkeypatch.setattr(_tune, "_kernel_choice", choice)
    monkeypatch.setattr(_tune, "_warm_gpu", lambda: None)
    monkeypatch.setattr(_tune, "_point", lambda *a: points.append(a[-1]) or 0.5)
    from sageattention2.__main__ import main

    assert main(["tune", "--quick", "--head-dims", "64,256", "--dtypes", "float16", "--causal", "no",
                 "--pv-quant", "none"]) == 0
    assert "not measured: head_dim 256" in capsys.readouterr().out  # 16-bit PV stops at 128
    written = _crossover.user_dir() / "nvidia-pretend-gpu-wgmma-int8-input.json"
    assert asked == ["none"] and set(points) == {"none"}
    table = CrossoverTable.load(written)
    assert table.kernel == _plan.WGMMA_INPUT
    assert {key[0] for key in table.speedups} == {64}
    assert not (_crossover.user_dir() / "nvidia-pretend-gpu.json").exists()
    _crossover.clear_cache()
    assert _crossover._table_for(None, "NVIDIA Pretend GPU", (9, 0), _plan.WGMMA_INPUT) == table
    default = _crossover._table_for(None, "NVIDIA Pretend GPU", (9, 0), _plan.WGMMA)
    assert default is not None and default.kernel == _plan.WGMMA  # the shipped sm_90 table
    _crossover.clear_cache()
