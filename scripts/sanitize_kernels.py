"""Runs every preprocessing and attention kernel variant once on small shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python3 scripts/sanitize_preprocess.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_preprocess.py
"""
import torch

from sageattention2 import ops

for dtype in (torch.float16, torch.bfloat16):
    for n, d in ((130, 128), (33, 64), (70, 256)):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
        k = torch.randn(1, 2, n, d, device="cuda", dtype=dtype)
        v = torch.randn(1, 2, n, d, device="cuda", dtype=dtype)
        q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, True)
        for qk in ("int8", "int4"):
            ops.quantize_q(q, q_mean, 128, 4, qk, False, 0.1)
            ops.quantize_q(q, None, 64, 4, qk, True, 0.1)
            for block_k in (64, 128):
                ops.quantize_kv(k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk, 0.1)
torch.cuda.synchronize()
print("sanitize_preprocess: all variants ran")

# The warp-level attention kernel on the same small shapes (tails, GQA, both causal modes), every
# variant: INT8 + FP16/BF16 PV, and (sm_89+) INT8 + FP8 PV and INT4 + FP8 PV with smooth V.
if hasattr(torch.ops.sageattention2, "attention_mma"):
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    variants = [("int8", False)] + ([("int8", True), ("int4", True)] if fp8 else [])
    for dtype in (torch.float16, torch.bfloat16):
        for n, d in ((130, 128), (33, 64)):
            q = torch.randn(1, 4, n, d, device="cuda", dtype=dtype)
            k = torch.randn(1, 2, n + 7, d, device="cuda", dtype=dtype)
            v = torch.randn(1, 2, n + 7, d, device="cuda", dtype=dtype)
            stats = ops.smoothing_stats(q, k, v, True)
            for qk, fp8_v in variants:
                kv = ops.quantize_kv(k, v if fp8_v else None, stats.k_mean, stats.v_mean if fp8_v else None,
                                     stats.v_scale if fp8_v else None, stats.q_mean, ops.MMA_BLOCK_K, qk, 0.1)
                pv = (kv.v_fp8, stats.v_scale, stats.v_mean) if fp8_v else (v, None, None)
                for causal in (False, True):
                    for smooth_q in (False, True):  # Q smoothing is a kernel variant
                        q_mean, delta_s = (stats.q_mean, kv.delta_s) if smooth_q else (None, None)
                        torch.ops.sageattention2.attention_mma(q, q_mean, kv.k_quant, kv.k_scale, delta_s, *pv,
                                                               stats.k_mean, qk, n + 7, 0.1 / 1.4426950408889634,
                                                               causal, causal, True)
    torch.cuda.synchronize()
    print(f"sanitize: attention_mma variants ran: {variants}")

# The Hopper kernel (sm_90 only): both head dims, causal on/off, GQA, a tail tile, NHD output.
if hasattr(torch.ops.sageattention2, "attention_wgmma") and torch.cuda.get_device_capability() == (9, 0):
    for dtype in (torch.float16, torch.bfloat16):
        for n, d in ((130, 128), (33, 64)):
            q = torch.randn(1, 4, n, d, device="cuda", dtype=dtype)
            k = torch.randn(1, 2, n + 7, d, device="cuda", dtype=dtype)
            v = torch.randn(1, 2, n + 7, d, device="cuda", dtype=dtype)
            stats = ops.smoothing_stats(None, k, v, True)
            kv = ops.quantize_kv(k, v, stats.k_mean, stats.v_mean, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
            for causal in (False, True):
                ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, stats.v_mean, stats.k_mean,
                                    n + 7, d ** -0.5, causal, causal, True)
    torch.cuda.synchronize()
    print("sanitize: attention_wgmma variants ran")

# sageattn's Hopper path end to end: its smoothing means over a strided token sample (stride 5 at
# 1100 keys: api.smoothing_sample_stride), smooth V, the LSE.
if hasattr(torch.ops.sageattention2, "attention_wgmma") and torch.cuda.get_device_capability() == (9, 0):
    from sageattention2 import api, sageattn

    q, k, v = (torch.randn(1, 2, 1100, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    assert api.smoothing_sample_stride(1100) == 5
    sageattn(q, k, v, smooth_v=True, return_lse=True, strict=True)
    torch.cuda.synchronize()
    print("sanitize: sageattn's Hopper path with sampled means ran")

# K and V prepared beside the Hopper kernel (sageattn_wgmma's default), with the SM split at its
# extremes: one SM preparing, and all but one preparing; both head dims, causal with fewer
# queries than keys (only the key blocks the kernel reads are prepared).
if hasattr(torch.ops.sageattention2, "sageattn_wgmma") and torch.cuda.get_device_capability() == (9, 0):
    import os

    for prepare_sms in ("1", "131", ""):
        os.environ["SAGEATTN_PREPARE_SMS"] = prepare_sms
        if not prepare_sms:
            del os.environ["SAGEATTN_PREPARE_SMS"]
        for n, d in ((300, 128), (33, 64)):
            q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, 2, 3 * n + 7, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for causal in (False, True):
                ops.sageattn_wgmma(q, k, v, True, causal, 3, d ** -0.5, causal, causal, True)
    torch.cuda.synchronize()
    print("sanitize: sageattn_wgmma with K and V prepared beside the kernel ran")

# sageattn's warp-level path as one op (sageattn_mma: each launch a programmatic dependent of the
# one before), every variant, with and without a statistics launch before quantize_kv.
if hasattr(torch.ops.sageattention2, "sageattn_mma"):
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    variants = [("int8", "input")] + ([("int8", "fp8"), ("int4", "fp8")] if fp8 else [])
    for n, d in ((130, 128), (33, 64)):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, 3 * n + 7, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for qk, pv in variants:
            for smooth_q, smooth_k in ((True, True), (False, False)):
                for causal in (False, True):
                    ops.sageattn_mma(q, k, v, qk, pv, smooth_q, smooth_k, pv == "fp8", 3, d ** -0.5, causal,
                                     causal, True)
    torch.cuda.synchronize()
    print(f"sanitize: sageattn_mma variants ran: {variants}")
