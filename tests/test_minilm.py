"""Real weights: all-MiniLM-L6-v2's sentence embeddings through attn_implementation="sageattn2"
against "sdpa" (tests/minilm.py says where the weights come from; without them these tests
skip). Each sentence alone (no padding, no mask: on the GPU the quantized kernel serves every
call, head_dim 32 zero-padded to 64) and in padded batches of 16 (transformers' [B, 1, N, N]
key-padding mask, equal rows: the kernel on each sentence's keys). Issue 35's bound: cosine >= 0.999 per sentence and
the same nearest neighbour (on the FP8-PV tier, except near ties: test_minilm_on_the_gpu)."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import minilm

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
MODEL = minilm.model_dir()
if MODEL is None and os.environ.get(minilm.REQUIRED_ENVIRONMENT):
    raise RuntimeError(f"{minilm.REQUIRED_ENVIRONMENT} is set but no MiniLM weights were found "
                       "(tests/minilm.py says where they are looked for)")
pytestmark = pytest.mark.skipif(MODEL is None, reason="no MiniLM weights here (tests/minilm.py)")


def compare(device: str, dtype: torch.dtype, batch: int,
            **options: str) -> tuple[minilm.Agreement, float]:
    """``options``: of the sageattn calls (qk_quant="int8" forces the kernel: in "auto",
    sentences this short run exact SDPA)."""
    from sageattention2.integrations import transformers as sage_transformers

    assert MODEL is not None
    sage_transformers.register(qk_quant="int8", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = minilm.embed(MODEL, "sdpa", device, dtype, batch)
        ours = minilm.embed(MODEL, "sageattn2", device, dtype, batch)
        truth = minilm.embed(MODEL, "sdpa", device, torch.float32, batch)
    sage_transformers.register()
    return minilm.agreement(ours, reference), minilm.similarity_noise(reference, truth)


@pytest.mark.parametrize("batch", [1, 16])
def test_minilm_on_cpu_is_exact(batch: int) -> None:
    """On the CPU every call is exact SDPA: the embeddings equal transformers' own."""
    result, _ = compare("cpu", torch.float32, batch)
    assert result.sentences >= 64
    assert float(result.cosines.min()) > 1 - 1e-6 and result.same_neighbour == result.sentences


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("pv_quant", ["none", "fp8"])
def test_minilm_on_the_gpu(attention_kernel: None, batch: int, pv_quant: str) -> None:
    """Issue 35's bound. INT8 QK with FP16 PV meets all of it: cosine >= 0.999 and every
    nearest neighbour kept that the float16 reference itself decides (its two nearest further
    apart than twice its own similarity error against the float32 model; in batches of 16 on the
    H200 one sentence's two nearest are 3.8e-4 apart, within SDPA float16's own error). FP8 PV (the fast tier) meets the cosine bound, and its neighbours
    are reported, not asserted: P's 3 mantissa bits over 10-30 keys move a similarity by up to
    ~3e-3, which flips the sentences whose two nearest are closer than that in the reference
    (on the H100, 2 of 68 alone, at margins 2.9e-3 and 1.2e-3; none in batches of 16, where
    transformers' [B, 1, N, N] mask ran exact SDPA before masks of that form ran the kernel)."""
    result, noise = compare("cuda", torch.float16, batch, pv_quant=pv_quant)
    cos = result.cosines
    print(f"\nMiniLM float16, batch {batch}, PV {pv_quant}: cosine min {float(cos.min()):.6f} mean "
          f"{float(cos.mean()):.6f}; same nearest neighbour {result.same_neighbour}/"
          f"{result.sentences}; reference margins where it differs {result.flip_margins}; "
          f"float16 SDPA's own similarity error {noise:.2e}")
    assert result.sentences >= 64
    assert float(cos.min()) >= 0.999
    if pv_quant == "none":
        assert all(margin < 2 * noise for margin in result.flip_margins), (result.flip_margins, noise)


def finetunes(device: str, steps: int, seeds: range) -> dict[str, list[minilm.FineTune]]:
    """The fine-tune under "sdpa" and under "sageattn2" (SAGEATTN_TRAINING=quantized, the kernel
    forced: these sentences are short enough for the crossover to send them to exact SDPA)."""
    from sageattention2.integrations import transformers as sage_transformers

    assert MODEL is not None
    sage_transformers.register(qk_quant="int8")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return {name: [minilm.finetune(MODEL, name, device, seed, steps) for seed in seeds]
                    for name in ("sdpa", "sageattn2")}
    finally:
        sage_transformers.register()


def test_finetune_on_cpu_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fine-tune's plumbing on the CPU, where sageattn's training calls run exact SDPA: the
    same losses and accuracy under both (float32, a few steps)."""
    monkeypatch.setenv("SAGEATTN_TRAINING", "quantized")
    runs = finetunes("cpu", steps=3, seeds=range(1))
    (want,), (got,) = runs["sdpa"], runs["sageattn2"]
    assert got.final_loss == pytest.approx(want.final_loss, rel=1e-4)
    assert got.test_accuracy == pytest.approx(want.test_accuracy, abs=1e-6)


@pytest.mark.gpu
def test_finetune_matches_sdpa(attention_kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51: MiniLM fine-tuned 40 steps (bf16 autocast, padded batches: the key-padding mask
    through the backward), three seeds each: sageattn's mean final loss and test accuracy within
    the run-to-run spread of SDPA's three seeds; the quantized kernel ran."""
    from sageattention2 import _backward, _execute

    monkeypatch.setenv("SAGEATTN_TRAINING", "quantized")
    calls: list[int] = []
    real = _execute.quantized
    monkeypatch.setattr(_execute, "quantized", lambda *a, **k: calls.append(1) or real(*a, **k))
    backwards: list[int] = []  # the quantized forward's backward: the training steps took it
    real_backward = _backward.attention_backward
    monkeypatch.setattr(_backward, "attention_backward",
                        lambda *a, **k: backwards.append(1) or real_backward(*a, **k))
    runs = finetunes("cuda", steps=40, seeds=range(3))
    for name, results in runs.items():
        print(f"\nMiniLM fine-tune, {name}: " + "; ".join(
            f"loss {r.final_loss:.4f} test loss {r.test_loss:.4f} accuracy {r.test_accuracy:.4f}"
            for r in results))
    assert calls, "sageattn's fine-tune did not run the quantized kernel"
    assert len(backwards) >= 40 * 6, "sageattn's training steps did not take the quantized path"
    for field in ("final_loss", "test_accuracy"):
        sdpa = [getattr(r, field) for r in runs["sdpa"]]
        ours = sum(getattr(r, field) for r in runs["sageattn2"]) / 3
        spread = max(sdpa) - min(sdpa)
        assert abs(ours - sum(sdpa) / 3) <= max(spread, 1e-3 if field == "test_accuracy" else 0), (
            field, ours, sdpa)
