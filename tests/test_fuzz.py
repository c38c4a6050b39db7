"""Fuzz (issue 34, item 6): 500 seeded random configurations of sageattn against the float64
reference: B, Hq/Hkv (GQA), Nq and Nk including 1 and primes, head_dim (zero-padded ones
included), dtype, layout, causal with either alignment, key-padding and per-query masks,
strided inputs, and packed sequences through sageattn_varlen.

On the GPU each configuration runs the 8-bit kernels forced (``qk_quant="int8"``, FP8 or
FP16/BF16 PV), with poisoned outputs, within the documented bounds of whatever served it
(tests/gpu_helpers.py: rel. L1 <= 0.05 with FP8 PV, 0.03 with PV in the input dtype, on randn
inputs; where the call falls back, exact SDPA: bit for bit SDPA's own result on the same
tensors). On the CPU (CI) the same configurations, the smaller ones, run the exact fallback in
float32: the Python layer's handling of every shape, mask and alignment, to float32 rounding.
"""
from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sageattention2 import explain, reference, sageattn, sageattn_varlen
from sageattention2.testing import poison_cuda_allocator, relative_l1

CONFIGS = 500
LENGTHS = (1, 2, 3, 7, 31, 61, 127, 128, 129, 255, 257, 509, 1021, 2053)
HEAD_DIMS = (32, 40, 64, 72, 80, 96, 128)
CPU_MAX_WORK = 1 << 22  # B * Hq * Nq * Nk of the configurations the CPU runs (CI time)


@dataclass(frozen=True)
class Config:
    index: int
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: torch.dtype
    layout: str
    causal: bool
    alignment: str
    mask: str | None      # None, "keys" (a key-padding mask), "query" (a mask per query)
    strided: bool         # q, k, v are views with a padded last-but-one stride
    pv: str               # "fp8" or "none"
    varlen: bool          # packed sequences through sageattn_varlen (then b sequences)

    @property
    def work(self) -> int:
        return self.b * self.hq * self.nq * self.nk


def configs(count: int = CONFIGS, seed: int = 0) -> list[Config]:
    rng = random.Random(seed)
    found = []
    for index in range(count):
        hkv = rng.choice((1, 1, 2, 3, 4))
        hq = hkv * rng.choice((1, 1, 2, 4))
        causal = rng.random() < 0.3
        varlen = rng.random() < 0.1
        mask = None if causal or varlen else rng.choice((None, None, "keys", "query"))
        found.append(Config(
            index, b=rng.choice((1, 1, 2, 3)), hq=hq, hkv=hkv, nq=rng.choice(LENGTHS),
            nk=rng.choice(LENGTHS), d=rng.choice(HEAD_DIMS),
            dtype=rng.choice((torch.float16, torch.bfloat16)),
            layout="NHD" if varlen else rng.choice(("HND", "NHD")), causal=causal,
            alignment=rng.choice(("top_left", "bottom_right")) if causal else "top_left",
            mask=mask, strided=rng.random() < 0.3, pv=rng.choice(("fp8", "fp8", "none")),
            varlen=varlen))
    return found


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str, strided: bool,
            generator: torch.Generator) -> torch.Tensor:
    full = torch.randn(*shape[:-1], 2 * shape[-1] if strided else shape[-1], generator=generator,
                       dtype=torch.float32).to(device=device, dtype=dtype)
    return full[..., :shape[-1]]


