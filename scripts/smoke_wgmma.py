"""Device check of the Hopper kernel (attention_wgmma) through sageattn: accuracy against the
bit-level emulation and exact attention over a grid of shapes, then the ANCHORS timing table.

    python3 scripts/smoke_wgmma.py [--no-bench] [--quick]
"""
import argparse
import sys

import torch

from sageattention2 import api, ops, sageattn
from sageattention2 import reference as ref

parser = argparse.ArgumentParser()
parser.add_argument("--no-bench", action="store_true")
parser.add_argument("--quick", action="store_true")
args = parser.parse_args()

print(torch.cuda.get_device_name(), "| kernel plan:", api.kernel_plan())


def emulate(q, k, v, causal, smooth_k=True, smooth_v=False):
    return ref.hopper_kernel_reference(
        q, k, v, block_k=ops.WGMMA_BLOCK_K, mean_stride=api.smoothing_sample_stride(k.shape[2]),
        is_causal=causal, smooth_k=smooth_k, smooth_v=smooth_v, return_lse=True)


worst = 0.0
print(f"{'B Hq Hkv Nq Nk D dtype causal':<42}{'L1 emu':>9}{'L1 exact':>10}{'cos':>10}{'lse err':>9}")
shapes = [(1, 2, 2, 1, 1, 128), (2, 4, 4, 17, 17, 64), (1, 8, 2, 127, 127, 128), (1, 4, 1, 1000, 333, 64),
          (1, 4, 4, 300, 1000, 128), (1, 8, 8, 4097, 4097, 128), (1, 4, 4, 2048, 2048, 64)]
for (b, hq, hkv, nq, nk, d) in shapes:
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(nq * 7 + nk)
            q = torch.randn(b, hq, nq, d, device="cuda", generator=g) + 2 * torch.randn(b, hq, 1, d, device="cuda", generator=g)
            k = torch.randn(b, hkv, nk, d, device="cuda", generator=g) + 4 * torch.randn(b, hkv, 1, d, device="cuda", generator=g)
            v = torch.randn(b, hkv, nk, d, device="cuda", generator=g) + torch.randn(b, hkv, 1, d, device="cuda", generator=g)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            out, lse = sageattn(q, k, v, is_causal=causal, enable_gqa=hq != hkv, return_lse=True, strict=True)
            torch.cuda.synchronize()
            emu, emu_lse = emulate(q, k, v, causal)
            exact, exact_lse = ref.exact_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv, return_lse=True)
            l1_emu = ref.relative_l1(out, emu)
            l1 = ref.relative_l1(out, exact)
            cos = ref.cosine_similarity(out, exact)
            lse_err = (lse.double() - exact_lse).abs().max().item()
            worst = max(worst, l1_emu)
            tag = f"{b} {hq} {hkv} {nq} {nk} {d} {str(dtype)[6:]} {causal}"
            print(f"{tag:<42}{l1_emu:>9.5f}{l1:>10.5f}{cos:>10.6f}{lse_err:>9.4f} finite={torch.isfinite(out).all().item()}")
print("worst rel L1 vs emulation:", worst)
sys.stdout.flush()
if args.no_bench:
    sys.exit(0)

from hopper_timing import CUDNN, FLASH, anchors_inputs, kernel_alone, ms, sdpa_ms, tops  # noqa: E402


def ops_one_by_one(fn):
    """fn with sageattn's Hopper path run as its chain of ops from Python (sageattn_wgmma_chain,
    the path before session 21) instead of the one C++ op: the host cost of the op calls."""
    one_op = ops.sageattn_wgmma
    ops.sageattn_wgmma = ops.sageattn_wgmma_chain
    try:
        return fn()
    finally:
        ops.sageattn_wgmma = one_op


print("| D | N | causal | SDPA flash | SDPA cuDNN | sageattn full | full, ops from Python | kernel only "
      "| full / cuDNN |")
print("|---|---|---|---|---|---|---|---|---|")
for d in (128, 64):
    for n in ((1024, 4096) if args.quick else (1024, 4096, 16384)):
        q, k, v, kv = anchors_inputs(n, d)
        for causal in (False, True):
            fa, cudnn = (tops(sdpa_ms(backend, q, k, v, causal), n, d, causal) for backend in (FLASH, CUDNN))
            full = tops(ms(lambda: sageattn(q, k, v, is_causal=causal)), n, d, causal)
            chain = tops(ops_one_by_one(lambda: ms(lambda: sageattn(q, k, v, is_causal=causal))), n, d, causal)
            kern = tops(ms(kernel_alone(q, kv, causal)), n, d, causal)
            print(f"| {d} | {n} | {causal} | {fa:.0f} | {cudnn:.0f} | {full:.0f} | {chain:.0f} | {kern:.0f} "
                  f"| {full / cudnn:.2f}x |")
            sys.stdout.flush()
        del q, k, v, kv
        torch.cuda.empty_cache()
