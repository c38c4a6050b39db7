"""The paper's quantization-granularity ablations, on top of the reference simulator.

The kernels quantize Q and K per thread (paper Eq. 8), the Hopper kernel's Q per token
(``reference.quantize_kernel_rows``). The paper compares them with coarser granularities (2.2,
2.3, Table 6): one scale per block of tokens (SageAttention) and one per tensor.
:func:`quantize_rows` quantizes at any of the four and :func:`sage_attention_ablation` runs
``reference.sage_attention_reference`` with it, so the ablations share the simulator's every
other switch (smoothing, PV precision, accumulation) with the kernels' emulation.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from . import reference as ref

__all__ = [
    "GRANULARITIES",
    "quantize_per_block",
    "quantize_per_tensor",
    "quantize_rows",
    "sage_attention_ablation",
]

GRANULARITIES = ("thread", "token", "block", "tensor")


def quantize_per_block(x: Tensor, block: int, qmax: int) -> tuple[Tensor, Tensor]:
    """Per-block quantization as in SageAttention (paper 2.3).

    Returns codes int8 [B,H,N_pad,D] and scale float32 [B,H,N_pad/block].
    """
    B, H, _, D = x.shape
    xp = ref.pad_tokens(x.float(), block)
    n_pad = xp.shape[2]
    codes, scale = ref.quantize_symmetric(xp.view(B, H, n_pad // block, block, D), (3, 4), qmax)
    return codes.view(B, H, n_pad, D), scale.view(B, H, n_pad // block)


def quantize_per_tensor(x: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """Per-tensor quantization (paper 2.2): one scale for the whole [B,H,N,D] tensor (all heads)."""
    codes, scale = ref.quantize_symmetric(x, (0, 1, 2, 3), qmax)
    return codes, scale.reshape(())


def quantize_rows(
    x: Tensor,
    qk_dtype: str,
    granularity: str,
    role: str,
    block: int,
    warps: int = 4,
) -> tuple[Tensor, Tensor]:
    """Quantize Q (role "q", block = block_q) or K (role "k", block = block_k) at a granularity
    ("thread", "token", "block", "tensor") for the simulation (a ``reference.RowQuantizer``).

    Returns the integer codes as float64 [B,H,N,D] (padding dropped) and each token's scale as
    float64 [B,H,N] (broadcastable for "tensor"), so that x ~ codes * scale[..., None] and
    Q K^T ~ (codes_q codes_k^T) * scale_q scale_k^T exactly as the dequantization of paper 2.2.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity in ref.KERNEL_GRANULARITIES:
        return ref.quantize_kernel_rows(x, qk_dtype, granularity, role, block, warps)
    if role not in ("q", "k"):
        raise ValueError("role must be 'q' or 'k'")
    qmax = ref.int_qmax(qk_dtype)
    n = x.shape[2]
    if granularity == "block":
        codes, scale = quantize_per_block(x, block, qmax)
        rows = scale[:, :, torch.arange(n, device=scale.device) // block]
    else:
        codes, scale = quantize_per_tensor(x, qmax)
        rows = scale.reshape(1, 1, 1).expand(1, 1, n)
    return codes[:, :, :n].double(), rows.double()


def sage_attention_ablation(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    granularity: str = "thread",
    q_granularity: Optional[str] = None,
    **switches: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """``reference.sage_attention_reference`` with Q and K quantized at ``granularity`` (Q at
    ``q_granularity`` when given) of :data:`GRANULARITIES`; ``switches`` are the simulator's
    other keyword arguments."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if q_granularity is not None and q_granularity not in GRANULARITIES:
        raise ValueError(f"q_granularity must be None or one of {GRANULARITIES}, got "
                         f"{q_granularity!r}")
    return ref.sage_attention_reference(q, k, v, granularity=granularity,
                                        q_granularity=q_granularity, row_quantizer=quantize_rows,
                                        **switches)
