"""The bit-level reference of the 8-bit backward (issue 51, tier 2): what the Hopper backward
kernel's INT8 products are to match, and the accuracy figures of the scheme before any kernel.

The exact backward (``_backward``) is FlashAttention-2's from the forward's O and LSE. The 8-bit
tier quantizes three of its five products to INT8, the ones a Hopper kernel can run with the
8-bit operand in registers (session 43's bound: a shared-memory ``wgmma`` at N = 64 already
reads 128 bytes per tensor cycle in 16 bits, the whole port, so an INT8 product with both
operands in shared memory would halve its own rate of use; with A in registers it reads 64):

- ``S^T = K Q^T`` (P recomputed), K per key row (K centered over tokens by ``_backward``, the
  paper's Sec. 3.2), Q smoothed: its mean over tokens ``q_mean`` is subtracted and the rows
  quantized one scale each; the mean's scores ``q_mean . k`` are added in float32 (SageAttention2's
  Delta S, exact). Session 42's emulation: without the smoothing bias4 misses CosSim 0.999.
- ``dV += P^T dO`` per 64-query block: P^T one scale per key row over the block's queries (P >= 0:
  codes 0..127), dO one scale per channel over all its tokens (a fixed P scale zeroes the small P
  of even heads: session 42, bias0 dV 0.70).
- ``dK += scale dS^T Q`` per 64-query block: dS^T one scale per key row over the block, Q one
  scale per channel over all its tokens (Q as it is: the smoothing's correction would need a
  second accumulator, and per-channel scales absorb channel offsets).

The channel scales are per head, not per block (session 44: the same CosSim within 2e-5 on the
families): they factor out of the sum over blocks, so the kernel converts each block's int32
product and multiplies it by the key's scale only, and applies the channel scales once, at the
end. E4M3 in place of INT8 for these two products (the same scales, 448 for 127) measured 5-10x
further from float64 (dV 0.9992-0.9995 against 0.9999).

``dP = dO V^T`` and ``dQ = scale dS K`` stay in 16 bits (SageBwd's finding for dP; for dQ the
shared-memory port above). The quantizers are ``reference.quantize_symmetric`` (float32,
round half to even); every other step is float64, so the figures isolate the quantization.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .reference import quantize_symmetric

BLOCK_Q = 64  # the kernel's Q block: the granularity of the dV and dK scales
INT8_MAX = 127


def quantize_rows_smoothed(q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q for the INT8 ``S^T``: its mean over tokens ``[B, H, 1, D]`` float32, and ``q - mean``'s
    codes ``[B, H, N, D]`` int8 with one float32 scale per row ``[B, H, N, 1]``."""
    mean = q.float().mean(dim=2, keepdim=True)
    codes, scale = quantize_symmetric(q.float() - mean, (3,), INT8_MAX)
    return mean, codes, scale


def scores_int8(q: Tensor, k: Tensor) -> Tensor:
    """``Q K^T`` ``[B, H, Nq, Nk]`` float64 as the 8-bit tier recomputes it: smoothed Q rows and K
    rows in INT8, their integer dot products scaled, plus the mean's scores in float32."""
    mean, q_codes, q_scale = quantize_rows_smoothed(q)
    k_codes, k_scale = quantize_symmetric(k.float(), (3,), INT8_MAX)
    dots = q_codes.double() @ k_codes.double().transpose(-1, -2)  # exact: |sum| < 2^53
    mean_scores = (mean @ k.float().transpose(-1, -2)).double()  # [B, H, 1, Nk], float32
    return dots * q_scale.double() * k_scale.double().transpose(-1, -2) + mean_scores


def _blocks(x: Tensor) -> Tensor:
    """``[B, H, N, C]`` -> ``[B, H, N_pad / 64, 64, C]``, zero rows past N."""
    n = x.shape[2]
    padded = torch.nn.functional.pad(x, (0, 0, 0, -n % BLOCK_Q))
    return padded.view(*x.shape[:2], padded.shape[2] // BLOCK_Q, BLOCK_Q, x.shape[3])


def product_int8_per_block(left_t: Tensor, right: Tensor) -> Tensor:
    """``left_t^T right`` summed over 64-query blocks with INT8 operands: ``left_t`` ``[B, H, Nq,
    Nk]`` (P or dS, queries first) one scale per key and block, ``right`` ``[B, H, Nq, D]`` (dO or
    Q) one scale per channel over all its tokens; each block's integer product times its key
    scales, summed in float64 over the blocks, times the channel scales. ``[B, H, Nk, D]``."""
    left_codes, left_scale = quantize_symmetric(_blocks(left_t), (3,), INT8_MAX)  # [B,H,b,1,Nk]
    right_codes, right_scale = quantize_symmetric(right, (2,), INT8_MAX)  # [B,H,1,D]
    dots = left_codes.double().transpose(-1, -2) @ _blocks(right_codes.double())  # [B, H, b, Nk, D]
    return (dots * left_scale.double().transpose(-1, -2)).sum(2) * right_scale.double()


def backward_8bit_reference(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                            lse: Tensor, is_causal: bool, scale: float, *, scores: bool = True,
                            dv: bool = True, dk: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV (float64) of attention at ``q, k, v`` ``[B, H, N, D]`` (equal heads; k centered
    by the caller as ``_backward`` does) from the forward's ``out`` and natural-log ``lse`` ``[B,
    H, Nq]``, with the products named (``scores``: S^T, ``dv``, ``dk``) in INT8 as the module
    docstring says; the others, and all with every flag off, exact in float64."""
    qd, kd, vd, dod = (t.double() for t in (q, k, v, grad_out))
    s = scores_int8(q, k) if scores else qd @ kd.transpose(-1, -2)
    s = s * scale
    if is_causal:
        n_q, n_k = q.shape[2], k.shape[2]
        later = torch.arange(n_k, device=q.device) > torch.arange(n_q, device=q.device)[:, None]
        s = s.masked_fill(later, -torch.inf)
    lse = lse.double()
    p = torch.exp(s - torch.where(lse == -torch.inf, torch.inf, lse)[..., None])
    delta = (dod * out.double()).sum(-1, keepdim=True)
    ds = p * (dod @ vd.transpose(-1, -2) - delta)
    grad_v = product_int8_per_block(p, grad_out) if dv else p.transpose(-1, -2) @ dod
    grad_k = scale * (product_int8_per_block(ds, q) if dk else ds.transpose(-1, -2) @ qd)
    grad_q = scale * (ds @ kd)
    return grad_q, grad_k, grad_v
