"""Quick device check of every attention_mma variant through the ops (no sageattn routing):
relative L1 against the emulation of the same algorithm (reference.sage_attention_reference with
the kernel's geometry) and against float64 attention, on a few shapes, then the ANCHORS.md
families. Prints a table; exit code 1 when a variant is further than 1e-3 from its emulation.

    python3 scripts/smoke_mma_variants.py
"""
from __future__ import annotations

import math
import sys

import torch

from sageattention2 import ops
from sageattention2 import reference as ref

LOG2E = math.log2(math.e)


def run(q, k, v, causal: bool, qk: str, fp8_v: bool, smooth_v: bool = False):
    sm_scale = q.shape[-1] ** -0.5
    stats = ops.smoothing_stats(q, k, v if fp8_v else None, smooth_v and fp8_v)
    v_mean = stats.v_mean if smooth_v and fp8_v else None
    kv = ops.quantize_kv(k, v if fp8_v else None, stats.k_mean, v_mean, stats.v_scale if fp8_v else None,
                         stats.q_mean, ops.MMA_BLOCK_K, qk, sm_scale * LOG2E)
    pv = (kv.v_fp8, stats.v_scale, v_mean) if fp8_v else (v, None, None)
    out, _ = torch.ops.sageattention2.attention_mma(q, stats.q_mean, kv.k_quant, kv.k_scale, kv.delta_s, *pv,
                                                    stats.k_mean, qk, k.shape[2], sm_scale, causal, False, True)
    return out


def emulate(q, k, v, causal: bool, qk: str, fp8_v: bool, smooth_v: bool = False):
    pv = "e4m3" if fp8_v else ("bf16" if q.dtype == torch.bfloat16 else "fp16")
    return ref.sage_attention_reference(q, k, v, is_causal=causal, qk_dtype=qk, granularity="thread",
                                        block_q=ops.MMA_BLOCK_Q, warps=ops.MMA_WARPS, block_k=ops.MMA_BLOCK_K,
                                        smooth_k=True, smooth_q="head", smooth_v=smooth_v and fp8_v,
                                        pv_dtype=pv, two_level=fp8_v, fp22=False)


def main() -> int:
    torch.manual_seed(0)
    variants = [("int8", False), ("int8", True), ("int4", True)]
    shapes = [(1, 4, 2, 1000, 1000, 128), (2, 2, 2, 300, 700, 64), (1, 4, 1, 77, 1, 128), (1, 2, 2, 4097, 4097, 64)]
    worst = 0.0
    print(f"{'variant':<12}{'shape':<26}{'causal':<8}{'dtype':<6}{'vs emulation':>14}{'vs exact':>10}")
    for qk, fp8_v in variants:
        for b, hq, hkv, nq, nk, d in shapes:
            for causal in (False, True):
                for dtype in (torch.float16, torch.bfloat16):
                    q = (torch.randn(b, hq, nq, d, device="cuda") + torch.randn(b, hq, 1, d, device="cuda")).to(dtype)
                    k = (torch.randn(b, hkv, nk, d, device="cuda") + 4 * torch.randn(b, hkv, 1, d, device="cuda")).to(dtype)
                    v = (torch.randn(b, hkv, nk, d, device="cuda") + torch.randn(b, hkv, 1, d, device="cuda")).to(dtype)
                    smooth_v = fp8_v and nq == 1000
                    out = run(q, k, v, causal, qk, fp8_v, smooth_v)
                    emu = emulate(q, k, v, causal, qk, fp8_v, smooth_v)
                    exact = ref.exact_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
                    l1 = ref.relative_l1(out, emu.to(dtype))
                    worst = max(worst, l1) if math.isfinite(l1) else math.inf
                    print(f"{qk + ('+fp8' if fp8_v else '+fp16'):<12}{str((b, hq, hkv, nq, nk, d)):<26}"
                          f"{causal!s:<8}{str(dtype)[-8:]:<6}{l1:>14.2e}{ref.relative_l1(out, exact):>10.4f}",
                          flush=True)
    print("ANCHORS families (B1 H8 N4096 D128 fp16), CosSim / rel. L1 vs float64:")
    torch.manual_seed(0)
    families = {n: ref.make_input_family(n, (1, 8, 4096, 128), torch.float16, "cuda")
                for n in ("bias0", "bias4", "outliers")}
    for qk, fp8_v in variants:
        for name, (q, k, v) in families.items():
            for causal in (False, True):
                out = run(q, k, v, causal, qk, fp8_v)
                want = ref.exact_attention(q, k, v, is_causal=causal)
                print(f"  {qk + ('+fp8' if fp8_v else '+fp16'):<10}{name:<9}causal={causal!s:<6}"
                      f"{ref.cosine_similarity(out, want):.6f} / {ref.relative_l1(out, want):.5f}", flush=True)
    print(f"worst rel. L1 vs emulation: {worst:.2e}")
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
