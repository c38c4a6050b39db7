"""sageattention2.integrations.diffusers on real diffusers classes at tiny sizes: the dispatcher
backend ("sageattention2": registration, set_attention_backend, the attention_backend context,
its arguments) and the per-model processors (apply / remove). On the CPU every call is exact
SDPA (the fallback), so results must equal the native backend's bit for bit; on the GPU the
quantized kernel runs (forced: tiny shapes are exact SDPA's under qk_quant="auto")."""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers import CallCounter

diffusers = pytest.importorskip("diffusers")

from diffusers.models import attention_dispatch  # noqa: E402

from sageattention2 import integrations  # noqa: E402
from sageattention2.integrations import diffusers as sage_diffusers  # noqa: E402
from sageattention2 import _model_suite as models  # noqa: E402  (the tiny configs of the classes)
from sageattention2.testing import cosine_similarity  # noqa: E402



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


def test_backend_arguments() -> None:
    """The backend function as the dispatcher calls it: [B, N, H, D], a [B, N_kv] key mask,
    GQA, scale, the LSE in [B, N, H], and a clear refusal of context parallelism."""
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
    with pytest.raises(NotImplementedError, match="context parallelism"):
        backend(query=q, key=k, value=v, _parallel_config=object())


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
def test_backend_runs_the_kernel_on_the_gpu(attention_kernel: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU, Flux in bfloat16 through the backend with the kernel forced: every attention
    call quantized, each call's output at cosine >= 0.999 of SDPA's, and the model's too."""
    from sageattention2 import explain

    model, inputs = flux("cuda", torch.bfloat16)
    sage_diffusers.register(qk_quant="int8")
    seen: list[float] = []
    real = sage_diffusers.sageattn

    def checked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = real(q, k, v, *args, **kwargs)
        assert explain(q, k, v, *args, **kwargs).quantized
        sdpa = torch.nn.functional.scaled_dot_product_attention
        mask, dropout_p, is_causal, scale, enable_gqa = args  # the backend passes them so
        want = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa).transpose(1, 2)
        seen.append(float(cosine_similarity(out.float(), want.float())))
        return out

    monkeypatch.setattr(sage_diffusers, "sageattn", checked)
    with torch.no_grad():
        expected = model(**inputs)[0]
        model.set_attention_backend("sageattention2")
        got = model(**inputs)[0]
    assert len(seen) == 2 and min(seen) >= 0.999, seen
    assert cosine_similarity(got.float(), expected.float()) >= 0.999
