"""The callers of the authors' ``sageattention`` API, reproduced: each scenario calls the drop-in
(``compat/``, installed on PYTHONPATH) as that caller does, compares with float64 attention, and
on a GPU checks that our kernels ran (a counter on ``sageattention2.ops``' attention entry points).

    python compat_callers.py DEVICE SCENARIO...       (run by tests/test_compat.py)

Exits 0 when every scenario passed; prints one line per scenario.
"""
from __future__ import annotations

import inspect
import math
import sys
import warnings
from typing import Any, Callable

import torch

from sageattention2.testing import relative_l1

DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
ON_GPU = DEVICE.type == "cuda"
# The CPU runs exact attention (the fallback) in float32; the GPU the quantized kernels on bf16
# inputs long enough for sageattn's default to choose the kernel (4096 tokens, head_dim 128).
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOKENS, HEAD_DIM = (4096, 128) if ON_GPU else (96, 32)
OUT_L1 = 0.05 if ON_GPU else 1e-5       # FP8 PV vs float64: ~0.038 (tests/gpu_helpers.py)
# The causal first rows see few keys: one score's INT8 rounding moves their LSE by up to ~0.03.
LSE_ATOL = 0.05 if ON_GPU else 1e-4

SCENARIOS: dict[str, Callable[[], None]] = {}
KERNEL_CALLS = [0]