def _inputs(c: Config, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """q, k, v in the config's layout (as passed), the float64 [B, H, N, D] views, the mask."""
    g = torch.Generator().manual_seed(1000 + c.index)
    nhd = c.layout == "NHD"
    shape = (lambda n, h: (c.b, n, h, c.d)) if nhd else (lambda n, h: (c.b, h, n, c.d))
    q = _tensor(shape(c.nq, c.hq), dtype, device, c.strided, g)
    k = _tensor(shape(c.nk, c.hkv), dtype, device, c.strided, g)
    v = _tensor(shape(c.nk, c.hkv), dtype, device, c.strided, g)
    mask = None
    if c.mask == "keys":  # each item keeps a contiguous, non-empty range of keys
        keep = torch.zeros(c.b, c.nk, dtype=torch.bool)
        for i in range(c.b):
            start = int(torch.randint(0, c.nk, (1,), generator=g))
            end = int(torch.randint(start + 1, c.nk + 1, (1,), generator=g))
            keep[i, start:end] = True
        mask = keep[:, None, None, :].to(device)
    elif c.mask == "query":
        keep = torch.rand(c.b, 1, c.nq, c.nk, generator=g) > 0.3
        keep[..., 0] = True  # every query sees a key
        mask = keep.to(device)
    return dict(q=q, k=k, v=v, mask=mask)


def _reference(c: Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
    """float64 [B, Hq, Nq, D] (inputs [B, H, N, D]); bottom-right causal as FlashAttention's
    rule, a query that sees no key giving 0."""
    causal = c.causal and c.alignment == "top_left"
    if c.causal and c.alignment == "bottom_right":
        mask = torch.ones(c.nq, c.nk, dtype=torch.bool, device=q.device).tril(c.nk - c.nq)
    return reference.exact_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                     enable_gqa=c.hq != c.hkv)


def _run(c: Config, inputs: dict[str, Any], **options: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(sageattn's output as [B, Hq, Nq, D], the float64 reference, explain() of the call)."""
    q, k, v, mask = inputs["q"], inputs["k"], inputs["v"], inputs["mask"]
    bhnd = (lambda t: t.transpose(1, 2)) if c.layout == "NHD" else (lambda t: t)
    if c.varlen:  # the b items' tokens packed: sequence i is item i (equal lengths here)
        def packed(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, *t.shape[2:])
        cu_q = torch.arange(0, (c.b + 1) * c.nq, c.nq, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (c.b + 1) * c.nk, c.nk, dtype=torch.int32, device=q.device)
        out = sageattn_varlen(packed(q), packed(k), packed(v), cu_q, cu_k, c.nq, c.nk,
                              is_causal=c.causal, causal_alignment=c.alignment, **options)
        out = out.reshape(c.b, c.nq, c.hq, c.d)
        plan = None
    else:
        args: dict[str, Any] = dict(attn_mask=mask, is_causal=c.causal, enable_gqa=c.hq != c.hkv,
                                    tensor_layout=c.layout, causal_alignment=c.alignment)
        out = sageattn(q, k, v, **args, **options)
        plan = explain(q, k, v, **args, **options)
    want = _reference(c, bhnd(q), bhnd(k), bhnd(v), mask)
    return bhnd(out), want, plan


CPU_CONFIGS = [c for c in configs() if c.work <= CPU_MAX_WORK]


def test_fuzz_configurations_are_varied() -> None:
    """The draw covers what the issue lists (a fuzz test that misses a case cannot fail on it)."""
    all_configs = configs()
    assert len(all_configs) == CONFIGS and len(CPU_CONFIGS) >= 300
    for attribute, values in (("nq", {1, 2, 7, 127, 2053}), ("nk", {1, 3, 257, 2053}),
                              ("d", set(HEAD_DIMS)), ("layout", {"HND", "NHD"}),
                              ("alignment", {"top_left", "bottom_right"}),
                              ("mask", {None, "keys", "query"}), ("strided", {True, False}),
                              ("varlen", {True, False}), ("pv", {"fp8", "none"})):
        assert values <= {getattr(c, attribute) for c in all_configs}, attribute
    assert any(c.hq != c.hkv for c in all_configs) and any(c.b > 1 for c in all_configs)


@pytest.mark.parametrize("chunk", range(5))
def test_fuzz_on_cpu(chunk: int) -> None:
    """The exact fallback (CPU, float32) on every configuration small enough: float32 rounding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for c in CPU_CONFIGS[chunk::5]:
            got, want, _ = _run(c, _inputs(c, "cpu", torch.float32))
            assert got.shape == want.shape, c
            err = relative_l1(got, want)
            assert err < 1e-5, (c, err)


def _exact_sdpa(c: Config, inputs: dict[str, Any]) -> torch.Tensor:
    """SDPA on the configuration's own tensors (the [B, H, N, D] views, the mask), as the exact
    fallback calls it, as [B, Hq, Nq, D]: what a fallback must give bit for bit."""
    bhnd = (lambda t: t.transpose(1, 2)) if c.layout == "NHD" else (lambda t: t)
    assert c.mask is not None and not c.causal and not c.varlen
    return torch.nn.functional.scaled_dot_product_attention(
        bhnd(inputs["q"]), bhnd(inputs["k"]), bhnd(inputs["v"]), attn_mask=inputs["mask"],
        enable_gqa=c.hq != c.hkv)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", range(10))
def test_fuzz_on_the_gpu(attention_kernel: None, chunk: int) -> None:
    """Every configuration on the GPU with the 8-bit kernels forced, outputs poisoned: every
    element written and finite; the kernel's within its documented bound of float64 attention
    (gpu_helpers: 0.05 with FP8 PV, 0.03 with PV in the input dtype); a call that falls back
    (masks that are not key-padding ones) bit for bit SDPA's on the same tensors, the fallback
    being exact SDPA (and within 1e-2 of float64, its dtype's rounding)."""
    from gpu_helpers import EXACT_L1, EXACT_L1_FP8

    failures = []
    fallbacks = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for c in configs()[chunk::10]:
            inputs = _inputs(c, "cuda", c.dtype)
            poison_cuda_allocator()
            got, want, plan = _run(c, inputs, qk_quant="int8", pv_quant=c.pv)
            quantized = plan is None or plan.quantized  # varlen: each sequence its own call
            bound = (EXACT_L1_FP8 if c.pv == "fp8" else EXACT_L1) if quantized else 1e-2
            err = relative_l1(got, want) if torch.isfinite(got).all() else math.inf
            if not err <= bound:
                failures.append((c, plan, err, bound))
            if not quantized and c.mask is not None:  # (the GPU's fallbacks: per-query masks)
                fallbacks += 1
                sdpa = _exact_sdpa(c, inputs)
                if not torch.equal(got, sdpa):
                    failures.append((c, plan, "not SDPA's result bit for bit: max difference",
                                     (got.float() - sdpa.float()).abs().max().item()))
    assert not failures, "\n".join(map(str, failures))
    assert fallbacks, "every chunk has configurations with masks that are not key padding"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_256k_tokens(attention_kernel: None, causal: bool) -> None:
    """One head of 256K queries and keys (no index overflow): within the FP8 bound of SDPA's own
    result (the float64 reference would need 512 GB of scores)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    n = 1 << 18
    q, k, v = (torch.randn(1, 1, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    poison_cuda_allocator()
    got = sageattn(q, k, v, is_causal=causal, qk_quant="int8")
    assert torch.isfinite(got).all()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert relative_l1(got, want.double()) < 0.05
