"""``explain()`` (sageattention2/api.py): its text for every kind of call, and that what it names
is what runs, with the call's softmax scale. On the CPU, routed as on a GPU with the default
build (tests/helpers.py: pretend_gpu, stand_in_kernel); the GPU test of the scale on the real
kernels is tests/test_sageattn_gpu.py::test_sageattn_scale."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from helpers import DEFAULT_BUILD, SM80_BUILD, pretend_gpu, qkv, stand_in_kernel
from sageattention2 import explain, sageattn
from sageattention2 import reference as ref
from sageattention2.api import Explanation


@pytest.mark.parametrize("capability, build, options, text", [
    ((9, 0), DEFAULT_BUILD, {}, "attention_wgmma: INT8 QK, PV in FP8"),
    ((9, 0), DEFAULT_BUILD, dict(pv_quant="none"), "attention_wgmma: INT8 QK, PV in the input dtype"),
    ((9, 0), DEFAULT_BUILD, dict(qk_quant="int4"), "attention_mma: INT4 QK, PV in FP8"),
    ((9, 0), DEFAULT_BUILD, dict(smooth_q="head", pv_quant="none"),
     "attention_mma: INT8 QK, PV in the input dtype"),
    ((8, 9), DEFAULT_BUILD, {}, "attention_mma: INT8 QK, PV in FP8"),
    ((8, 0), SM80_BUILD, {}, "attention_mma: INT8 QK, PV in the input dtype"),
], ids=["h100", "h100-accurate", "h100-int4", "h100-smooth-q", "ada", "a100"])
def test_quantized_explanation_text(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                    build: dict[str, list[str]], options: dict[str, Any],
                                    text: str) -> None:
    """A quantized call's explanation reads "<kernel>: <QK format> QK, PV in <FP8 | the input
    dtype>", what its fields say."""
    pretend_gpu(monkeypatch, capability, build)
    q, k, v = (t.half() for t in qkv(d=64))
    explanation = explain(q, k, v, **options)
    assert explanation.quantized and explanation.reason is None
    assert str(explanation) == text
    assert text == (f"{explanation.kernel}: {explanation.qk.upper()} QK, PV in "  # type: ignore[union-attr]
                    f"{'FP8' if explanation.pv == 'fp8' else 'the input dtype'}")


def test_exact_explanation_text() -> None:
    """A call served by exact SDPA reads "exact SDPA: <why>" (the fallback's reason); an empty
    call "nothing (empty)"."""
    q, k, v = qkv(d=64)
    explanation = explain(q, k, v)
    assert not explanation.quantized and explanation.reason
    assert str(explanation) == f"exact SDPA: {explanation.reason}"
    assert str(explain(q[:, :, :0], k, v)) == "nothing (empty)"
    assert str(Explanation(False, "exact SDPA", None, None, None)) == "exact SDPA"


@pytest.mark.parametrize("options", [
    dict(scale=0.3), dict(scale=0.3, pv_quant="none"), dict(scale=0.05, qk_quant="int4"),
    dict(scale=0.3, is_causal=True, causal_alignment="bottom_right"),
], ids=["wgmma", "wgmma-accurate", "mma-int4", "bottom-right"])
def test_the_kernel_explain_names_runs_with_the_scale(monkeypatch: pytest.MonkeyPatch,
                                                     options: dict[str, Any]) -> None:
    """Routed as on an H100, each kernel call stood in for by exact attention at the scale it is
    given: every kernel call of the call is the one explain() names, with the call's scale (not
    1 / sqrt(D)); the output is float64 attention at that scale, and differs from the call's
    with the default scale."""
    calls = stand_in_kernel(monkeypatch, lambda call, q, k: (call.choice, call.sm_scale))
    q, k, v = (t.half() for t in qkv(b=2, hq=4, hkv=2, nq=37, nk=53, d=64))
    kwargs = dict(enable_gqa=True, **options)
    explanation = explain(q, k, v, **kwargs)
    assert explanation.quantized
    out = sageattn(q, k, v, **kwargs)
    assert calls and all((c.kernel, c.qk, c.pv, scale) == (explanation.kernel.removeprefix("attention_"),
                                                           explanation.qk, explanation.pv, options["scale"])
                         for c, scale in calls), calls
    mask = None
    if options.get("causal_alignment") == "bottom_right":
        mask = torch.ones(37, 53, dtype=torch.bool).tril(53 - 37)
    want = ref.exact_attention(q, k, v, attn_mask=mask, is_causal=options.get("is_causal", False) and mask is None,
                               scale=options["scale"], enable_gqa=True)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0)
    default = {key: value for key, value in kwargs.items() if key != "scale"}
    assert (out - sageattn(q, k, v, **default)).abs().max() > 1e-2
    assert calls[-1][1] == 1 / math.sqrt(64)