def scenario(function: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[function.__name__] = function
    return function


def count_kernel_calls() -> None:
    """Count every call of an attention entry point of ``sageattention2.ops`` (what runs a
    quantized kernel; the exact fallback calls none)."""
    from sageattention2 import ops

    for name in dir(ops):
        function = getattr(ops, name)
        if name.startswith(("sageattn_", "attention_")) and callable(function):
            def counted(*args: Any, _function: Any = function, **kwargs: Any) -> Any:
                KERNEL_CALLS[0] += 1
                return _function(*args, **kwargs)
            setattr(ops, name, counted)


class KernelRan:
    """``with KernelRan(what):`` on a GPU, at least one quantized kernel ran inside."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        self.before = KERNEL_CALLS[0]

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None and ON_GPU:
            assert KERNEL_CALLS[0] > self.before, f"{self.what}: no quantized kernel ran"


def qkv(b: int = 1, h: int = 4, n: int = TOKENS, layout: str = "HND", h_kv: int | None = None,
        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs with channel offsets (real Q/K/V), in ``layout``."""
    g = torch.Generator().manual_seed(seed)
    h_kv = h_kv or h

    def draw(heads: int, offset: float) -> torch.Tensor:
        x = torch.randn(b, heads, n, HEAD_DIM, generator=g) + offset * torch.randn(
            1, heads, 1, HEAD_DIM, generator=g)
        x = x.to(DTYPE).to(DEVICE)
        return x.transpose(1, 2).contiguous() if layout == "NHD" else x

    return draw(h, 1.0), draw(h_kv, 3.0), draw(h_kv, 1.0)


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "HND",
          causal: bool = False, scale: float | None = None,
          mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention (``reference.exact_attention``): out in ``layout`` and the natural-log
    LSE ``[B, H, N_q]``."""
    from sageattention2.reference import exact_attention

    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = exact_attention(q, k, v, mask, causal, scale, enable_gqa=q.shape[1] != k.shape[1],
                               return_lse=True)
    return (out.transpose(1, 2) if layout == "NHD" else out), lse


def check(what: str, got: Any, want: tuple[torch.Tensor, torch.Tensor],
          with_lse: bool = False) -> None:
    out, lse = got if with_lse else (got, None)
    assert out.shape == want[0].shape and out.dtype == DTYPE, (what, out.shape, out.dtype)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    error = relative_l1(out, want[0])
    assert error <= OUT_L1, f"{what}: rel. L1 {error:.4f} > {OUT_L1}"
    if with_lse:
        assert lse.dtype == torch.float32 and lse.shape == want[1].shape, (what, lse.shape)
        gap = float((lse.double() - want[1]).abs().max())
        assert gap <= LSE_ATOL, f"{what}: LSE off by {gap:.4f} (natural log, [B, H, N_q])"


# ------------------------------------------------------------------------------------------------
# The authors' README, unchanged
# ------------------------------------------------------------------------------------------------


@scenario
def authors_readme() -> None:
    import sageattention

    for layout in ("HND", "NHD"):
        q, k, v = qkv(layout=layout)
        for causal in (False, True):
            want = exact(q, k, v, layout, causal)
            calls: dict[str, Callable[[], Any]] = {
                "sageattn": lambda: sageattention.sageattn(
                    q, k, v, tensor_layout=layout, is_causal=causal),
                "sageattn_qk_int8_pv_fp16_triton": lambda: sageattention.sageattn_qk_int8_pv_fp16_triton(
                    q, k, v, tensor_layout=layout, is_causal=causal),
                "sageattn_qk_int8_pv_fp16_cuda": lambda: sageattention.sageattn_qk_int8_pv_fp16_cuda(
                    q, k, v, tensor_layout=layout, is_causal=causal, qk_quant_gran="per_warp",
                    pv_accum_dtype="fp32"),
                "sageattn_qk_int8_pv_fp8_cuda": lambda: sageattention.sageattn_qk_int8_pv_fp8_cuda(
                    q, k, v, tensor_layout=layout, is_causal=causal, pv_accum_dtype="fp32+fp32"),
                "sageattn_qk_int8_pv_fp8_cuda_sm90": lambda: sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90(
                    q, k, v, tensor_layout=layout, is_causal=causal),
            }
            for name, call in calls.items():
                with KernelRan(name):
                    check(f"{name} {layout} causal={causal}", call(), want)
        # return_lse: the natural-log LSE [B, H, N_q] in both layouts, the smoothing corrected
        scale = 0.7 / math.sqrt(HEAD_DIM)
        with KernelRan("sageattn return_lse"):
            got = sageattention.sageattn(q, k, v, tensor_layout=layout, sm_scale=scale,
                                         return_lse=True)
        check(f"sageattn return_lse {layout}", got, exact(q, k, v, layout, scale=scale), True)
    # sageattn_varlen: two sequences packed, [total, H, D]
    q, k, v = qkv(b=1, n=TOKENS, layout="NHD")
    q, k, v = (t[0] for t in (q, k, v))
    cut = TOKENS // 3
    cu = torch.tensor([0, cut, TOKENS], dtype=torch.int32, device=DEVICE)
    with KernelRan("sageattn_varlen"):
        got = sageattention.sageattn_varlen(q, k, v, cu, cu, TOKENS - cut, TOKENS - cut,
                                            is_causal=True, sm_scale=None)
    for s, e in ((0, cut), (cut, TOKENS)):
        want = exact(*(t[None, s:e] for t in (q, k, v)), "NHD", True)
        check(f"sageattn_varlen rows {s}:{e}", got[None, s:e], want)


# ------------------------------------------------------------------------------------------------
# ComfyUI: masks only where the signature shows attn_mask; NHD and HND; smooth_k=False
# ------------------------------------------------------------------------------------------------


@scenario
def comfyui() -> None:
    from sageattention import sageattn

    assert "attn_mask" in inspect.signature(sageattn).parameters
    q, k, v = qkv(b=2, layout="HND")
    # ComfyUI's masks: additive, [B, 1, N_q, N_kv] after its unsqueezes
    mask = torch.zeros(2, 1, TOKENS, TOKENS, dtype=DTYPE, device=DEVICE)
    mask[1, ..., TOKENS // 2:] = -math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a full mask runs exact SDPA, with a fallback warning
        got = sageattn(q, k, v, attn_mask=mask, is_causal=False, tensor_layout="HND")
    check("comfyui mask", got, exact(q, k, v, mask=mask))
    for layout in ("HND", "NHD"):
        q, k, v = qkv(layout=layout, seed=3)
        with KernelRan(f"comfyui {layout}"):
            got = sageattn(q, k, v, is_causal=False, tensor_layout=layout, smooth_k=False)
        check(f"comfyui {layout} smooth_k=False", got, exact(q, k, v, layout))


# ------------------------------------------------------------------------------------------------
# diffusers' own sage backends (they check the distribution's version, pass sm_scale and NHD)
# ------------------------------------------------------------------------------------------------


@scenario
def diffusers_backends() -> None:
    from diffusers.models import attention_dispatch as dispatch
    from diffusers.utils import is_sageattention_available, is_sageattention_version

    assert is_sageattention_available() and is_sageattention_version(">=", "2.1.1")
    q, k, v = qkv(b=2, layout="NHD", seed=5)
    scale = 0.9 / math.sqrt(HEAD_DIM)
    names = ["sage", "sage_varlen", "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp8_cuda",
             "_sage_qk_int8_pv_fp16_cuda", "_sage_qk_int8_pv_fp16_triton"]
    for name in names:
        with KernelRan(f"diffusers {name}"):
            got = dispatch.dispatch_attention_fn(q, k, v, scale=scale, backend=name)
        check(f"diffusers {name}", got, exact(q, k, v, "NHD", scale=scale))
    # sage_varlen with a key-padding mask [B, N_kv] (item 1: its first 3/4 of the keys)
    keep = torch.ones(2, TOKENS, dtype=torch.bool, device=DEVICE)
    keep[1, 3 * TOKENS // 4:] = False
    with KernelRan("diffusers sage_varlen mask"):
        got = dispatch.dispatch_attention_fn(q, k, v, attn_mask=keep, backend="sage_varlen")
    check("diffusers sage_varlen mask", got, exact(q, k, v, "NHD", mask=keep[:, None, None, :]))
    # the LSE the backends hand diffusers' context parallelism ([B, N, H] after its permute)
    backend = dispatch._AttentionBackendRegistry._backends[dispatch.AttentionBackendName("sage")]
    with KernelRan("diffusers sage return_lse"):
        out, lse = backend(query=q, key=k, value=v, scale=scale, return_lse=True)
    want_out, want_lse = exact(q, k, v, "NHD", scale=scale)
    check("diffusers sage return_lse", (out, lse), (want_out, want_lse), True)


# ------------------------------------------------------------------------------------------------
# xDiT / yunchang: flash-attn keywords, return_lse merged with another backend's LSE
# ------------------------------------------------------------------------------------------------


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring merge of flash-attn wrappers: out ``[B, N, H, D]`` float, lse ``[B, N, H, 1]``."""
    block_lse = block_lse.transpose(-2, -1).unsqueeze(-1)
    out = out - torch.sigmoid(block_lse - lse) * (out - block_out.float())
    lse = lse - torch.nn.functional.logsigmoid(lse - block_lse)
    return out, lse


@scenario
def xdit_lse_merge() -> None:
    from sageattention import sageattn

    q, k, v = qkv(layout="NHD", seed=7)
    half = TOKENS // 2
    want_out, want_lse = exact(q, k, v, "NHD", causal=False)
    # first half of the keys: ours, with flash-attn's keywords as a ring wrapper passes them
    with KernelRan("xdit first half"):
        out1, lse1 = sageattn(q, k[:, :half], v[:, :half], tensor_layout="NHD", return_lse=True,
                              dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_softmax=False)
    # second half: another backend's (float64 here) output and LSE
    out2, lse2 = exact(q, k[:, half:], v[:, half:], "NHD")
    out, lse = out1.float(), lse1.transpose(-2, -1).unsqueeze(-1)
    out, lse = merge(out, lse, out2.float(), lse2.float())
    check("xdit merged", out.to(DTYPE), (want_out, want_lse))
    gap = float((lse.squeeze(-1).transpose(1, 2).double() - want_lse).abs().max())
    assert gap <= LSE_ATOL, f"merged LSE off by {gap:.4f}"
    # xDiT 0.7.0's own SAGE backend (xfuser/core/distributed/attention_backend.py): HND
    # tensors, positional, `sageattn(query, key, value, is_causal=..., return_lse=True)`, the LSE
    # merged by its ring as above.
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for causal in (False, True):
        with KernelRan("xdit backend call"):
            got = sageattn(q, k, v, is_causal=causal, return_lse=True)
        check(f"xdit backend call causal={causal}", got, exact(q, k, v, "HND", causal), True)


@scenario
def yunchang_kernels() -> None:
    """yunchang's fwd-only kernels for each SAGE attention type, called as its ring calls them."""
    from yunchang.kernels import AttnType, select_flash_attn_impl

    q, k, v = qkv(layout="NHD", seed=9)
    for causal in (False, True):
        want = exact(q, k, v, "NHD", causal=causal)
        for kind in (AttnType.SAGE_AUTO, AttnType.SAGE_FP8, AttnType.SAGE_FP8_SM90,
                     AttnType.SAGE_FP16, AttnType.SAGE_FP16_TRITON):
            fn = select_flash_attn_impl(kind, stage="fwd-only")
            with KernelRan(f"yunchang {kind}"):
                got = fn(q, k, v, dropout_p=0.0, softmax_scale=q.shape[-1] ** -0.5, causal=causal,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         return_softmax=False)
            check(f"yunchang {kind.value} causal={causal}", got, want, True)


@scenario
def refusals() -> None:
    """What the authors' functions swallow, the drop-in refuses, naming the keyword."""
    import sageattention

    q, k, v = qkv(n=64)
    cases: list[tuple[type[Exception], str, Callable[[], Any]]] = [
        (TypeError, "flash_attention_mode", lambda: sageattention.sageattn(
            q, k, v, flash_attention_mode=True)),
        (NotImplementedError, "window_size", lambda: sageattention.sageattn(
            q, k, v, window_size=(8, 0))),
        (NotImplementedError, "alibi_slopes", lambda: sageattention.sageattn_qk_int8_pv_fp8_cuda(
            q, k, v, alibi_slopes=torch.ones(4))),
        (ValueError, "pv_accum_dtype", lambda: sageattention.sageattn_qk_int8_pv_fp16_cuda(
            q, k, v, pv_accum_dtype="fp8")),
        (ValueError, "qk_quant_gran", lambda: sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90(
            q, k, v, qk_quant_gran="per_block")),
        (ValueError, "causal", lambda: sageattention.sageattn(q, k, v, is_causal=True,
                                                              causal=False)),
    ]
    for error, word, call in cases:
        try:
            call()
        except error as raised:
            assert word in str(raised), (word, str(raised))
        else:
            raise AssertionError(f"{word}: accepted")


def main() -> None:
    import os

    import mutants  # a behaviour broken on purpose (tests/mutants.py), here too

    if os.environ.get(mutants.ENVIRONMENT):
        mutants.apply(os.environ[mutants.ENVIRONMENT])
    if ON_GPU:
        count_kernel_calls()
    for name in sys.argv[2:]:
        SCENARIOS[name]()
        print(f"ok {name} (quantized kernel calls so far: {KERNEL_CALLS[0]})", flush=True)


if __name__ == "__main__":
    main()
