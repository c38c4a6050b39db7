"""Helpers of the CPU tests: inputs, SDPA in either layout, the validated call, builds and GPUs
to pretend for the routing tests, and the inputs and error of the reference tests."""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from sageattention2 import (SageAttentionFallbackWarning, _call, _crossover, _execute, _plan, _tune,
                            api, ops, sageattn)
from sageattention2 import reference as ref
from sageattention2.testing import make_input_family, relative_l1

REPO = Path(__file__).resolve().parents[1]
ORIGINAL_SDPA = F.scaled_dot_product_attention

needs_extension = pytest.mark.skipif(
    not ops.HAS_EXTENSION, reason=f"sageattention2._C not available: {ops.EXTENSION_ERROR}")


def qkv(
    b: int | None = 2,
    hq: int = 4,
    hkv: int | None = None,
    nq: int = 9,
    nk: int | None = None,
    d: int = 16,
    dv: int | None = None,
    dtype: torch.dtype = torch.float32,
    layout: str = "HND",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v; ``b=None`` gives 3-D tensors."""
    hkv = hq if hkv is None else hkv
    nk = nq if nk is None else nk
    dv = d if dv is None else dv
    gen = torch.Generator().manual_seed(0)

    def make(h: int, n: int, dim: int) -> torch.Tensor:
        shape = (h, n, dim) if layout == "HND" else (n, h, dim)
        if b is not None:
            shape = (b, *shape)
        return torch.randn(shape, generator=gen).to(dtype)

    return make(hq, nq, d), make(hkv, nk, d), make(hkv, nk, dv)


def hnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(-3, -2) if layout == "NHD" else t


def sdpa_in_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                   **kwargs: Any) -> torch.Tensor:
    return hnd(ORIGINAL_SDPA(hnd(q, layout), hnd(k, layout), hnd(v, layout), **kwargs), layout)


def quiet_sageattn(*args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        return sageattn(*args, **kwargs)


def fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, SageAttentionFallbackWarning)]


def validated(*args: Any, **kwargs: Any) -> _call.AttentionCall:
    """_call.validate of the call sageattn(*args, **kwargs) (sageattn's defaults and names)."""
    return api.validated_call(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# Pretended GPUs and builds
# ------------------------------------------------------------------------------------------------

ALL_ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"]
# The kernel families of a default build (csrc/torch/module.cpp): what build_info() reports.
PREPROCESS_KEY = "preprocess"
MMA_KEY = "attention_mma"
MMA_FP8_KEY = "attention_mma_fp8"
WGMMA_KEY = "attention_wgmma"
DEFAULT_BUILD = {PREPROCESS_KEY: ALL_ARCHS, MMA_KEY: ALL_ARCHS,
                 MMA_FP8_KEY: ["sm_89", "sm_90a", "sm_100", "sm_120"], WGMMA_KEY: ["sm_90a"]}
# TORCH_CUDA_ARCH_LIST="8.0": no FP8 code at all; and a build from before the FP8 variants.
SM80_BUILD = {PREPROCESS_KEY: ["sm_80"], MMA_KEY: ["sm_80"], MMA_FP8_KEY: []}
OLD_BUILD = {PREPROCESS_KEY: ALL_ARCHS, MMA_KEY: ALL_ARCHS, WGMMA_KEY: ["sm_90a"]}


def meta(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A tensor of ``shape`` on the meta device: the ops' Meta implementations validate their
    arguments as the CUDA ones do, so argument checks are tested without a GPU."""
    return torch.empty(shape, device="meta", dtype=dtype)


def pretend_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                kernels: dict[str, list[str]]) -> None:
    """Make every call look like it runs on a CUDA GPU of ``capability`` with a build whose
    build_info() lists ``kernels`` (and registers both attention ops): the target of every
    device is probed from that build, uncached, so that each test sees its own."""
    archs = sorted({a for built in kernels.values() for a in built})
    monkeypatch.setattr(ops, "HAS_EXTENSION", True)
    monkeypatch.setattr(ops, "build_info", lambda: ops.BuildInfo("13.0", archs, dict(kernels)))
    monkeypatch.setattr(ops, "has_op", lambda name: name in (
        "smoothing_stats", "quantize_kv", "attention_mma", "attention_wgmma",
        "sageattn_wgmma", "sageattn_mma"))
    monkeypatch.setattr(_plan, "target_of", lambda device: _plan.probe_target("cuda", capability))
    _execute.clear_call_cache()  # decisions taken for the machine before


def stand_in_kernel(monkeypatch: pytest.MonkeyPatch,
                    record: Callable[[_execute.KernelCall, torch.Tensor, torch.Tensor], tuple[Any, ...]],
                    ) -> list[tuple[Any, ...]]:
    """CPU calls routed as on an H100, each kernel call replaced by exact attention (float64,
    in the kernel's output layout and dtype, its LSE when asked) on the views it is given;
    ``record(kernel_call, q, k)`` of each call is appended to the returned list. Tests of what
    runs around the kernels (splits into parts, merges) on the CPU."""
    pretend_gpu(monkeypatch, (9, 0), DEFAULT_BUILD)
    seen: list[tuple[Any, ...]] = []

    def exact(self: _execute.KernelCall, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.exact_attention(q, k, v, is_causal=self.is_causal, scale=self.sm_scale,
                                   enable_gqa=q.shape[1] != k.shape[1], return_lse=True)

    def kernel(self: _execute.KernelCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_ranges: torch.Tensor | None = None,
               key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(record(self, q, k) if key_mask is None else ("key_mask", *record(self, q, k)))
        valid = None
        if key_mask is not None:  # the ranges read from the mask (sageattn_wgmma's CPU chain)
            key_ranges, valid = ops.key_ranges_of_mask(key_mask, q.shape[0], _execute.SMOOTHING_SAMPLE_TOKENS)
        if key_ranges is None:
            out, lse = exact(self, q, k, v)
        else:  # the one launch of a key-padding mask: each item on its range of keys
            parts = [exact(self, q[b:b + 1], k[b:b + 1, :, first:end], v[b:b + 1, :, first:end])
                     for b, (first, end, _) in enumerate(key_ranges.tolist())]
            out, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            if valid is not None:  # NaN for the items whose mask is not a key-padding mask
                out[valid == 0] = math.nan
                lse[valid == 0] = math.nan
        out = out.to(q.dtype)
        if self.out_nhd:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return out, lse.float() if self.return_lse else q.new_empty(0, dtype=torch.float32)

    monkeypatch.setattr(_execute.KernelCall, "__call__", kernel)
    return seen


def skip_device_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route CPU calls as if the CPU were a CUDA device of unknown capability: the device rules
    are left out, the others (and the routes, which then see no GPU) apply."""
    monkeypatch.setattr(_plan, "DEVICE_RULES", ())
    _execute.clear_call_cache()


# ------------------------------------------------------------------------------------------------
# The reference tests
# ------------------------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def input_family(name: str, shape: tuple[int, int, int, int],
           seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An input family of docs/PROTOCOL.md#input-families (fp16, CPU) drawn from ``seed``."""
    return make_input_family(name, shape=shape, generator=gen(seed))


def smoothed_input(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Token-varying magnitudes so that different groups get clearly different scales."""
    g = gen(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:3], 1, generator=g))
    return x.half().float()


def simulated_l1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, want: torch.Tensor,
                 **kw: Any) -> float:
    """Relative L1 of reference.sage_attention_reference(q, k, v, **kw) against ``want``."""
    return relative_l1(ref.sage_attention_reference(q, k, v, **kw), want)


class CallCounter:
    """Records the calls of sageattn that ``module`` makes through its global name
    ``sageattn`` (the integrations' tests: which calls reached sageattn, with what)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        real = module.sageattn

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((args, kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "sageattn", counted)


def sdpa_faster_everywhere(probe: torch.Tensor, **options: Any) -> dict[str, Any]:
    """A crossover table (sageattention2/_crossover.py's file) of the kernel that
    ``sageattn(probe, probe, probe, qk_quant="int8", **options)`` runs on this device (pretended
    or real), by which exact SDPA is faster at every shape, head_dim, mask and dtype (the kernel
    at half its speed). Under it qk_quant="auto" runs every call exact SDPA, so that a quantized
    call shows that an explicit qk_quant reached sageattn."""
    choice = _execute.decide(validated(probe, probe, probe, qk_quant="int8", **options)).choice
    gpu, capability = ((torch.cuda.get_device_name(probe.device),
                        list(torch.cuda.get_device_capability(probe.device)))
                       if probe.is_cuda else ("NVIDIA Pretend GPU", [9, 0]))
    return {
        "format": _crossover.FORMAT, "gpu": gpu, "capability": capability, "kernel": list(choice),
        "measured": "test: exact SDPA faster everywhere",
        "axes": {"n_q": [1], "n_k": [1], "heads": [1]},  # one point: clamped, it stands for all
        "classes": [{"head_dim": d, "causal": c, "dtype": t, "speedup": [[[0.5]]]}
                    for d in _tune.HEAD_DIMS for c in (False, True) for t in _tune.DTYPES],
    }
