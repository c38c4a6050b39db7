"""sageattention2.integrations.diffusers on real diffusers classes at tiny sizes: the dispatcher
backend ("sageattention2": registration, set_attention_backend, the attention_backend context,
its arguments) and the per-model processors (apply / remove). On the CPU every call is exact
SDPA (the fallback), so results must equal the native backend's bit for bit. The options given to
register() and apply() must reach every sageattn call: under a crossover table by which exact SDPA
is faster everywhere, qk_quant="auto" runs every call exact and register(qk_quant="int8") runs the
kernel (on the CPU the kernel is a stand-in, tests/helpers.py; on the GPU the real one)."""
from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import CallCounter, sdpa_faster_everywhere, stand_in_kernel

diffusers = pytest.importorskip("diffusers")

from diffusers.models import attention_dispatch  # noqa: E402

from sageattention2 import _crossover, _execute, integrations  # noqa: E402
from sageattention2.integrations import diffusers as sage_diffusers  # noqa: E402
from sageattention2 import _model_suite as models  # noqa: E402  (the tiny configs of the classes)
from sageattention2.testing import cosine_similarity  # noqa: E402

OPTIONS = dict(qk_quant="int8", smooth_k=False, smooth_q="block")  # not sageattn's defaults


@pytest.fixture(autouse=True)
def _quiet_and_native_after() -> Iterator[None]:
    """No fallback warnings (CPU calls are all fallbacks), and diffusers' global backend back to
    native after each test (set_attention_backend also sets the active backend)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    sage_diffusers.register()  # default options again
    attention_dispatch._AttentionBackendRegistry.set_active_backend(
        attention_dispatch.AttentionBackendName.NATIVE)


def flux(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    return models.flux_dev(torch.device(device), dtype, tiny=True)


# The [B, N, H, D] of each attention call of the tiny Flux: 16 image + 8 text tokens, 2 heads.
FLUX_CALL = (1, 24, 2, 16)


def test_register_adds_the_backend_name() -> None:
    assert sage_diffusers.register() == "sageattention2"
    assert sage_diffusers.register(qk_quant="int8") == "sageattention2"  # again: options only
    member = attention_dispatch.AttentionBackendName("sageattention2")
    assert member.value == "sageattention2" and member in attention_dispatch.AttentionBackendName.__members__.values()
    assert member in attention_dispatch._AttentionBackendRegistry._backends
    assert list(attention_dispatch.AttentionBackendName).count(member) == 1
    with pytest.raises(TypeError, match="tensor_layout"):
        sage_diffusers.register(tensor_layout="HND")


def test_dispatcher_model_runs_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flux through set_attention_backend and through the attention_backend context: every
    attention call goes to sageattn in NHD (no copies), and the output is the native backend's
    (on the CPU both are exact SDPA)."""
    model, inputs = flux()
    with torch.no_grad():
        expected = model(**inputs)[0]
    sage_diffusers.register()
    counter = CallCounter(monkeypatch, sage_diffusers)
    model.set_attention_backend("sageattention2")
    with torch.no_grad():
        got = model(**inputs)[0]
    assert torch.equal(got, expected)
    assert len(counter.calls) == 2  # one double block, one single block
    assert all(kwargs["tensor_layout"] == "NHD" for _, kwargs in counter.calls)
    model.reset_attention_backend()
    with torch.no_grad(), attention_dispatch.attention_backend("sageattention2"):
        assert torch.equal(model(**inputs)[0], expected)
    assert len(counter.calls) == 4


def test_register_options_reach_every_backend_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """register(**options): every call through the backend (set_attention_backend and the
    attention_backend context) carries them; register() again: only the options change, back to
    sageattn's defaults."""
    model, inputs = flux()
    sage_diffusers.register(**OPTIONS)
    counter = CallCounter(monkeypatch, sage_diffusers)
    model.set_attention_backend("sageattention2")
    with torch.no_grad():
        model(**inputs)
        model.reset_attention_backend()
        with attention_dispatch.attention_backend("sageattention2"):
            model(**inputs)
    assert len(counter.calls) == 4
    assert all(kwargs == dict(tensor_layout="NHD", return_lse=False, **OPTIONS)
               for _, kwargs in counter.calls), \
        [kwargs for _, kwargs in counter.calls]
    sage_diffusers.register()
    with torch.no_grad(), attention_dispatch.attention_backend("sageattention2"):
        model(**inputs)
    assert len(counter.calls) == 6
    assert all(kwargs == dict(tensor_layout="NHD", return_lse=False)
               for _, kwargs in counter.calls[4:]), \
        [kwargs for _, kwargs in counter.calls[4:]]


