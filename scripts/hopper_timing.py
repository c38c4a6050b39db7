"""What the Hopper timing scripts (smoke_wgmma.py, prepare_sweep.py, ab_env.py) share: the
ANCHORS protocol's inputs (B4 H32 fp16 randn), do_bench medians, the SDPA baselines, the kernel
alone on K and V quantized once, and TOPS as ANCHORS.md counts them."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from sageattention2 import ops

BATCH, HEADS = 4, 32
FLASH, CUDNN = SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION


def ms(fn, rep: int = 150) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def sdpa_ms(backend, q, k, v, causal: bool, rep: int = 150) -> float:
    with sdpa_kernel(backend):
        return ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), rep)


def anchors_inputs(n: int, d: int):
    """q, k, v of the protocol, and K and V quantized once (sageattn's K smoothing, the Hopper
    kernel's layout) for timing the kernel alone."""
    q, k, v = (torch.randn(BATCH, HEADS, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    stats = ops.smoothing_stats(None, k, None, False)
    kv = ops.quantize_kv(k, v, stats.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    return q, k, v, kv


def kernel_alone(q, kv, causal: bool):
    """The Hopper kernel on anchors_inputs' quantized K and V, as a callable to time."""
    n, d = q.shape[2], q.shape[3]
    return lambda: ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None, None, n,
                                       d ** -0.5, causal, False, False)


def tops(milliseconds: float, n: int, d: int, causal: bool) -> float:
    """4 * B * H * N^2 * D operations (QK and PV), halved under the causal mask, per time."""
    return 4 * BATCH * HEADS * n * n * d / (2 if causal else 1) / milliseconds / 1e9
