"""The drop-in for the authors' ``sageattention`` package (``compat/``, mapping in
``sageattention2.compat``): their signatures, every keyword honoured or refused, the installed
distribution as diffusers, ComfyUI, xDiT and yunchang find it (tests/compat_callers.py, in a fresh
process with the drop-in installed by pip into a temporary folder), and a warning where the
authors' package is also around."""
from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import sageattention2
from sageattention2 import compat
from sageattention2.reference import exact_attention

REPO = Path(__file__).resolve().parents[1]
CALLERS = Path(__file__).with_name("compat_callers.py")
PACKAGE_ROOT = str(Path(sageattention2.__file__).resolve().parents[1])
HAS_YUNCHANG = importlib.util.find_spec("yunchang") is not None
HAS_DIFFUSERS = importlib.util.find_spec("diffusers") is not None

# The authors' signatures (SageAttention 2.x), parameter by parameter, in their order; ours add
# attn_mask (ComfyUI looks for it) and take **kwargs (translated or refused).
AUTHORS_PARAMETERS = {
    "sageattn": ["q", "k", "v", "tensor_layout", "is_causal", "sm_scale", "return_lse"],
    "sageattn_qk_int8_pv_fp16_triton": ["q", "k", "v", "tensor_layout", "quantization_backend",
                                        "is_causal", "sm_scale", "smooth_k", "return_lse"],
    "sageattn_qk_int8_pv_fp16_cuda": ["q", "k", "v", "tensor_layout", "is_causal",
                                      "qk_quant_gran", "sm_scale", "pv_accum_dtype", "smooth_k",
                                      "smooth_v", "return_lse"],
    "sageattn_qk_int8_pv_fp8_cuda": ["q", "k", "v", "tensor_layout", "is_causal", "qk_quant_gran",
                                     "sm_scale", "pv_accum_dtype", "smooth_k", "smooth_v",
                                     "return_lse"],
    "sageattn_qk_int8_pv_fp8_cuda_sm90": ["q", "k", "v", "tensor_layout", "is_causal",
                                          "qk_quant_gran", "sm_scale", "pv_accum_dtype",
                                          "smooth_k", "return_lse"],
    "sageattn_varlen": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                        "max_seqlen_k", "is_causal", "sm_scale", "smooth_k"],
}


def environment(*paths: Path | str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*map(str, paths), PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))