def test_register_qk_quant_forces_the_kernel_under_the_crossover(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU side of test_backend_runs_the_kernel_on_the_gpu: calls routed as on an H100, the
    kernel a stand-in (exact attention), and a crossover table by which exact SDPA is faster at
    every shape. Through the backend, register() runs every call exact (qk_quant="auto" follows
    the table: explain says why, the kernel never runs), register(qk_quant="int8") runs the
    kernel on every call: the option reached sageattn and decided."""
    from sageattention2 import explain

    kernel_calls = stand_in_kernel(monkeypatch, lambda call, q, k: tuple(q.shape))
    table = _crossover.CrossoverTable.from_json(sdpa_faster_everywhere(
        torch.empty(FLUX_CALL, dtype=torch.bfloat16), tensor_layout="NHD"))
    monkeypatch.setattr(_crossover, "table_for", lambda device, capability, choice=None: table)
    model, inputs = flux(dtype=torch.bfloat16)
    explained: list[Any] = []
    real = sage_diffusers.sageattn

    def explaining(*args: Any, **kwargs: Any) -> Any:
        explained.append(explain(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(sage_diffusers, "sageattn", explaining)
    with torch.no_grad():
        expected = model(**inputs)[0]
        sage_diffusers.register()
        model.set_attention_backend("sageattention2")
        exact = model(**inputs)[0]
        assert kernel_calls == [] and len(explained) == 2
        assert all(not e.quantized and "exact SDPA is faster" in e.reason for e in explained)
        sage_diffusers.register(qk_quant="int8")
        forced = model(**inputs)[0]
    assert kernel_calls == [(1, 2, 24, 16)] * 2  # both calls, each on its [B, H, N, D] view
    assert all(e.quantized for e in explained[2:]) and len(explained) == 4
    assert torch.equal(exact, expected)
    assert cosine_similarity(forced.float(), expected.float()) >= 0.999


def test_backend_arguments() -> None:
    """The backend function as the dispatcher calls it: [B, N, H, D], a [B, N_kv] key mask,
    GQA, scale, the LSE in [B, N, H]; context parallelism supported, but not over uneven shards."""
    sage_diffusers.register()
    backend = attention_dispatch._AttentionBackendRegistry._backends[
        attention_dispatch.AttentionBackendName("sageattention2")]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 7, 4, 16, generator=g)
    k, v = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))
    mask = torch.rand(2, 9, generator=g) > 0.3
    mask[:, 0] = True
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None],
                scale=0.3, enable_gqa=True).transpose(1, 2)
    out = backend(query=q, key=k, value=v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want)
    out, lse = backend(query=q, key=k, value=v, is_causal=True, enable_gqa=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 7, 4)
    scores = torch.einsum("bnhd,bmhd->bhnm", q.double(), k.repeat_interleave(2, 2).double()) / 4
    scores = scores.masked_fill(torch.ones(7, 9, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).transpose(1, 2).float())
    # Context parallelism: supported (tests/test_parallel.py runs it, ulysses_anything and
    # ring_anything too).
    assert attention_dispatch._AttentionBackendRegistry._is_context_parallel_available(
        attention_dispatch.AttentionBackendName("sageattention2"))
    with pytest.raises(ValueError, match="exchange must be one of"):
        sage_diffusers.register(exchange="fp8")


def test_apply_and_remove_on_a_processor_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """SD1.5's UNet (AttnProcessor2_0): apply wraps this model's processors only, its SDPA calls
    run sageattn (same output on the CPU), another model is untouched, remove restores the very
    processors it had."""
    torch.manual_seed(0)
    unet, inputs = models.sd15_unet(torch.device("cpu"), torch.float32, tiny=True)
    other, _ = models.sd15_unet(torch.device("cpu"), torch.float32, tiny=True)
    original = dict(unet.attn_processors)
    with torch.no_grad():
        expected = unet(**inputs)[0]
    counter = CallCounter(monkeypatch, integrations)
    wrapped = sage_diffusers.apply(unet, qk_quant="int8")
    assert wrapped == len(original) > 0
    assert all(isinstance(p, sage_diffusers.SageAttnProcessor) for p in unet.attn_processors.values())
    with torch.no_grad():
        assert torch.equal(unet(**inputs)[0], expected)
        calls = len(counter.calls)
        assert calls == wrapped
        assert torch.nn.functional.scaled_dot_product_attention is integrations.F.scaled_dot_product_attention
        other(**inputs)
    assert len(counter.calls) == calls  # the other UNet still calls SDPA itself
    assert sage_diffusers.remove(unet) == wrapped
    assert all(unet.attn_processors[name] is p for name, p in original.items())
    with torch.no_grad():
        unet(**inputs)
    assert len(counter.calls) == calls
    with pytest.raises(TypeError, match="return_lse"):
        sage_diffusers.apply(unet, return_lse=True)


def sd15() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    return models.sd15_unet(torch.device("cpu"), torch.float32, tiny=True)


SDPA_ARGUMENTS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def options_of(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords of a sageattn call other than SDPA's own (the processors pass those by
    name too)."""
    return {name: value for name, value in kwargs.items() if name not in SDPA_ARGUMENTS}


def test_apply_options_reach_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """apply(model, **options): each SDPA call of the wrapped processors runs sageattn with them
    (and only them: SDPA's calling convention stays)."""
    unet, inputs = sd15()
    counter = CallCounter(monkeypatch, integrations)
    wrapped = sage_diffusers.apply(unet, **OPTIONS)
    with torch.no_grad():
        unet(**inputs)
    assert len(counter.calls) == wrapped > 0
    assert all(options_of(kwargs) == OPTIONS for _, kwargs in counter.calls), \
        [kwargs for _, kwargs in counter.calls]


def test_apply_again_takes_the_new_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """apply on a model whose processors are wrapped already: each takes the new options (and
    only those), wrapping the model's own processor once, not the wrapper again."""
    unet, inputs = sd15()
    original = dict(unet.attn_processors)
    counter = CallCounter(monkeypatch, integrations)
    wrapped = sage_diffusers.apply(unet, **OPTIONS)
    assert sage_diffusers.apply(unet, smooth_k=False) == wrapped
    processors = unet.attn_processors
    assert all(processors[name].inner is p for name, p in original.items())
    assert all(p.options == dict(smooth_k=False) for p in processors.values())
    with torch.no_grad():
        unet(**inputs)
    assert len(counter.calls) == wrapped
    assert all(options_of(kwargs) == dict(smooth_k=False) for _, kwargs in counter.calls), \
        [kwargs for _, kwargs in counter.calls]
    assert sage_diffusers.remove(unet) == wrapped
    assert all(unet.attn_processors[name] is p for name, p in original.items())


def test_processor_reads_attributes_of_the_wrapped_one() -> None:
    """A SageAttnProcessor reads as the processor it wraps (code that inspects a model's
    processors, e.g. IP-Adapter's scale and projections, finds them) and writes to it; its own
    attributes are ``inner`` and ``options``; a name neither has is an AttributeError."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

    inner = IPAdapterAttnProcessor2_0(hidden_size=32, cross_attention_dim=32, num_tokens=(4,),
                                      scale=0.7)
    processor = sage_diffusers.SageAttnProcessor(inner, qk_quant="int8")
    assert processor.scale == [0.7] and processor.num_tokens == (4,)
    assert processor.to_k_ip is inner.to_k_ip
    assert processor.inner is inner and processor.options == dict(qk_quant="int8")
    assert not hasattr(processor, "no_such_attribute")
    processor.scale = [0.2]  # what set_ip_adapter_scale-like code writes reaches the wrapped one
    assert inner.scale == [0.2] and processor.scale == [0.2]


def test_backend_compiles_without_graph_breaks() -> None:
    """torch.compile(fullgraph=True) of the dispatcher model with the backend selected."""
    torch._dynamo.reset()
    model, inputs = flux()
    sage_diffusers.register()
    model.set_attention_backend("sageattention2")
    with torch.no_grad():
        expected = model(**inputs)[0]
        got = torch.compile(model, fullgraph=True, backend="eager")(**inputs)[0]
    torch.testing.assert_close(got, expected)


@pytest.mark.gpu
def test_backend_runs_the_kernel_on_the_gpu(attention_kernel: None, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, Flux in bfloat16 through the backend, under a crossover table (a file named by
    SAGEATTN_CROSSOVER) by which exact SDPA is faster at every shape: with register() every
    attention call runs exact SDPA (qk_quant="auto" follows the table), with
    register(qk_quant="int8") every call runs the quantized kernel, so the option reached
    sageattn and decided. Each call's output at cosine >= 0.999 of SDPA's, and the model's too."""
    from sageattention2 import explain

    table = tmp_path / "sdpa-faster-everywhere.json"
    table.write_text(json.dumps(sdpa_faster_everywhere(
        torch.empty(FLUX_CALL, device="cuda", dtype=torch.bfloat16), tensor_layout="NHD")))
    monkeypatch.setenv(_crossover.ENVIRONMENT, str(table))
    _crossover.clear_cache()
    _execute.clear_call_cache()
    model, inputs = flux("cuda", torch.bfloat16)
    seen: list[tuple[bool, str | None, float]] = []
    real = sage_diffusers.sageattn

    def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = real(q, k, v, *args, **kwargs)
        explanation = explain(q, k, v, *args, **kwargs)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        mask, dropout_p, is_causal, scale, enable_gqa = args  # the backend passes them so
        want = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa).transpose(1, 2)
        seen.append((explanation.quantized, explanation.reason,
                     float(cosine_similarity(out.float(), want.float()))))
        return out

    monkeypatch.setattr(sage_diffusers, "sageattn", checked)
    with torch.no_grad():
        expected = model(**inputs)[0]
        sage_diffusers.register()
        model.set_attention_backend("sageattention2")
        exact = model(**inputs)[0]
        sage_diffusers.register(qk_quant="int8")
        got = model(**inputs)[0]
    assert [quantized for quantized, _, _ in seen] == [False, False, True, True], seen
    assert all("exact SDPA is faster" in (reason or "") for _, reason, _ in seen[:2]), seen
    assert min(cosine for _, _, cosine in seen) >= 0.999, seen
    assert cosine_similarity(exact.float(), expected.float()) >= 0.999
    assert cosine_similarity(got.float(), expected.float()) >= 0.999
