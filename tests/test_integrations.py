"""sageattn in code written against SDPA (assigned to it, patch_sdpa), the public names and the
command line."""
from __future__ import annotations

import inspect
import os
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


def test_cli_routing_table(tmp_path: Path) -> None:
    """``python -m sageattention2 routing-table`` prints README.md's routing table."""
    assert run_cli("routing-table", cwd=tmp_path) == _plan.routing_table_markdown() + "\n"


def test_cli_bench_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m sageattention2 bench --models KEY... --tiny``: a row per model, every output at
    cosine 1 on the CPU (the exact path), the table and chart written; unknown names refused."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from sageattention2 import _bench_models

    rows = _bench_models.run(["sd15", "bert"], torch.device("cpu"), tiny=True, reps=1,
                             out=tmp_path)
    assert [r["model"] for r in rows] == ["SD1.5 UNet, 512 px, batch 2", "BERT-base, padded 16 x 512"]
    for row in rows:
        assert row["calls"] > 0 and row["quantized"] == 0 and row["cosine"] > 0.999999
        assert row["default_ms"] > 0 and row["sage_ms"] > 0
    table = (tmp_path / "models.md").read_text()
    assert table.count("\n| ") == 3 and "geomean speedup" in table  # header and two rows
    from sageattention2.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--models", "nope"])
    assert exit_info.value.code == 2 and "unknown model(s) nope" in capsys.readouterr().err


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


@pytest.mark.gpu
def test_cli_check_passes(attention_kernel: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``check --quick --path wgmma`` passes on this GPU (the full check: device_check.sh)."""
    from sageattention2 import _plan
    from sageattention2.__main__ import main

    if not _plan.target_of(torch.device("cuda")).wgmma:
        pytest.skip("no Hopper kernel here")
    assert main(["check", "--quick", "--path", "wgmma"]) == 0, capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shapes run here")
def test_cli_bench_shapes_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from sageattention2.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--shapes"])
    assert exit_info.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_cli_bench_shapes(attention_kernel: None, tmp_path: Path) -> None:
    """One ANCHORS shape: every column timed, the table written."""
    from sageattention2 import _bench_shapes

    rows = _bench_shapes.run(tmp_path, shapes=[(128, 1024, False)])
    assert len(rows) == 1 and all(rows[0][c] and rows[0][c] > 0 for c in _bench_shapes.COLUMNS)
    assert "hd128 N1K" in (tmp_path / "shapes.md").read_text()
