"""Real weights: all-MiniLM-L6-v2's sentence embeddings through attn_implementation="sageattn2"
against "sdpa" (tests/minilm.py says where the weights come from; without them these tests
skip). Each sentence alone (no padding, no mask: on the GPU the quantized kernel serves every
call, head_dim 32 zero-padded to 64) and in padded batches of 16 (the key-padding mask: exact
SDPA). Issue 35's bound: cosine >= 0.999 per sentence and the same nearest neighbour."""
from __future__ import annotations

import warnings

import pytest
import torch

import minilm

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
MODEL = minilm.model_dir()
pytestmark = pytest.mark.skipif(MODEL is None, reason="no MiniLM weights here (tests/minilm.py)")


@pytest.fixture(autouse=True)
def _registered() -> None:
    from sageattention2.integrations import transformers as sage_transformers

    sage_transformers.register(qk_quant="int8")  # the kernel: short sentences are SDPA's in auto
    yield
    sage_transformers.register()


def compare(device: str, dtype: torch.dtype, batch: int) -> minilm.Agreement:
    assert MODEL is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = minilm.embed(MODEL, "sdpa", device, dtype, batch)
        ours = minilm.embed(MODEL, "sageattn2", device, dtype, batch)
    return minilm.agreement(ours, reference)


@pytest.mark.parametrize("batch", [1, 16])
def test_minilm_on_cpu_is_exact(batch: int) -> None:
    """On the CPU every call is exact SDPA: the embeddings equal transformers' own."""
    result = compare("cpu", torch.float32, batch)
    assert result.sentences >= 64
    assert float(result.cosines.min()) > 1 - 1e-6 and result.same_neighbour == result.sentences


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_minilm_on_the_gpu(attention_kernel: None, batch: int) -> None:
    result = compare("cuda", torch.float16, batch)
    cos = result.cosines
    print(f"\nMiniLM float16, batch {batch}: cosine min {float(cos.min()):.6f} mean "
          f"{float(cos.mean()):.6f}; same nearest neighbour {result.same_neighbour}/"
          f"{result.sentences}")
    assert result.sentences >= 64
    assert float(cos.min()) >= 0.999 and result.same_neighbour == result.sentences
