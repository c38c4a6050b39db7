"""One row of scripts/ab_builds.sh's table for BENCH=mma: the warp-level kernel's INT8 QK + FP16 PV
variant alone (benchmarks/bench_mma_variants.py's kernel_call: attention_mma on inputs prepared
as sageattn prepares them), ANCHORS protocol (B4 H32 fp16 randn, HND), TOPS = 4*B*H*N*N*D / time
(halved for causal), median of three median_ms. SDPA flash of the same process as a second row.

    python3 scripts/ab_mma_kernel.py LABEL
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_mma_variants import flash_call, kernel_call  # noqa: E402
from common import median_ms  # noqa: E402


def median_of_three(fn) -> float:
    return sorted(median_ms(fn) for _ in range(3))[1]


def main() -> None:
    label = sys.argv[1]
    cells, flash = [], []
    for d in (128, 64):
        for n in (1024, 4096, 16384):
            q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
            for causal in (False, True):
                ops_count = 4 * 4 * 32 * n * n * d / (2 if causal else 1)
                cells.append(f"{ops_count / median_of_three(kernel_call(q, k, v, causal, 'int8', False)) / 1e9:.0f}")
                flash.append(f"{ops_count / median_of_three(flash_call(q, k, v, causal)) / 1e9:.0f}")
            del q, k, v
            torch.cuda.empty_cache()
    print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    print(f"| SDPA flash ({label}'s run) | " + " | ".join(flash) + " |", flush=True)


if __name__ == "__main__":
    main()
