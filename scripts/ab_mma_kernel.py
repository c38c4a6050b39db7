"""One row of scripts/ab_builds.sh's table for BENCH=mma: the warp-level kernel's INT8 QK + FP16 PV
variant alone (attention_mma on inputs prepared as sageattn prepares them), ANCHORS protocol
(B4 H32 fp16 randn, HND), TOPS = 4*B*H*N*N*D / time (halved for causal), median of three
do_bench medians. SDPA flash of the same process as the last row's reference.

    python3 scripts/ab_mma_kernel.py LABEL
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from sageattention2 import ops

LOG2E = 1.4426950408889634


def median_ms(f) -> float:
    return sorted(do_bench(f, warmup=25, rep=150, return_mode="median") for _ in range(3))[1]


def main() -> None:
    label = sys.argv[1]
    cells, flash = [], []
    for d in (128, 64):
        for n in (1024, 4096, 16384):
            q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
            mult = d ** -0.5 * LOG2E
            st = ops.smoothing_stats(q, k, None, False)
            qc, qs, _ = ops.quantize_q(q, st.q_mean, ops.MMA_BLOCK_Q, ops.MMA_WARPS, "int8", False, mult)
            kv = ops.quantize_kv(k, None, st.k_mean, None, None, st.q_mean, ops.MMA_BLOCK_K, "int8", mult)
            for causal in (False, True):
                ops_count = 4 * 4 * 32 * n * n * d / (2 if causal else 1)
                f = lambda: torch.ops.sageattention2.attention_mma(  # noqa: E731
                    qc, qs, kv.k_quant, kv.k_scale, kv.delta_s, v, None, None, "int8", n, n, q.dtype, causal,
                    False, False)
                cells.append(f"{ops_count / median_ms(f) / 1e9:.0f}")
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    g = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                    flash.append(f"{ops_count / median_ms(g) / 1e9:.0f}")
            del q, k, v, qc, kv
            torch.cuda.empty_cache()
    print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    print(f"| SDPA flash ({label}'s run) | " + " | ".join(flash) + " |", flush=True)


if __name__ == "__main__":
    main()
