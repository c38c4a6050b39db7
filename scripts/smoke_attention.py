"""Quick device check of attention_mma through the ops (no sageattn routing): accuracy against
exact attention over a grid of shapes, then one timing next to SDPA.

    python3 scripts/smoke_attention.py
"""
import math

import torch
import torch.nn.functional as F

from sageattention2 import ops

LOG2E = 1.4426950408889634


def run(q, k, v, causal, smooth_q=True, smooth_k=True):
    d = q.shape[-1]
    mult = d ** -0.5 * LOG2E
    q_mean, k_mean, _, _ = ops.smoothing_stats(q if smooth_q else None, k if smooth_k else None, None, False)
    q_mean = q_mean if smooth_q else None
    k_mean = k_mean if smooth_k else None
    qc, qs, _ = ops.quantize_q(q, q_mean, ops.MMA_BLOCK_Q, ops.MMA_WARPS, "int8", False, mult)
    kc, ks, _, ds = ops.quantize_kv(k, None, k_mean, None, None, q_mean, ops.MMA_BLOCK_K, "int8", mult)
    out, lse = torch.ops.sageattention2.attention_mma(qc, qs, kc, ks, ds if q_mean is not None else None, v,
                                                      q.shape[2], causal, False, True)
    return out, lse, k_mean


def exact(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k2, v2 = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k2.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v2, lse


def metrics(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item(), ((a - b).abs().sum() / b.abs().sum()).item()


worst = 0.0
print(f"{'B Hq Hkv Nq Nk D dtype causal':<40}{'cos':>10}{'relL1':>9}{'lse err':>9}")
for (b, hq, hkv, nq, nk, d) in [(1, 2, 2, 1, 1, 128), (2, 4, 4, 17, 17, 64), (1, 8, 2, 127, 127, 128),
                                (1, 4, 1, 1000, 333, 64), (1, 4, 4, 300, 1000, 128), (1, 8, 8, 4097, 4097, 128)]:
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(nq * 7 + nk)
            q = torch.randn(b, hq, nq, d, device="cuda", generator=g) + 2 * torch.randn(b, hq, 1, d, device="cuda", generator=g)
            k = torch.randn(b, hkv, nk, d, device="cuda", generator=g) + 4 * torch.randn(b, hkv, 1, d, device="cuda", generator=g)
            v = torch.randn(b, hkv, nk, d, device="cuda", generator=g)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            out, lse, k_mean = run(q, k, v, causal)
            ref, ref_lse = exact(q, k, v, causal)
            cos, l1 = metrics(out, ref)
            # The kernel's LSE lacks the row constant sm_scale * q_i . k_mean dropped by K smoothing.
            g_ = hq // hkv
            row_const = (q.float() @ k_mean.repeat_interleave(g_, 1).unsqueeze(-1)).squeeze(-1) / math.sqrt(d)
            lse_err = (lse + row_const - ref_lse).abs().max().item()
            worst = max(worst, l1)
            tag = f"{b} {hq} {hkv} {nq} {nk} {d} {str(dtype)[6:]} {causal}"
            print(f"{tag:<40}{cos:>10.6f}{l1:>9.4f}{lse_err:>9.4f}  finite={torch.isfinite(out).all().item()}")
print("worst rel L1:", worst)

from triton.testing import do_bench
for d, causal in ((128, False), (128, True), (64, False)):
    q, k, v = (torch.randn(4, 32, 4096, d, device="cuda", dtype=torch.float16) for _ in range(3))
    flops = 4 * 4 * 32 * 4096 * 4096 * d / (2 if causal else 1)
    t_full = do_bench(lambda: run(q, k, v, causal), warmup=25, rep=150, return_mode="median")
    mult = d ** -0.5 * LOG2E
    qm, km, _, _ = ops.smoothing_stats(q, k, None, False)
    qc, qs, _ = ops.quantize_q(q, qm, ops.MMA_BLOCK_Q, ops.MMA_WARPS, "int8", False, mult)
    kc, ks, _, ds = ops.quantize_kv(k, None, km, None, None, qm, ops.MMA_BLOCK_K, "int8", mult)
    t_kernel = do_bench(lambda: torch.ops.sageattention2.attention_mma(qc, qs, kc, ks, ds, v, 4096, causal, False, False),
                        warmup=25, rep=150, return_mode="median")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        t_fa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), warmup=25, rep=150, return_mode="median")
    print(f"4K hd{d} causal={causal}: kernel {flops / t_kernel / 1e9:.0f} TOPS, full {flops / t_full / 1e9:.0f} TOPS, "
          f"SDPA flash {flops / t_fa / 1e9:.0f} TOPS")
