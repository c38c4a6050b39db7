"""sageattention2.integrations.transformers on real transformers classes at tiny sizes: a
decoder (Llama: causal, GQA with K/V not expanded, a padded batch) and an encoder (BERT: padding
mask), selected by ``attn_implementation="sageattn2"`` and ``set_attn_implementation``. On the
CPU every call is exact SDPA (the fallback): outputs must equal transformers' "sdpa". The options
given to register() must reach every sageattn call: under a crossover table by which exact SDPA
is faster everywhere, qk_quant="auto" runs every call exact and register(qk_quant="int8") runs the
kernel (on the CPU the kernel is a stand-in, tests/helpers.py; on the GPU the real one). T5's
position_bias goes to transformers' own SDPA function, and output_attentions=True warns once."""
from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import CallCounter, sdpa_faster_everywhere, stand_in_kernel

transformers = pytest.importorskip("transformers")

from sageattention2 import _crossover, _execute  # noqa: E402
from sageattention2.integrations import transformers as sage_transformers  # noqa: E402
from sageattention2 import _model_suite as models  # noqa: E402  (the tiny configs of the classes)
from sageattention2.testing import cosine_similarity  # noqa: E402

OPTIONS = dict(qk_quant="int8", smooth_k=False, smooth_q="block")  # not sageattn's defaults


@pytest.fixture(autouse=True)
def _quiet_and_default_options() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    sage_transformers.register()


def llama(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    return models.llama3_8b(16)(torch.device(device), dtype, tiny=True)


# The [B, H, N, D] of the tiny Llama's attention call: 16 tokens, 4 query heads of head_dim 16.
LLAMA_CALL = (1, 4, 16, 16)


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


def test_register_options_reach_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """register(**options): every call of the attention function carries them (and nothing else
    by keyword); register() again: only the options change, back to sageattn's defaults."""
    model, inputs = llama()
    sage_transformers.register(**OPTIONS)
    counter = CallCounter(monkeypatch, sage_transformers)
    model.set_attn_implementation("sageattn2")
    with torch.no_grad():
        model(**inputs)
        sage_transformers.register()
        model(**inputs)
    assert [kwargs for _, kwargs in counter.calls] == [OPTIONS, {}]


def test_register_qk_quant_forces_the_kernel_under_the_crossover(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU side of test_decoder_runs_the_kernel_on_the_gpu: calls routed as on an H100, the
    kernel a stand-in (exact attention), and a crossover table by which exact SDPA is faster at
    every shape. register() runs Llama's causal GQA call exact (qk_quant="auto" follows the
    table: explain says why, the kernel never runs), register(qk_quant="int8") runs the kernel:
    the option reached sageattn and decided."""
    from sageattention2 import explain

    kernel_calls = stand_in_kernel(monkeypatch, lambda call, q, k: (tuple(q.shape), tuple(k.shape)))
    table = _crossover.CrossoverTable.from_json(sdpa_faster_everywhere(
        torch.empty(LLAMA_CALL, dtype=torch.bfloat16), is_causal=True))
    monkeypatch.setattr(_crossover, "table_for", lambda device, capability, choice=None: table)
    model, inputs = llama(dtype=torch.bfloat16)
    explained: list[Any] = []
    real = sage_transformers.sageattn

    def explaining(*args: Any, **kwargs: Any) -> Any:
        explained.append(explain(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(sage_transformers, "sageattn", explaining)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        sage_transformers.register()
        model.set_attn_implementation("sageattn2")
        exact = model(**inputs).last_hidden_state
        assert kernel_calls == [] and len(explained) == 1
        assert not explained[0].quantized and "exact SDPA is faster" in explained[0].reason
        sage_transformers.register(qk_quant="int8")
        forced = model(**inputs).last_hidden_state
    assert kernel_calls == [((1, 4, 16, 16), (1, 2, 16, 16))]  # K, V not expanded
    assert len(explained) == 2 and explained[1].quantized
    torch.testing.assert_close(exact, expected)
    assert cosine_similarity(forced.float(), expected.float()) >= 0.999


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


def test_output_attentions_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """output_attentions=True gets no weights and one warning per process, however many calls
    ask (as transformers' "sdpa" warns once); calls that do not ask, none."""
    monkeypatch.setattr(sage_transformers, "_warned_output_attentions", False)
    model, inputs = llama()
    sage_transformers.register()
    model.set_attn_implementation("sageattn2")
    with warnings.catch_warnings(record=True) as record, torch.no_grad():
        warnings.simplefilter("always")
        model(**inputs)
        assert not [w for w in record if "attention weights" in str(w.message)]
        for _ in range(3):
            model(**inputs, output_attentions=True)
    said = [str(w.message) for w in record if "attention weights" in str(w.message)]
    assert said == ["attn_implementation='sageattn2' returns no attention weights "
                    "(output_attentions=True); use 'eager' for them"]


def test_position_bias_runs_transformers_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """T5 (relative position bias, passed as position_bias): its calls go to transformers' own
    SDPA function, which adds the bias, not to sageattn (whose masks carry no bias of a model's):
    the same hidden states as "sdpa", and no sageattn call."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0)
    reference = T5EncoderModel(config).eval()
    assert reference.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a padded item: the bias and the padding mask together
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    sage_transformers.register()
    counter = CallCounter(monkeypatch, sage_transformers)
    reference.set_attn_implementation("sageattn2")
    with torch.no_grad():
        got = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert counter.calls == []
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


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
def test_decoder_runs_the_kernel_on_the_gpu(attention_kernel: None, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, Llama in bfloat16, under a crossover table (a file named by
    SAGEATTN_CROSSOVER) by which exact SDPA is faster at every shape: with register() the causal
    GQA call runs exact SDPA (qk_quant="auto" follows the table), with register(qk_quant="int8")
    the quantized kernel, so the option reached sageattn and decided. Each call's output at
    cosine >= 0.999 of SDPA's, and the model's hidden states too."""
    from sageattention2 import explain

    table = tmp_path / "sdpa-faster-everywhere.json"
    table.write_text(json.dumps(sdpa_faster_everywhere(
        torch.empty(LLAMA_CALL, device="cuda", dtype=torch.bfloat16), is_causal=True)))
    monkeypatch.setenv(_crossover.ENVIRONMENT, str(table))
    _crossover.clear_cache()
    _execute.clear_call_cache()
    model, inputs = llama("cuda", torch.bfloat16)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    seen: list[tuple[bool, str | None, float]] = []
    real = sage_transformers.sageattn

    def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = real(q, k, v, *args, **kwargs)
        explanation = explain(q, k, v, *args, **kwargs)
        mask, dropout_p, is_causal, scale, enable_gqa = args  # the function passes them so
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
        seen.append((explanation.quantized, explanation.reason,
                     float(cosine_similarity(out.float(), want.float()))))
        return out

    monkeypatch.setattr(sage_transformers, "sageattn", checked)
    model.set_attn_implementation("sageattn2")
    with torch.no_grad():
        sage_transformers.register()
        exact = model(**inputs).last_hidden_state
        sage_transformers.register(qk_quant="int8")
        got = model(**inputs).last_hidden_state
    assert [quantized for quantized, _, _ in seen] == [False, True], seen
    assert "exact SDPA is faster" in (seen[0][1] or ""), seen
    assert min(cosine for _, _, cosine in seen) >= 0.999, seen
    assert cosine_similarity(exact.float(), expected.float()) >= 0.999
    assert cosine_similarity(got.float(), expected.float()) >= 0.999
