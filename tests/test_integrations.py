"""sageattn in code written against SDPA (assigned to it, patch_sdpa), the public names and the
command line."""
from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import sageattention2
from helpers import ORIGINAL_SDPA, fallback_warnings, qkv
from sageattention2 import SageAttentionFallbackWarning, _plan, api, sageattn
from sageattention2 import integrations
from sageattention2.integrations import patch_sdpa

# ------------------------------------------------------------------------------------------------
# SDPA monkeypatching
# ------------------------------------------------------------------------------------------------


def test_assigning_sageattn_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv(hkv=2, nq=5, nk=7)
    expected = ORIGINAL_SDPA(q, k, v, None, 0.0, True, enable_gqa=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sageattn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        # The fallback must reach the real SDPA, not recurse into the patched name.
        out = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, enable_gqa=True)
    assert torch.equal(out, expected)


def test_patch_sdpa_routes_and_restores() -> None:
    q, k, v = qkv()
    with patch_sdpa(qk_quant="int8", smooth_q="block") as patched:
        assert F.scaled_dot_product_attention is patched
        assert torch.nn.functional.scaled_dot_product_attention is patched
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert len(fallback_warnings(record)) == 1  # it went through sageattn
        assert torch.equal(out, ORIGINAL_SDPA(q, k, v, is_causal=True))
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_patch_sdpa_reaches_torch_modules() -> None:
    """nn.MultiheadAttention looks SDPA up in torch.nn.functional at call time."""
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with patch_sdpa(strict=True), pytest.raises(NotImplementedError, match="strict=True"):
        mha(x, x, x, need_weights=False)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    mha(x, x, x, need_weights=False)


def test_patch_sdpa_restores_on_error_and_nests() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with patch_sdpa():
            with patch_sdpa(strict=True) as inner:
                assert F.scaled_dot_product_attention is inner
                raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


@pytest.mark.parametrize("kwargs", [dict(tensor_layout="NHD"), dict(return_lse=True),
                                    dict(bogus=1)])
def test_patch_sdpa_rejects_incompatible_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match=f"unsupported keyword.*{next(iter(kwargs))}"):
        with patch_sdpa(**kwargs):
            pass
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


# ------------------------------------------------------------------------------------------------
# kernel_plan, build info, CLI
# ------------------------------------------------------------------------------------------------


def test_public_api() -> None:
    assert set(sageattention2.__all__) == {
        "Explanation", "Plan", "SageAttentionFallbackWarning", "__version__", "apply_plan",
        "calibrate", "explain", "kernel_plan", "sageattn", "sageattn_varlen"}
    assert issubclass(SageAttentionFallbackWarning, UserWarning)
    assert isinstance(sageattention2.__version__, str)
    # sageattention2.api: what scripts and benchmarks import from it, and the warning's name.
    assert set(api.__all__) == {"AttentionCall", "Explanation", "SageAttentionFallbackWarning",
                                "explain", "kernel_plan", "sageattn"}
    assert callable(api.smoothing_sample_stride) and callable(api.kernel_plan)
    assert SageAttentionFallbackWarning.__module__ == "sageattention2.api"
    assert str(inspect.signature(sageattn)) == (
        "(query: 'Tensor', key: 'Tensor', value: 'Tensor', attn_mask: 'Tensor | None' = None, dropout_p: "
        "'float' = 0.0, is_causal: 'bool' = False, scale: 'float | None' = None, enable_gqa: "
        "'bool' = False, *, tensor_layout: 'TensorLayout' = 'HND', qk_quant: 'QKQuant' = "
        "'auto', pv_quant: 'PVQuant' = 'auto', smooth_k: 'bool' = True, smooth_q: 'SmoothQ' = "
        "'auto', smooth_v: 'SmoothV' = 'auto', return_lse: 'bool' = False, strict: 'bool' = False, "
        "causal_alignment: 'CausalAlignment' = 'top_left') -> 'Tensor | tuple[Tensor, Tensor]'")
    # The graph op that torch.compile traces (graphs saved by torch.export name it).
    assert str(torch.ops.sageattention2.sageattn.default._schema) == (
        "sageattention2::sageattn(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float "
        "dropout_p, bool is_causal, float? scale, bool enable_gqa, str tensor_layout, str "
        "qk_quant, str pv_quant, bool smooth_k, str smooth_q, bool smooth_v, bool return_lse, "
        "bool strict, str causal_alignment) -> (Tensor, Tensor)")


