"""Attention forward + backward (training), side by side in one process (issue 51):

    python3 benchmarks/bench_backward.py [--n 4096 16384] [--d 128] [--dtype bfloat16] [--out t.md]
        [--own-kernel | --own-only]

B=4 H=32 HND inputs that require grad; each column times ``attention(q, k, v).backward(dout)``:
SDPA forced to cuDNN and to FlashAttention-2, and sageattn (the quantized forward, then the exact
backward from its O and LSE on PyTorch's cuDNN kernel; this script sets
SAGEATTN_TRAINING=quantized, the opt-in): as training runs it by default (PV in 16 bits, D51), and
with FP8 PV and V smoothed (``pv_quant="fp8", smooth_v=True``: faster, less accurate gradients). TOPS count the
forward's 4·B·H·N²·D and the backward's 2.5 times that (five products against two), halved
under the causal mask; the forward alone is sageattn's without grad; the last column is cuDNN's
forward + backward time over sageattn's. ``--own-kernel`` adds sageattn with our own backward
kernel (SAGEATTN_BACKWARD_KERNEL=wgmma) and a table of the backward alone, ours against cuDNN's
on the same O and LSE, with the CosSim of their gradients.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

import timing
from sageattention2 import _backward, sageattn
from sageattention2.testing import cosine_similarity

BACKWARD_WORK = 2.5  # the backward's products (dV, dP, dS·K, dS^T·Q, and P recomputed) over the forward's


def step(attention: Callable[[], torch.Tensor], dout: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        attention().backward(dout)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--d", type=int, nargs="+", default=[128])
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    parser.add_argument("--rep", type=int, default=200, help="ms of timed repetitions per cell")
    parser.add_argument("--out", default=None)
    parser.add_argument("--own-kernel", action="store_true",
                        help="also our backward kernel (SAGEATTN_BACKWARD_KERNEL=wgmma): a forward + "
                             "backward column, and the backward alone against cuDNN's on the same O "
                             "and LSE")
    parser.add_argument("--own-only", action="store_true",
                        help="only the backward alone, ours against cuDNN's")
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = getattr(torch, args.dtype)
    os.environ[_backward.TRAINING_ENVIRONMENT] = "quantized"  # (the opt-in: sageattn's training path)
    lines = [f"Forward + backward, B{timing.BATCH} H{timing.HEADS} {args.dtype}, TOPS "
             f"({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "| shape | SDPA cuDNN | SDPA flash | sageattn | sageattn, FP8 PV | "
             "sageattn fwd alone | sageattn / cuDNN | FP8 PV / cuDNN |",
             "|---|---|---|---|---|---|---|---|"]
    for d in ([] if args.own_only else args.d):
        for n in args.n:
            q, k, v = (t.requires_grad_() for t in timing.anchors_inputs(n, d, dtype))
            dout = torch.randn_like(q)
            for causal in (False, True):
                def tops(ms: float | None) -> float:
                    return timing.tops(ms, n, d, causal) * (1 + BACKWARD_WORK) if ms else float("nan")

                times = {}
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                                      ("flash", SDPBackend.FLASH_ATTENTION)):
                    with sdpa_kernel(backend):
                        times[name] = timing.median_ms(step(
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                            dout), rep=args.rep)

                def ours(**options: object) -> Callable[[], torch.Tensor]:
                    return lambda: sageattn(q, k, v, is_causal=causal, qk_quant="int8",
                                            strict=True, **options)

                times["ours"] = timing.median_ms(step(ours(), dout), rep=args.rep)
                times["ours_fp8"] = timing.median_ms(
                    step(ours(pv_quant="fp8", smooth_v=True), dout), rep=args.rep)
                with torch.no_grad():
                    forward = timing.median_ms(ours(), rep=args.rep)
                own = ""
                if args.own_kernel:
                    os.environ[_backward._OWN_KERNEL_ENVIRONMENT] = "wgmma"
                    t_own = timing.median_ms(step(ours(), dout), rep=args.rep)
                    del os.environ[_backward._OWN_KERNEL_ENVIRONMENT]
                    own = f" own backward: {tops(t_own):.0f}, {times['cudnn'] / t_own:.3f}x |"
                lines.append(
                    f"| hd{d} N{n // 1024}K{' causal' if causal else ''} | {tops(times['cudnn']):.0f} | "
                    f"{tops(times['flash']):.0f} | {tops(times['ours']):.0f} | "
                    f"{tops(times['ours_fp8']):.0f} | {timing.tops(forward, n, d, causal):.0f} | "
                    f"{times['cudnn'] / times['ours']:.3f}x | "
                    f"{times['cudnn'] / times['ours_fp8']:.3f}x |" + own)
                print(lines[-1], flush=True)
    if args.own_kernel or args.own_only:
        lines += ["", "Backward alone on the same O and LSE (TOPS: 2.5 x the forward's work)", "",
                  "| shape | cuDNN's backward | our kernel | ours / cuDNN | CosSim dQ / dK / dV |",
                  "|---|---|---|---|---|"]
        for d in args.d:
            for n in args.n:
                q, k, v = (t.detach() for t in timing.anchors_inputs(n, d, dtype))
                dout = torch.randn_like(q)
                scale = d ** -0.5
                for causal in (False, True):
                    with torch.no_grad():
                        out, lse = sageattn(q, k, v, is_causal=causal, qk_quant="int8",
                                            pv_quant="none", return_lse=True)
                    cudnn = lambda: _backward._pytorch_kernels(  # noqa: E731
                        "cudnn", dout, q, k, v, out, lse, causal, scale, None)
                    k_mean = k.mean(2, keepdim=True, dtype=torch.float32)
                    own = lambda: _backward._wgmma_kernel(  # noqa: E731
                        dout, q, k, v, out, lse, k_mean, causal, scale)
                    t_cudnn = timing.median_ms(cudnn, rep=args.rep)
                    t_own = timing.median_ms(own, rep=args.rep)
                    cos = [cosine_similarity(a, b) for a, b in zip(own(), cudnn())]

                    def bwd_tops(ms: float) -> float:
                        return timing.tops(ms, n, d, causal) * BACKWARD_WORK

                    lines.append(f"| hd{d} N{n // 1024}K{' causal' if causal else ''} | "
                                 f"{bwd_tops(t_cudnn):.0f} | {bwd_tops(t_own):.0f} | "
                                 f"{t_cudnn / t_own:.3f}x | " + " / ".join(f"{c:.5f}" for c in cos) + " |")
                    print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
