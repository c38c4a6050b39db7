"""The full sageattn call on Hopper under launch settings given as environment variables, side by
side with the kernel alone and SDPA, ANCHORS protocol (B4 H32 fp16, do_bench medians), in one
process. TOPS. A variant is "default" or NAME=VALUE[,NAME=VALUE...]; --sms n adds
SAGEATTN_PREPARE_SMS=n (K and V prepared on n SMs beside the kernel; 0 = quantize_kv as a
separate launch before it), SAGEATTN_PDL=0 launches each step only after the one before ends.

    python3 scripts/prepare_sweep.py [--variants default SAGEATTN_PDL=0] [--sms 0 8 16]
                                     [--n 1024 4096] [--head-dim 128 64] [--rep 150]
"""
import argparse
import os
import sys

import torch

from hopper_timing import CUDNN, FLASH, anchors_inputs, kernel_alone, ms, sdpa_ms, tops
from sageattention2 import sageattn

parser = argparse.ArgumentParser()
parser.add_argument("--variants", nargs="*", default=["default"])
parser.add_argument("--sms", nargs="*", default=[])
parser.add_argument("--n", nargs="+", type=int, default=[1024, 4096])
parser.add_argument("--head-dim", nargs="+", type=int, default=[128, 64])
# do_bench's time budget per measurement, ms: one 16K hd128 call takes ~19 ms, so 150 ms gives
# ~8 samples and +-7 % (benchmarks/RESULTS.md, session 23); use ~1000 there.
parser.add_argument("--rep", type=int, default=150)
args = parser.parse_args()
variants = args.variants + [f"SAGEATTN_PREPARE_SMS={n}" for n in args.sms]


def full_call(q, k, v, causal, variant):
    env = {} if variant == "default" else dict(kv.split("=", 1) for kv in variant.split(","))
    os.environ.update(env)
    try:
        return ms(lambda: sageattn(q, k, v, is_causal=causal), args.rep)
    finally:
        for name in env:
            os.environ.pop(name)


print(torch.cuda.get_device_name())
cols = " | ".join(f"full, {s}" for s in variants)
print(f"| D | N | causal | flash | cuDNN | kernel | {cols} |")
print("|---|---|---|---|---|---|" + "---|" * len(variants))
for d in args.head_dim:
    for n in args.n:
        q, k, v, kv = anchors_inputs(n, d)
        for causal in (False, True):
            fa, cudnn = (tops(sdpa_ms(backend, q, k, v, causal, args.rep), n, d, causal) for backend in (FLASH, CUDNN))
            kern = tops(ms(kernel_alone(q, kv, causal), args.rep), n, d, causal)
            fulls = " | ".join(f"{tops(full_call(q, k, v, causal, s), n, d, causal):.0f}" for s in variants)
            print(f"| {d} | {n} | {causal} | {fa:.0f} | {cudnn:.0f} | {kern:.0f} | {fulls} |")
            sys.stdout.flush()
        del q, k, v, kv
        torch.cuda.empty_cache()