def run_cli(*args: str, cwd: Path) -> str:
    """``python -m sageattention2 *args`` of the package under test (conftest.py's choice), run
    from ``cwd``, so that no other copy shadows it; its stdout."""
    package_root = str(Path(sageattention2.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = subprocess.run([sys.executable, "-m", "sageattention2", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_cli_info(tmp_path: Path) -> None:
    text = run_cli("info", cwd=tmp_path)
    assert f"sageattention2 {sageattention2.__version__}" in text
    assert f"torch {torch.__version__}" in text
    assert "extension: " in text and "GPU: " in text
    assert f"sageattn plan: {sageattention2.kernel_plan()}" in text  # the package under test, here
    if not torch.cuda.is_available():
        assert "GPU: no CUDA GPU" in text


def test_a_checkout_without_a_build_uses_the_installed_one(tmp_path: Path) -> None:
    """The README's main job runs in the checkout's root, where ``python -m sageattention2``
    imports the source folder (no compiled extension there): it loads the installed build of the
    same sources, and where the sources differ it says what to do."""
    import importlib.metadata

    from sageattention2 import ops

    try:
        files = importlib.metadata.distribution("sageattention2").files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sageattention2 is not installed")
    if not any(f.name.startswith("_C.") and f.parent.name == "sageattention2" for f in files):
        pytest.skip("the installed sageattention2 has no compiled extension")
    package = Path(sageattention2.__file__).resolve().parent
    installed = Path(str(importlib.metadata.distribution("sageattention2").locate_file(
        "sageattention2"))).resolve()
    if ops._python_sources(installed) != ops._python_sources(package):
        pytest.skip("the installed sageattention2 is not these sources (a stale install)")
    checkout = tmp_path / "sageattention2"
    shutil.copytree(package, checkout, ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    # What `pip install .` leaves in the checkout's root, found there before the installed
    # metadata (session 40's first run on the GPU read it and found no extension).
    egg_info = tmp_path / "sageattention2.egg-info"
    egg_info.mkdir()
    (egg_info / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: sageattention2\n"
                                       f"Version: {sageattention2.__version__}\n")
    (egg_info / "SOURCES.txt").write_text("setup.py\nsageattention2/__init__.py\n")

    def extension_from_the_checkout() -> str:
        # cwd first on sys.path, as `python -m` from the checkout's root; not PYTHONPATH
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-c", (
            "import sageattention2, sageattention2.ops as o; "
            "print(sageattention2.__file__); print(o.HAS_EXTENSION); print(o.EXTENSION_ERROR)")],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    printed = extension_from_the_checkout().splitlines()
    assert printed[0] == str(checkout / "__init__.py") and printed[1] == "True", printed
    with open(checkout / "api.py", "a") as sources:
        sources.write("# edited\n")
    printed = extension_from_the_checkout().splitlines()
    assert printed[1] == "False" and "other Python sources" in printed[2], printed
    assert "pip install --no-build-isolation ." in printed[2], printed


def test_cli_routing_table(tmp_path: Path) -> None:
    """``python -m sageattention2 routing-table`` prints README.md's routing table."""
    assert run_cli("routing-table", cwd=tmp_path) == _plan.routing_table_markdown() + "\n"


def recorder(monkeypatch: pytest.MonkeyPatch, module: Any, returns: Any = None,
             name: str = "run", calls: list[tuple[str, dict[str, Any]]] | None = None,
             ) -> list[tuple[str, dict[str, Any]]]:
    """Replace ``module.<name>`` (what a CLI command runs) by a recorder of its arguments, bound
    by name to the real function's signature (defaults filled in), so that a test sees what the
    command passed however it passes it; each call returns ``returns``. Returns the list of
    (module name, arguments) it appends to: ``calls`` when given (one record of the order in
    which several functions ran)."""
    real = getattr(module, name)
    signature = inspect.signature(real)
    calls = [] if calls is None else calls

    def record(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append((module.__name__, dict(bound.arguments)))
        return returns

    record.__signature__ = signature  # type: ignore[attr-defined]  (a recorder of it binds alike)
    monkeypatch.setattr(module, name, record)
    return calls


def test_cli_bench_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """``_bench_models.run`` (``bench --models KEY... --tiny``) on the CPU, its clock fixed (4 ms a
    forward under default SDPA, 2 ms under sageattn, 1 ms of attention): a row per model with
    those times, their speedup (2x) and attention share (25 %), every output at cosine 1 on the
    CPU (the exact path), the table and chart written; unknown names refused. No measured time
    decides anything here (the timing itself is the benchmarks' business)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from sageattention2 import _bench_models

    def fixed_ms(clock: Any, fn: Any) -> float:
        fn()
        return 4.0 if F.scaled_dot_product_attention is ORIGINAL_SDPA else 2.0  # patch_sdpa on

    monkeypatch.setattr(_bench_models.Clock, "ms", fixed_ms)
    monkeypatch.setattr(_bench_models, "attention_ms", lambda calls, clock, reps: 1.0)
    rows = _bench_models.run(["sd15", "bert"], torch.device("cpu"), tiny=True, reps=3,
                             out=tmp_path)
    assert [r["model"] for r in rows] == ["SD1.5 UNet, 512 px, batch 2", "BERT-base, padded 16 x 512"]
    for row in rows:
        assert row["calls"] > 0 and row["quantized"] == 0 and row["cosine"] > 0.999999
        assert (row["default_ms"], row["sage_ms"], row["speedup"], row["attention_share"],
                row["reps"]) == (4.0, 2.0, 2.0, 0.25, 3)
    table = (tmp_path / "models.md").read_text()
    assert table.count("\n| ") == 3  # header and two rows
    assert "| 4.00 | 2.00 | 2.000x | 25 % |" in table and "geomean speedup 2.000x" in table
    from sageattention2.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--models", "nope"])
    assert exit_info.value.code == 2 and "unknown model(s) nope" in capsys.readouterr().err


def test_bench_attention_time_replays_each_kind_of_call_once() -> None:
    """The attention share's time: the recorded SDPA calls grouped by what makes them cost the
    same (shapes, strides, dtypes, the other arguments), each group timed ``reps`` times (the
    median) and counted as often as it occurred: a clock that reads 1 ms for the first group's
    runs and 3 ms for the second's gives 2 x 1 + 1 x 3 ms."""
    from sageattention2 import _bench_models

    q, k, v = qkv()
    small = qkv(nq=5)
    calls = [((q, k, v), {}), (small, {"is_causal": True}), ((q, k, v), {})]
    readings = iter([1.0, 1.0, 1.0, 3.0, 3.0, 3.0])

    class FixedClock:
        def ms(self, fn: Any) -> float:
            fn()
            return next(readings)

    assert _bench_models.attention_ms(calls, FixedClock(), reps=3) == 5.0  # type: ignore[arg-type]
    assert next(readings, None) is None  # two groups of 3 runs: each kind of call timed once


def test_bench_attention_time_of_training_replays_the_backward() -> None:
    """With ``backward=True`` (``bench --models --train``) each replay is the call's forward and
    its backward: the gradients of the inputs that require grad (q, k, v), not of the mask."""
    from sageattention2 import _bench_models

    q, k, v = (t.requires_grad_() for t in qkv())
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    replays = []

    class FixedClock:
        def ms(self, fn: Any) -> float:
            replays.append(fn())
            return 1.0

    clock: Any = FixedClock()
    assert _bench_models.attention_ms([((q, k, v, mask), {})] * 2, clock, reps=3,
                                      backward=True) == 2.0  # one kind of call, twice
    assert len(replays) == 3
    for grads in replays:
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert all(g.abs().sum() > 0 for g in grads)


def test_bench_gradients_cosine_is_that_of_the_concatenated_gradients() -> None:
    """The training bench's gradient cosine, summed tensor by tensor, is ``cosine_similarity`` of
    the gradients concatenated."""
    from sageattention2 import _bench_models
    from sageattention2.testing import cosine_similarity

    torch.manual_seed(0)
    got = [torch.randn(3, 4), torch.randn(5), torch.zeros(2)]
    want = [g + 0.5 * torch.randn_like(g) for g in got]
    assert _bench_models.gradients_cosine(got, want) == pytest.approx(
        cosine_similarity(torch.cat([g.flatten() for g in got]),
                          torch.cat([w.flatten() for w in want])), abs=1e-12)


def test_cli_bench_models_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --models wan flux --train --tiny`` on the CPU: a training step (forward, backward,
    AdamW) per mode, finite times, every parameter gradient the same under sageattn (cosine 1 on
    the CPU: the exact path both ways), models_train.md written beside (not over) models.md.
    sageattn's steps and the count of its quantized calls (on inputs that require grad) run with
    SAGEATTN_TRAINING=quantized; the variable is restored after, also when unset before and when
    the measurement fails."""
    pytest.importorskip("diffusers")
    from sageattention2 import _bench_models
    from sageattention2._backward import TRAINING_ENVIRONMENT

    seen: set[tuple[bool, str | None]] = set()  # (sageattn patched in, the variable) per timing
    explained: list[tuple[str | None, bool]] = []
    real_ms, real_explain = _bench_models.Clock.ms, _bench_models.explain

    def ms(clock: Any, fn: Any) -> float:
        seen.add((F.scaled_dot_product_attention is not ORIGINAL_SDPA,
                  os.environ.get(TRAINING_ENVIRONMENT)))
        return real_ms(clock, fn)

    def explain(*args: Any, **kwargs: Any) -> Any:
        call = api.validated_call(*args, **kwargs)
        explained.append((os.environ.get(TRAINING_ENVIRONMENT), torch.is_grad_enabled() and all(
            t.requires_grad for t in (call.q, call.k, call.v))))
        return real_explain(*args, **kwargs)

    monkeypatch.setattr(_bench_models.Clock, "ms", ms)
    monkeypatch.setattr(_bench_models, "explain", explain)
    monkeypatch.setenv(TRAINING_ENVIRONMENT, "exact")
    rows = _bench_models.run(["wan", "flux"], torch.device("cpu"), tiny=True, reps=2,
                             out=tmp_path, seconds=5.0, train=True)
    assert os.environ[TRAINING_ENVIRONMENT] == "exact"
    assert [r["model"] for r in rows] == ["Flux-dev (2+4 blocks), 1024 px",
                                          "Wan2.1-1.3B (4 blocks), 81 x 480x832"]
    for row in rows:
        assert all(0 < row[key] < float("inf") for key in ("default_ms", "sage_ms", "speedup",
                                                            "attention_share"))
        assert row["calls"] > 0 and row["quantized"] == 0 and row["reps"] == 2
        assert row["cosine"] >= 0.9999
    assert {env for sage, env in seen if sage} == {"quantized"}
    assert explained and set(explained) == {("quantized", True)}
    table = (tmp_path / "models_train.md").read_text()
    assert table.startswith("Training step (CPU, torch ") and table.count("\n| ") == 3
    assert "| default SDPA step ms | sageattn step ms |" in table
    assert not (tmp_path / "models.md").exists()

    monkeypatch.delenv(TRAINING_ENVIRONMENT)

    def fails(*args: Any) -> float:
        assert os.environ[TRAINING_ENVIRONMENT] == "quantized"
        raise RuntimeError("measurement failed")

    monkeypatch.setattr(_bench_models, "gradients_cosine", fails)
    with pytest.raises(RuntimeError, match="measurement failed"):
        _bench_models.run(["wan"], torch.device("cpu"), tiny=True, reps=1, out=None, train=True)
    assert TRAINING_ENVIRONMENT not in os.environ


def test_cli_bench_models_train_when_default_sdpa_fails(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where default SDPA's training step raises with cuDNN on (session 41: its cuDNN backward
    failed in Wan's step on an H200), the baseline is SDPA without cuDNN, for every default step
    and replay, and the table says so under the row; a baseline that fails again raises."""
    pytest.importorskip("diffusers")
    from sageattention2 import _bench_models

    real = F.scaled_dot_product_attention
    default_calls: list[bool] = []

    def sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():  # (the step's output shape, taken without grad)
            return real(*args, **kwargs)
        default_calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        if default_calls[-1]:
            raise RuntimeError("mha_graph.execute failed\nmore")
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    rows = _bench_models.run(["wan"], torch.device("cpu"), tiny=True, reps=2, out=tmp_path,
                             train=True)
    assert default_calls[0] and not any(default_calls[1:]) and len(default_calls) > 4
    assert rows[0]["cosine"] >= 0.9999 and rows[0]["calls"] > 0
    assert rows[0]["note"] == ("default SDPA's step raised (mha_graph.execute failed): SDPA "
                               "without cuDNN")
    assert (tmp_path / "models_train.md").read_text().rstrip().endswith(
        "Wan2.1-1.3B (4 blocks), 81 x 480x832: " + rows[0]["note"])
    def always(*args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("always")
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", always)
    with pytest.raises(RuntimeError, match="always"):
        _bench_models.run(["wan"], torch.device("cpu"), tiny=True, reps=1, out=None, train=True)


def test_cli_bench_needs_a_gpu_unless_a_device_is_named(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a CUDA GPU, ``bench`` (any selection) runs nothing and says so in one line, exit
    code 1 as ``check``'s (not the whole model suite on the CPU, an hour); ``--shapes`` with
    ``--device cpu`` likewise. Unknown models are a usage error first."""
    from sageattention2 import _bench_models, _bench_shapes
    from sageattention2.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = recorder(monkeypatch, _bench_shapes)
    recorder(monkeypatch, _bench_models, returns=[], calls=ran)
    for argv in (["bench"], ["bench", "--models"], ["bench", "--shapes"],
                 ["bench", "--models", "bert", "--tiny", "--reps", "1"]):
        assert main(argv) == 1, argv
        out = capsys.readouterr().out
        assert out.startswith("bench: needs a CUDA GPU (") and out.count("\n") == 1, (argv, out)
    assert main(["bench", "--shapes", "--device", "cpu"]) == 1
    assert capsys.readouterr().out == "bench: --shapes needs a CUDA GPU, not --device cpu\n"
    assert ran == []
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--models", "nope"])
    assert exit_info.value.code == 2


def test_cli_bench_with_no_flags_runs_the_shapes_then_the_models(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench`` alone on a GPU (pretended: both runs are recorders): the ANCHORS shapes, then
    every model of the suite on cuda with the defaults (10 reps at least, 2 s per mode, full
    size, no output folder)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from sageattention2 import _bench_models, _bench_shapes
    from sageattention2.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ran = recorder(monkeypatch, _bench_shapes)
    recorder(monkeypatch, _bench_models, returns=[], calls=ran)
    assert main(["bench"]) == 0
    assert ran == [("sageattention2._bench_shapes", dict(out=None, shapes=_bench_shapes.SHAPES)),
                   ("sageattention2._bench_models", dict(
                       keys=None, device=torch.device("cuda"), tiny=False, reps=10, out=None,
                       seconds=2.0, train=False))]


def test_cli_bench_models_passes_its_flags(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """``bench --models KEY... --tiny --reps --seconds --out --device --train``: each parsed value
    reaches the model suite's run (which is recorded, not run); the shapes do not run;
    ``--models`` without keys is every model."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from sageattention2 import _bench_models, _bench_shapes
    from sageattention2.__main__ import main

    ran = recorder(monkeypatch, _bench_shapes)
    recorder(monkeypatch, _bench_models, returns=[], calls=ran)
    assert main(["bench", "--models", "sd15", "bert", "--tiny", "--reps", "3", "--seconds", "0.5",
                 "--out", str(tmp_path), "--device", "cpu", "--train"]) == 0
    assert main(["bench", "--models", "--device", "cpu"]) == 0
    assert ran == [("sageattention2._bench_models", dict(
                       keys=["sd15", "bert"], device=torch.device("cpu"), tiny=True, reps=3,
                       out=tmp_path, seconds=0.5, train=True)),
                   ("sageattention2._bench_models", dict(
                       keys=[], device=torch.device("cpu"), tiny=False, reps=10, out=None,
                       seconds=2.0, train=False))]


def test_cli_bench_train_needs_the_models_on_one_gpu(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench --train`` is a usage error naming the flag without ``--models`` (the shapes have
    no training step) and with ``--gpus`` (the context-parallel suite times forwards); nothing
    runs."""
    from sageattention2 import _bench_models, _bench_parallel, _bench_shapes
    from sageattention2.__main__ import main

    ran = recorder(monkeypatch, _bench_shapes)
    recorder(monkeypatch, _bench_models, returns=[], calls=ran)
    recorder(monkeypatch, _bench_parallel, returns=None, calls=ran)
    for argv, names in ((["bench", "--train"], ("--train", "--models")),
                        (["bench", "--shapes", "--train"], ("--train", "--models")),
                        (["bench", "--models", "wan", "--train", "--gpus", "2"],
                         ("--train", "--gpus"))):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and all(name in err for name in names), (argv, err)
    assert ran == []


def test_patch_sdpa_reaches_multihead_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """nn.MultiheadAttention calls SDPA (so patch_sdpa reaches it) only with need_weights=False
    (with weights it multiplies them out itself) and off its fused inference fast path
    (torch.backends.mha.set_fastpath_enabled(False)); then the output is SDPA's (CPU: exact)."""
    from helpers import CallCounter

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 9, 32)
    counter = CallCounter(monkeypatch, integrations)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            expected = mha(x, x, x, need_weights=False)[0]
            with warnings.catch_warnings(), patch_sdpa():
                warnings.simplefilter("ignore")
                got = mha(x, x, x, need_weights=False)[0]
                mha(x, x, x)  # need_weights=True: no SDPA call
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    assert torch.equal(got, expected)
    assert len(counter.calls) == 1 and counter.calls[0][0][0].shape == (2, 4, 9, 8)


def test_patch_sdpa_reaches_timm_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """timm's Attention (ViTs) calls F.scaled_dot_product_attention (fused_attn): patch_sdpa
    reaches it, with the same output on the CPU."""
    timm_layers = pytest.importorskip("timm.layers")
    from helpers import CallCounter

    torch.manual_seed(0)
    attention = timm_layers.Attention(64, num_heads=4).eval()
    x = torch.randn(2, 17, 64)
    counter = CallCounter(monkeypatch, integrations)
    with torch.no_grad():
        expected = attention(x)
        with warnings.catch_warnings(), patch_sdpa():
            warnings.simplefilter("ignore")
            got = attention(x)
    assert torch.equal(got, expected) and len(counter.calls) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check runs the kernels here")
def test_cli_check_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from sageattention2.__main__ import main

    assert main(["check", "--quick"]) == 1
    assert "check: needs a CUDA GPU" in capsys.readouterr().out


def test_cli_check_passes_its_path_and_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check [--quick] [--path all|wgmma|mma]``: the parsed values reach the check (recorded,
    not run), whose result is the exit code: 0 when it passes, 1 when it fails; another path is
    a usage error."""
    from sageattention2 import _check
    from sageattention2.__main__ import main

    passes = recorder(monkeypatch, _check, returns=0)
    assert main(["check"]) == 0
    assert main(["check", "--quick", "--path", "mma"]) == 0
    assert main(["check", "--path", "wgmma"]) == 0
    assert [arguments for _, arguments in passes] == [
        dict(quick=False, path="all"), dict(quick=True, path="mma"), dict(quick=False, path="wgmma")]
    fails = recorder(monkeypatch, _check, returns=1)
    assert main(["check", "--path", "all"]) == 1
    assert [arguments for _, arguments in fails] == [dict(quick=False, path="all")]
    with pytest.raises(SystemExit) as exit_info:
        main(["check", "--path", "sm80"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("dtypes", ["float32", "", "float16,", "half,bfloat16"])
def test_cli_tune_refuses_other_dtypes(dtypes: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``tune --dtypes`` other than float16 and/or bfloat16 (an empty name too) is a usage error
    (exit code 2, saying what it takes), before anything is measured, on any machine."""
    from sageattention2 import _tune
    from sageattention2.__main__ import main

    tuned = recorder(monkeypatch, _tune, name="tune")
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--quick", "--dtypes", dtypes])
    assert exit_info.value.code == 2 and tuned == []
    assert "--dtypes: must name float16 and/or bfloat16" in capsys.readouterr().err


def test_cli_tune_passes_its_dtypes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``tune --dtypes``, on a GPU (pretended; tune recorded, not run): the names reach tune, both
    by default."""
    from sageattention2 import _tune
    from sageattention2.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tuned = recorder(monkeypatch, _tune, returns=tmp_path / "table.json", name="tune")
    assert main(["tune", "--quick", "--dtypes", "bfloat16"]) == 0
    assert main(["tune", "--quick", "--dtypes", "bfloat16,float16"]) == 0
    assert main(["tune", "--quick"]) == 0
    assert [arguments["dtypes"] for _, arguments in tuned] == [
        ("bfloat16",), ("bfloat16", "float16"), ("float16", "bfloat16")]
    assert all(arguments["axes"] == _tune.QUICK_AXES for _, arguments in tuned)


def test_cli_tune_needs_a_gpu(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """``tune`` without a CUDA GPU: one line saying it needs one, exit code 1 (as ``check``), no
    traceback, nothing measured."""
    from sageattention2 import _tune
    from sageattention2.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tuned = recorder(monkeypatch, _tune, name="tune")
    assert main(["tune", "--quick"]) == 1
    assert capsys.readouterr().out == (
        "tune: needs a CUDA GPU (it measures the crossover of the GPU it runs on)\n")
    assert tuned == []


@pytest.mark.gpu
def test_cli_check_passes(attention_kernel: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``check --quick --path wgmma`` passes on this GPU (the full check: device_check.sh)."""
    from sageattention2 import _plan
    from sageattention2.__main__ import main

    if not _plan.target_of(torch.device("cuda")).wgmma:
        pytest.skip("no Hopper kernel here")
    assert main(["check", "--quick", "--path", "wgmma"]) == 0, capsys.readouterr().out


@pytest.mark.gpu
def test_cli_bench_shapes(attention_kernel: None, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One ANCHORS shape on the GPU, each column's call run once and its time fixed (1, 2, 4 and
    8 ms in the order of COLUMNS): TOPS = the work over that time in every column (SDPA flash
    and cuDNN: or None where this GPU's SDPA refuses the backend), the int8 / cuDNN ratio from
    them, the table written. No measured time decides anything here."""
    from sageattention2 import _bench_shapes

    fixed = iter([1.0, 2.0, 4.0, 8.0])

    def fixed_ms(fn: Any, reps: int = 30) -> float:
        ms = next(fixed)
        fn()  # the column's call runs (a backend that refuses raises here: None)
        torch.cuda.synchronize()
        return ms

    monkeypatch.setattr(_bench_shapes, "median_ms", fixed_ms)
    rows = _bench_shapes.run(tmp_path, shapes=[(128, 1024, False)])
    work = 4 * _bench_shapes.BATCH * _bench_shapes.HEADS * 1024 * 1024 * 128
    assert len(rows) == 1 and next(fixed, None) is None
    row = rows[0]
    for column, ms in zip(_bench_shapes.COLUMNS, (1.0, 2.0, 4.0, 8.0)):
        assert row[column] == work / ms / 1e9 or (column.startswith("SDPA") and row[column] is None), \
            (column, row)
    table = (tmp_path / "shapes.md").read_text()
    assert "hd128 N1K" in table
    assert ("8.00x" in table) == (row["SDPA cuDNN"] is not None)