def run_callers(site: Path, device: str, *scenarios: str) -> str:
    done = subprocess.run([sys.executable, str(CALLERS), device, *scenarios],
                          env=environment(site), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


def callers() -> list[str]:
    names = ["authors_readme", "comfyui", "xdit_lse_merge", "refusals"]
    if HAS_DIFFUSERS:
        names.append("diffusers_backends")
    if HAS_YUNCHANG:
        names.append("yunchang_kernels")
    return names


# ------------------------------------------------------------------------------------------------
# The mapping, in this process
# ------------------------------------------------------------------------------------------------


def test_version_is_the_distributions() -> None:
    project = tomllib.loads((REPO / "compat" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "sageattention" and project["version"] == compat.COMPAT_VERSION
    assert "sageattention2" in project["dependencies"]


@pytest.mark.parametrize("name", sorted(AUTHORS_PARAMETERS))
def test_signatures_are_the_authors(name: str) -> None:
    parameters = inspect.signature(getattr(compat, name)).parameters
    positional = [p for p, info in parameters.items()
                  if info.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional[:len(AUTHORS_PARAMETERS[name])] == AUTHORS_PARAMETERS[name]
    assert list(parameters)[-1] == "kwargs"
    if name != "sageattn_varlen":
        assert "attn_mask" in parameters


class Recorder:
    """Stands in for sageattn inside the drop-in: records what each call was translated to."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        monkeypatch.setattr(compat, "_sageattn", self)

    def __call__(self, q: Any, k: Any, v: Any, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        return "out"


def test_each_name_pins_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(monkeypatch)
    q = torch.zeros(1, 2, 8, 16)
    want = {"sageattn": ("auto", "auto"), "sageattn_qk_int8_pv_fp16_triton": ("int8", "none"),
            "sageattn_qk_int8_pv_fp16_cuda": ("int8", "none"),
            "sageattn_qk_int8_pv_fp8_cuda": ("int8", "fp8"),
            "sageattn_qk_int8_pv_fp8_cuda_sm90": ("int8", "fp8")}
    for name, (qk, pv) in want.items():
        assert getattr(compat, name)(q, q, q) == "out"
        got = recorder.calls[-1]
        assert (got["qk_quant"], got["pv_quant"]) == (qk, pv), name
        assert got["tensor_layout"] == "HND" and got["is_causal"] is False
        assert got["scale"] is None and got["smooth_k"] is True and got["attn_mask"] is None


def test_keywords_are_translated(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(monkeypatch)
    q, kv = torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 2, 16)  # NHD, GQA 4 over 2
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    compat.sageattn_qk_int8_pv_fp8_cuda(q, kv, kv, "NHD", True, "per_warp", 0.25, "fp32+fp16",
                                        False, True, True, attn_mask=mask)
    assert recorder.calls[-1] == dict(
        enable_gqa=True, attn_mask=mask, dropout_p=0.0, is_causal=True, scale=0.25,
        tensor_layout="NHD", return_lse=True, smooth_k=False, qk_quant="int8", pv_quant="fp8",
        smooth_v=True)
    # flash-attn's names (yunchang, xDiT), the off values of its other keywords
    compat.sageattn(q, kv, kv, tensor_layout="NHD", causal=True, softmax_scale=0.5,
                    dropout_p=0.1, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=True, return_softmax=False, return_attn_probs=False)
    got = recorder.calls[-1]
    assert (got["is_causal"], got["scale"], got["dropout_p"]) == (True, 0.5, 0.1)
    compat.sageattn(q, q, q, sm_scale=0.5, softmax_scale=0.5)  # agreeing twice is fine
    assert recorder.calls[-1]["scale"] == 0.5 and recorder.calls[-1]["enable_gqa"] is False


@pytest.mark.parametrize("call, error, word", [
    (lambda q: compat.sageattn(q, q, q, flash_attention_mode=True), TypeError, "flash_attention_mode"),
    (lambda q: compat.sageattn(q, q, q, window_size=(4, 4)), NotImplementedError, "window_size"),
    (lambda q: compat.sageattn(q, q, q, softcap=30.0), NotImplementedError, "softcap"),
    (lambda q: compat.sageattn(q, q, q, return_softmax=True), NotImplementedError, "return_softmax"),
    (lambda q: compat.sageattn(q, q, q, alibi_slopes=torch.ones(2)), NotImplementedError, "alibi"),
    (lambda q: compat.sageattn(q, q, q, deterministic="yes"), TypeError, "deterministic"),
    (lambda q: compat.sageattn(q, q, q, is_causal=True, causal=False), ValueError, "disagree"),
    (lambda q: compat.sageattn(q, q, q, sm_scale=0.1, softmax_scale=0.2), ValueError, "disagree"),
    (lambda q: compat.sageattn_qk_int8_pv_fp16_cuda(q, q, q, pv_accum_dtype="fp32+fp32"),
     ValueError, "pv_accum_dtype"),
    (lambda q: compat.sageattn_qk_int8_pv_fp8_cuda_sm90(q, q, q, pv_accum_dtype="fp32+fp16"),
     ValueError, "pv_accum_dtype"),
    (lambda q: compat.sageattn_qk_int8_pv_fp8_cuda(q, q, q, qk_quant_gran="per_block"),
     ValueError, "qk_quant_gran"),
    (lambda q: compat.sageattn_qk_int8_pv_fp16_triton(q, q, q, quantization_backend="x"),
     ValueError, "quantization_backend"),
    (lambda q: compat.sageattn_qk_int8_pv_fp16_triton(q, q, q, pv_accum_dtype="fp32"),
     TypeError, "pv_accum_dtype"),
    (lambda q: compat.sageattn(q, q, q, qk_quant="int4"), TypeError, "qk_quant"),
])
def test_what_the_authors_swallow_is_refused(monkeypatch: pytest.MonkeyPatch, call: Any,
                                             error: type[Exception], word: str) -> None:
    recorder = Recorder(monkeypatch)
    with pytest.raises(error, match=word):
        call(torch.zeros(1, 2, 8, 16))
    assert recorder.calls == []


def test_varlen_translates_and_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(compat, "_sageattn_varlen", lambda *a, **kw: calls.append(kw) or "out")
    q = torch.zeros(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    assert compat.sageattn_varlen(q, q, q, cu, cu, 6, 6, causal=True, softmax_scale=0.3,
                                  smooth_k=False, return_lse=True) == "out"
    assert calls[-1] == dict(is_causal=True, scale=0.3, smooth_k=False, return_lse=True)
    for kwargs, error in (({"attn_mask": torch.ones(1)}, NotImplementedError),
                          ({"dropout_p": 0.5}, NotImplementedError), ({"foo": 1}, TypeError)):
        with pytest.raises(error):
            compat.sageattn_varlen(q, q, q, cu, cu, 6, 6, **kwargs)
    assert len(calls) == 1


def test_outputs_and_lse_on_the_cpu() -> None:
    """The exact path, compared with float64 attention: out in both layouts, the natural-log LSE
    [B, H, N_q], GQA taken as the authors' kernels take it (fewer key heads, no flag)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 33, 16, generator=g)
    k = torch.randn(2, 2, 33, 16, generator=g) + 3 * torch.randn(1, 2, 1, 16, generator=g)
    v = torch.randn(2, 2, 33, 16, generator=g)
    want_out, want_lse = exact_attention(q, k, v, scale=0.3, enable_gqa=True, return_lse=True)
    for layout in ("HND", "NHD"):
        args = (q, k, v) if layout == "HND" else tuple(t.transpose(1, 2) for t in (q, k, v))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sageattention2.SageAttentionFallbackWarning)
            out, lse = compat.sageattn_qk_int8_pv_fp8_cuda(*args, tensor_layout=layout,
                                                           sm_scale=0.3, return_lse=True)
        out = out if layout == "HND" else out.transpose(1, 2)
        assert torch.allclose(out.double(), want_out, atol=1e-5)
        assert lse.shape == (2, 4, 33) and torch.allclose(lse.double(), want_lse, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# The installed distribution, as its callers find it
# ------------------------------------------------------------------------------------------------


def test_callers_on_the_cpu(dropin: Path) -> None:
    printed = run_callers(dropin, "cpu", *callers())
    assert printed.count("ok ") == len(callers()), printed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_callers_on_the_gpu(dropin: Path) -> None:
    """Each caller's calls run our quantized kernels (a counter on sageattention2.ops), within
    the 8-bit bound of float64 attention."""
    printed = run_callers(dropin, "cuda", *callers())
    assert printed.count("ok ") == len(callers()), printed


def import_warnings(*paths: Path) -> str:
    done = subprocess.run([sys.executable, "-W", "always", "-c", "import sageattention"],
                          env=environment(*paths), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_import_alone_is_quiet(dropin: Path) -> None:
    assert "sageattention:" not in import_warnings(dropin)


def test_next_to_the_authors_package_it_says_so(dropin: Path, tmp_path: Path) -> None:
    # the authors' package further down sys.path: hidden, and said so
    authors = tmp_path / "authors" / "sageattention"
    authors.mkdir(parents=True)
    (authors / "__init__.py").write_text("raise SystemExit('the authors package was imported')\n")
    (authors / "core.py").write_text("")
    said = import_warnings(dropin, authors.parent)
    assert "another 'sageattention' package at" in said and str(authors) in said, said
    # the authors' files left inside the drop-in's folder
    mixed = tmp_path / "mixed"
    shutil.copytree(dropin, mixed)
    (mixed / "sageattention" / "core.py").write_text("")
    said = import_warnings(mixed)
    assert "files of the authors' sageattention (core.py)" in said, said
    # the distribution's metadata is the authors' (installed over ours without removing it)
    other = tmp_path / "other"
    shutil.copytree(dropin, other)
    info = next(other.glob("sageattention-*.dist-info"))
    metadata = (info / "METADATA").read_text().replace(compat.COMPAT_VERSION, "2.2.0")
    (info / "METADATA").write_text(metadata)
    said = import_warnings(other)
    assert "distribution is version 2.2.0" in said, said


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(set(AUTHORS_PARAMETERS) - {"sageattn_varlen"}))
def test_families_as_accurate_as_the_authors(name: str, attention_kernel: None) -> None:
    """The protocol's input families (docs/PROTOCOL.md#input-families) through each of the
    authors' names: no worse than the authors' own 8-bit sm90 kernel (ANCHORS), CosSim and rel.
    L1 against float64 attention, at both masks."""
    from gpu_helpers import OFFICIAL_ROUNDING, OFFICIAL_SM90

    from sageattention2.testing import cosine_similarity, make_input_family, relative_l1

    torch.manual_seed(0)
    families = {family: make_input_family(family, (1, 8, 4096, 128), torch.float16, "cuda")
                for family in ("bias0", "bias4", "outliers")}
    short = []
    for family, (q, k, v) in families.items():
        for causal in (False, True):
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), is_causal=causal)
            out = getattr(compat, name)(q, k, v, is_causal=causal)
            cos, l1 = cosine_similarity(out, want), relative_l1(out, want)
            official = OFFICIAL_SM90[family, causal]
            line = (f"{name} {family} causal={causal}: CosSim {cos:.6f} rel. L1 {l1:.5f} "
                    f"(authors' sm90 {official[0]:.6f} / {official[1]:.4f})")
            print(line)
            if not (cos >= official[0] - OFFICIAL_ROUNDING[0]
                    and l1 <= official[1] + OFFICIAL_ROUNDING[1]):
                short.append(line)
    assert not short, "\n".join(short)
