"""The full sageattn call on Hopper against the number of SMs that prepare K and V beside the
kernel (SAGEATTN_PREPARE_SMS; 0 = quantize_kv as a separate launch before it), side by side with
the kernel alone and SDPA, ANCHORS protocol (B4 H32 fp16, do_bench medians). TOPS.

    python3 scripts/prepare_sweep.py [--sms 0 8 16 24] [--n 1024 4096] [--head-dim 128 64]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from sageattention2 import ops, sageattn

parser = argparse.ArgumentParser()
parser.add_argument("--sms", nargs="+", default=["0", "default", "8", "16", "24"])
parser.add_argument("--n", nargs="+", type=int, default=[1024, 4096])
parser.add_argument("--head-dim", nargs="+", type=int, default=[128, 64])
args = parser.parse_args()


def ms(fn):
    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def full_call(q, k, v, causal, sms):
    if sms == "default":
        os.environ.pop("SAGEATTN_PREPARE_SMS", None)
    else:
        os.environ["SAGEATTN_PREPARE_SMS"] = sms
    try:
        return ms(lambda: sageattn(q, k, v, is_causal=causal))
    finally:
        os.environ.pop("SAGEATTN_PREPARE_SMS", None)


print(torch.cuda.get_device_name())
cols = " | ".join(f"full, {s} SMs" for s in args.sms)
print(f"| D | N | causal | flash | cuDNN | kernel | {cols} |")
print("|---|---|---|---|---|---|" + "---|" * len(args.sms))
for d in args.head_dim:
    for n in args.n:
        q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
        stats = ops.smoothing_stats(None, k, None, False)
        kv = ops.quantize_kv(k, v, stats.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
        for causal in (False, True):
            count = 4 * 4 * 32 * n * n * d / (2 if causal else 1)
            tops = lambda t: count / t / 1e9  # noqa: E731
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                fa = tops(ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = tops(ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
            kern = tops(ms(lambda: ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None,
                                                       None, n, d ** -0.5, causal, False, False)))
            fulls = " | ".join(f"{tops(full_call(q, k, v, causal, s)):.0f}" for s in args.sms)
            print(f"| {d} | {n} | {causal} | {fa:.0f} | {cudnn:.0f} | {kern:.0f} | {fulls} |")
            sys.stdout.flush()
        del q, k, v, kv
        torch.cuda.empty_cache()
