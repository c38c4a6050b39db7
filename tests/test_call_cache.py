"""sageattn remembers how it ran each kind of call (shapes, dtypes, devices, options): a repeated
call skips validation and routing and gives what the first one gave, on the quantized path and
the fallback, in every layout and rank; a call of another kind (another option, its type, the
grad state) is decided afresh."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from helpers import ORIGINAL_SDPA, qkv
from sageattention2 import SageAttentionFallbackWarning, _execute, api, sageattn
from test_quantized_path import stand_in  # noqa: F401  (the fixture)


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts sageattn's validations (one per call it decides)."""
    count = [0]
    real = api.validate

    def counting(*args: Any) -> Any:
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(api, "validate", counting)
    return count


def as_tuple(result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("batch", [2, None], ids=["4d", "3d"])
@pytest.mark.parametrize("options", [{}, {"return_lse": True}, {"is_causal": True, "scale": 0.3}],
                         ids=["plain", "lse", "causal-scale"])
@pytest.mark.parametrize("d", [64, 40], ids=["hd64", "hd40-padded"])
def test_repeated_quantized_call(stand_in: list[dict[str, Any]], validations: list[int],  # noqa: F811
                                 layout: str, batch: int | None, options: dict[str, Any], d: int) -> None:
    q, k, v = qkv(b=batch, hkv=2, nq=70, nk=90, d=d, dtype=torch.float16, layout=layout)
    kwargs = dict(tensor_layout=layout, enable_gqa=True, strict=True, **options)
    first = as_tuple(sageattn(q, k, v, **kwargs))
    assert validations[0] == 1 and len(stand_in) == 1
    q2, k2, v2 = (t.clone() for t in (q, k, v))  # other tensors, same kind of call
    again = as_tuple(sageattn(q2, k2, v2, **kwargs))
    assert validations[0] == 1 and len(stand_in) == 2  # not validated again; the kernel ran
    assert len(again) == len(first)
    for a, b in zip(again, first):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    # The kernel got the same arguments (its tensors compared by value).
    for name, value in stand_in[0].items():
        other = stand_in[1][name]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("batch", [2, None], ids=["4d", "3d"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_repeated_fallback_call(validations: list[int], layout: str, batch: int | None,
                                masked: bool) -> None:
    """A CPU call falls back; repeated, it is exact SDPA without validation, and once the warning
    may show again (here: the set of shown reasons cleared) it shows, pointing at the caller."""
    q, k, v = qkv(b=batch, nq=5, nk=7, layout=layout)
    mask = (torch.rand(5, 7, generator=torch.Generator().manual_seed(4)) > 0.3) if masked else None
    with warnings.catch_warnings(record=True) as first_record:
        warnings.simplefilter("always")
        first = sageattn(q, k, v, attn_mask=mask, tensor_layout=layout)
    assert validations[0] == 1 and len(first_record) == 1
    _execute._warned_reasons.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        again = sageattn(q, k, v, attn_mask=mask, tensor_layout=layout)
    assert validations[0] == 1
    assert torch.equal(again, first) and again.stride() == first.stride()
    [warning] = record
    assert issubclass(warning.category, SageAttentionFallbackWarning)
    assert warning.filename == __file__ == first_record[0].filename
    bhnd = (lambda t: t.transpose(-3, -2)) if layout == "NHD" else (lambda t: t)
    assert torch.equal(again, bhnd(ORIGINAL_SDPA(bhnd(q), bhnd(k), bhnd(v), attn_mask=mask)))


def test_argument_types_are_part_of_the_kind(validations: list[int]) -> None:
    """``is_causal=1`` is an error even after ``is_causal=True`` (equal, and equally hashed)."""
    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sageattn(q, k, v, is_causal=True)
        sageattn(q, k, v, is_causal=True)
    assert validations[0] == 1
    for _ in range(2):
        with pytest.raises(TypeError, match="is_causal must be a bool"):
            sageattn(q, k, v, is_causal=1)


def test_grad_state_is_part_of_the_kind(stand_in: list[dict[str, Any]],  # noqa: F811
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same shapes requiring grad are not served from the no-grad call's remembered
    decision: by default they fall back (exact SDPA and its backward); with
    SAGEATTN_TRAINING=quantized they take the training path (the graph op: the quantized
    forward, then the exact backward), with a key-padding mask too, except with a mask that
    requires grad, whose gradient that backward does not give (a fallback naming it)."""
    q, k, v = qkv(d=64, dtype=torch.float16)
    sageattn(q, k, v)
    assert len(stand_in) == 1
    mask = torch.ones(q.shape[0], 1, 1, k.shape[-2], dtype=torch.bool)
    bias = torch.zeros(mask.shape, requires_grad=True)
    for env, kwargs, runs, reason in ((None, {}, 0, "SAGEATTN_TRAINING=exact"),
                                      ("quantized", {}, 1, None),
                                      ("quantized", {"attn_mask": mask}, 1, None),
                                      ("quantized", {"attn_mask": bias}, 0,
                                       "an attn_mask that requires grad")):
        if env is not None:
            monkeypatch.setenv("SAGEATTN_TRAINING", env)
        before = len(stand_in)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = sageattn(q.requires_grad_(), k, v, **kwargs)
        assert len(stand_in) == before + runs and out.requires_grad
        messages = [str(w.message) for w in record if "require grad" in str(w.message)]
        assert (reason is None and not messages) or (messages and reason in messages[0]), messages
    with torch.no_grad():
        sageattn(q, k, v)
    assert len(stand_in) == 4


def test_unhashable_option_is_validated() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="tensor_layout"):
        sageattn(q, k, v, tensor_layout=["HND"])  # type: ignore[arg-type]


class _Tagged(torch.Tensor):
    """A tensor subclass (its __torch_function__ is torch.Tensor's)."""


def test_tensor_subclasses_are_validated_every_call(validations: list[int]) -> None:
    """The cache (csrc/torch/call_cache.cpp) keys plain tensors only: a subclass's call is
    decided each time, in Python, and gives what the plain call gives."""
    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = sageattn(q, k, v)
        tagged = [t.as_subclass(_Tagged) for t in (q, k, v)]
        for expected_validations in (2, 3):
            out = sageattn(*tagged)
            assert validations[0] == expected_validations
            assert torch.equal(out, plain)
        sageattn(q, k, v)
    assert validations[0] == 3  # the plain call was remembered


def test_calls_under_a_torch_function_mode_are_validated(validations: list[int]) -> None:
    """Under an active TorchFunctionMode the mode sees SDPA's call, as with the Python path: the
    cache is not asked (it would call SDPA from C++, past the mode)."""
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    q, k, v = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sageattn(q, k, v)
        assert validations[0] == 1
        with Recording():
            sageattn(q, k, v)
            sageattn(q, k, v)
    assert validations[0] == 3
    assert seen.count("scaled_dot_product_attention") == 2


def test_exact_calls_run_from_the_cache(validations: list[int]) -> None:
    """A kind the Python path decided to run as exact SDPA on the caller's tensors runs from the
    cache: SDPA's result bit for bit, with the call's own arguments, without validation."""
    q, k, v = qkv(nq=11, nk=13)
    options = (0.0, True, 0.25, False, "HND", "auto", "auto", True, "auto", "auto", False, False,
               "top_left")
    assert _execute.native_calls is not None
    _execute.native_calls.remember(q, k, v, None, options, None, True)
    for _ in range(2):
        out = sageattn(q.clone(), k, v, is_causal=True, scale=0.25)
        assert torch.equal(out, ORIGINAL_SDPA(q, k, v, is_causal=True, scale=0.25))
    assert validations[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sageattn(q, k, v, is_causal=True, scale=0.5)  # another scale: another kind
    assert validations[0] == 1
