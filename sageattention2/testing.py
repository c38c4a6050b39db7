"""Test utilities, for users comparing sageattn with exact attention and for our tests: the
accuracy metrics of the paper (A.7), the input families of docs/PROTOCOL.md#input-families, and a
poisoned CUDA allocator for catching outputs a kernel forgot to write."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["cosine_similarity", "make_input_family", "poison_cuda_allocator", "relative_l1",
           "rmse"]


# --------------------------------------------------------------------------------------------
# Accuracy metrics (paper A.7), O = reference, O' = output, both flattened, float64
# --------------------------------------------------------------------------------------------


def cosine_similarity(output: Tensor, reference: Tensor) -> float:
    """CosSim = sum(O O') / (sqrt(sum O^2) sqrt(sum O'^2)) (paper A.7)."""
    a, b = output.double().flatten(), reference.double().flatten()
    return float((a * b).sum() / (a.square().sum().sqrt() * b.square().sum().sqrt()))


def relative_l1(output: Tensor, reference: Tensor) -> float:
    """L1 = sum |O - O'| / sum |O| with O the full-precision reference (paper A.7)."""
    a, b = output.double().flatten(), reference.double().flatten()
    return float((b - a).abs().sum() / b.abs().sum())


def rmse(output: Tensor, reference: Tensor) -> float:
    """RMSE = sqrt(mean (O - O')^2) (paper A.7)."""
    a, b = output.double().flatten(), reference.double().flatten()
    return float((b - a).square().mean().sqrt())


# --------------------------------------------------------------------------------------------
# Input families (docs/PROTOCOL.md#input-families)
# --------------------------------------------------------------------------------------------


def make_input_family(
    name: str,
    shape: tuple[int, int, int, int] = (1, 8, 4096, 128),
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of an accuracy family of docs/PROTOCOL.md#input-families, each [B,H,N,D] in
    ``dtype``.

    * "bias0": q, k, v ~ randn (nearly uniform attention).
    * "bias4": plus 4 * randn(B,H,1,D) per tensor (a channel-wise offset shared by all tokens).
    * "outliers": 6 random channels of q and k (the same 6) times 12, and k += 6 * randn(B,H,1,D).

    Draw order: q, k, v, then the bias of q, k, v ("bias4") or the channel permutation and the
    bias of k ("outliers"). All arithmetic in ``dtype``, as the protocol's recipe does in fp16.
    """
    B, H, _, D = shape

    def randn(*size: int) -> Tensor:
        return torch.randn(size, dtype=dtype, device=device, generator=generator)

    q, k, v = randn(*shape), randn(*shape), randn(*shape)
    if name == "bias0":
        pass
    elif name == "bias4":
        q = q + 4 * randn(B, H, 1, D)
        k = k + 4 * randn(B, H, 1, D)
        v = v + 4 * randn(B, H, 1, D)
    elif name == "outliers":
        channels = torch.randperm(D, generator=generator, device=device)[:6]
        q[..., channels] *= 12
        k[..., channels] *= 12
        k = k + 6 * randn(B, H, 1, D)
    else:
        raise ValueError(f"unknown input family {name!r} (bias0, bias4, outliers)")
    return q, k, v


# --------------------------------------------------------------------------------------------
# Poisoned memory
# --------------------------------------------------------------------------------------------


def poison_cuda_allocator(device: torch.device | str = "cuda") -> None:
    """Free 0xFF blocks to both pools of the caching allocator (large: > 1 MB, small: <= 1 MB),
    after returning the other cached blocks, so that the next allocations land on NaN bytes (in
    fp16/bf16/fp32): an element an op forgot to write comes out NaN. Nothing for a non-CUDA
    ``device``."""
    if torch.device(device).type != "cuda":
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    large = torch.empty(256 << 20, dtype=torch.uint8, device=device).fill_(0xFF)
    small = [torch.empty(512 << 10, dtype=torch.uint8, device=device).fill_(0xFF)
             for _ in range(16)]
    del large, small
