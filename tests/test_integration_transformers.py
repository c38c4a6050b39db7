"""sageattention2.integrations.transformers on real transformers classes at tiny sizes: a
decoder (Llama: causal, GQA with K/V not expanded, a padded batch) and an encoder (BERT: padding
mask), selected by ``attn_implementation="sageattn2"`` and ``set_attn_implementation``. On the
CPU every call is exact SDPA (the fallback): outputs must equal transformers' "sdpa"; on the GPU
the quantized kernel runs (forced: tiny shapes are exact SDPA's under qk_quant="auto")."""
from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers import CallCounter

transformers = pytest.importorskip("transformers")

from sageattention2.integrations import transformers as sage_transformers  # noqa: E402
from sageattention2 import _model_suite as models  # noqa: E402  (the tiny configs of the classes)
from sageattention2.testing import cosine_similarity  # noqa: E402



@pytest.fixture(autouse=True)
def _quiet_and_default_options() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    sage_transformers.register()


def llama(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    return models.llama3_8b(16)(torch.device(device), dtype, tiny=True)


def test_register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert sage_transformers.register() == "sageattn2"
    assert AttentionInterface()["sageattn2"] is sage_transformers.attention_forward
    assert "sageattn2" in ALL_MASK_ATTENTION_FUNCTIONS
    assert "flash" not in sage_transformers.NAME and "sdpa" not in sage_transformers.NAME
    with pytest.raises(TypeError, match="return_lse"):
        sage_transformers.register(return_lse=True)


@pytest.mark.parametrize("padded", [False, True])
def test_decoder(monkeypatch: pytest.MonkeyPatch, padded: bool) -> None:
    """Llama (4 query heads, 2 KV heads): the same hidden states as "sdpa"; without padding the
    calls are causal with K/V not expanded (enable_gqa) and no mask, with padding they carry the
    mask (and K/V expanded: that call is exact SDPA)."""
    model, inputs = llama()
    if padded:
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, :5] = 0  # left padding
        inputs["attention_mask"] = mask
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    sage_transformers.register()
    counter = CallCounter(monkeypatch, sage_transformers)
    model.set_attn_implementation("sageattn2")
    with torch.no_grad():
        got = model(**inputs).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert len(counter.calls) == 1  # one layer
    q, k, _, mask, _, causal, _, gqa = counter.calls[0][0]
    if padded:
        assert mask is not None and not causal and k.shape[1] == q.shape[1]
    else:
        assert mask is None and causal and gqa and k.shape[1] == q.shape[1] // 2


def test_encoder_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """BERT with a padded batch, built with attn_implementation="sageattn2": the padding mask
    reaches every call, and the output is "sdpa"'s."""
    from transformers import BertModel

    torch.manual_seed(0)
    reference, inputs = models.bert_base(torch.device("cpu"), torch.float32, tiny=True)
    sage_transformers.register()
    config = copy.deepcopy(reference.config)  # _from_config sets its implementation
    ours = BertModel._from_config(config, attn_implementation="sageattn2").eval()
    assert reference.config._attn_implementation == "sdpa"
    ours.load_state_dict(reference.state_dict())
    counter = CallCounter(monkeypatch, sage_transformers)
    with torch.no_grad():
        expected = reference(**inputs).last_hidden_state
        got = ours(**inputs).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert len(counter.calls) == 1 and counter.calls[0][0][3] is not None


def test_output_attentions_and_softcap() -> None:
    model, inputs = llama()
    sage_transformers.register()
    model.set_attn_implementation("sageattn2")
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    assert out.attentions is None or all(a is None for a in out.attentions)
    with pytest.raises(ValueError, match="softcap"):
        sage_transformers.attention_forward(model, *(torch.zeros(1, 2, 3, 8),) * 3, None,
                                            softcap=1.0)


def test_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    model, inputs = llama()
    sage_transformers.register()
    model.set_attn_implementation("sageattn2")
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        got = torch.compile(model, fullgraph=True, backend="eager")(**inputs).last_hidden_state
    torch.testing.assert_close(got, expected)


@pytest.mark.gpu
def test_decoder_runs_the_kernel_on_the_gpu(attention_kernel: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, Llama in bfloat16 with the kernel forced: the causal GQA call is quantized,
    its output at cosine >= 0.999 of SDPA's, and the model's hidden states too."""
    from sageattention2 import explain

    model, inputs = llama("cuda", torch.bfloat16)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    sage_transformers.register(qk_quant="int8")
    seen: list[float] = []
    real = sage_transformers.sageattn

    def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = real(q, k, v, *args, **kwargs)
        assert explain(q, k, v, *args, **kwargs).quantized
        mask, dropout_p, is_causal, scale, enable_gqa = args  # the function passes them so
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
        seen.append(float(cosine_similarity(out.float(), want.float())))
        return out

    monkeypatch.setattr(sage_transformers, "sageattn", checked)
    model.set_attn_implementation("sageattn2")
    with torch.no_grad():
        got = model(**inputs).last_hidden_state
    assert len(seen) == 1 and min(seen) >= 0.999, seen
    assert cosine_similarity(got.float(), expected.float()) >= 0.999
