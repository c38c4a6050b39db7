"""Per-tile phase timings of the Hopper kernel's KV loop, both consumer warpgroups, from a build
traced by scripts/make_tile_traced_kernel.py (scripts/device_trace_tiles.sh builds and runs
both). Per shape: the median loop tile, how it splits into the start (K/V waits, GEMM issue), the
wait for the GEMMs and the softmax (fold, exponentials, packing), how far warpgroup 1 runs behind warpgroup 0, and how much
of one warpgroup's softmax overlaps the other's. Experiment tooling, not a test.

    python3 scripts/trace_wgmma_tiles.py 4096,128,0 4096,64,0   (N,D,causal; B=4 H=32 fp16)
"""
import sys

import numpy as np
import torch

from sageattention2 import ops

CTAS, TILES = 32, 64


def intervals_overlap(a0, a1, b0, b1):
    """Cycles of [a0, a1) covered by the union of the intervals [b0[j], b1[j])."""
    total = 0
    for s, e in zip(b0, b1):
        total += max(0, min(a1, e) - max(a0, s))
    return total


def run(n: int, d: int, causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    st = ops.smoothing_stats(None, k, None, False)
    kv = ops.quantize_kv(k, v, st.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    call = lambda: ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None, None, n,
                                       d ** -0.5, causal, False, True)
    for _ in range(5):
        call()
    out, lse = call()
    lse.zero_()
    out, lse = call()
    torch.cuda.synchronize()
    raw = lse.view(torch.int32).flatten()[: CTAS * 2 * TILES * 4].cpu().numpy().view(np.uint32).astype(np.int64)
    rec = raw.reshape(CTAS, 2, TILES, 4)
    periods, start, gemm, soft, over, lag, loopover = [], [], [], [], [], [], []
    for c in range(CTAS):
        # tiles 1 .. last-1 of the first item are stamped (the loop); 0 where none
        valid = (rec[c, 0, :, 3] != 0) & (rec[c, 1, :, 3] != 0)
        idx = np.nonzero(valid)[0]
        if idx.size < 6:
            continue
        base = rec[c, 0, idx[0], 0]
        t = (rec[c][:, idx, :] - base + (1 << 31)) % (1 << 32) - (1 << 31)  # [wg, tile, stamp]
        idx_inner = np.arange(2, idx.size - 2)
        for g in range(2):
            per = np.diff(t[g, :, 0])
            periods += list(per[idx_inner])
            start += list((t[g, :, 1] - t[g, :, 0])[idx_inner])
            gemm += list((t[g, :, 2] - t[g, :, 1])[idx_inner])
            soft += list((t[g, :, 3] - t[g, :, 2])[idx_inner])
            loopover += list((t[g, 1:, 0] - t[g, :-1, 3])[idx_inner - 1])
            o = 1 - g
            for j in idx_inner:
                a0, a1 = t[g, j, 2], t[g, j, 3]
                over.append(intervals_overlap(a0, a1, t[o, :, 2], t[o, :, 3]) / max(1, a1 - a0))
        per0 = np.median(np.diff(t[0, :, 0]))
        lag += list(((t[1, :, 1] - t[0, :, 1]) / per0)[idx_inner])
        if c == 0 and idx.size >= 8:
            print(f"  CTA 0, tiles {idx[2]}-{idx[7]} (cycles from warpgroup 0's first stamp; K wait, issued, S ready, P packed):")
            for j in range(2, 8):
                print(f"    tile {idx[j]:3d}: wg0 {t[0, j].tolist()}  wg1 {t[1, j].tolist()}")
    med = lambda a: float(np.median(a))
    print(f"== N={n} D={d} causal={causal}: loop tile (one warpgroup's period) median {med(periods):.0f} cycles")
    print(f"  start -> GEMMs issued (K/V waits, slot, issue) {med(start):.0f}, issued -> S ready (GEMM wait) {med(gemm):.0f}, S ready -> P packed (fold + softmax) {med(soft):.0f}, "
          f"P packed -> next tile {med(loopover):.0f}")
    print(f"  warpgroup 1 behind warpgroup 0 at GEMM issue, in periods: p10/p50/p90 {np.percentile(lag, [10, 50, 90])}")
    print(f"  share of a warpgroup's softmax overlapped by the other's: p10/p50/p90 {np.percentile(over, [10, 50, 90])}")


for spec in sys.argv[1:] or ["4096,128,0", "4096,64,0"]:
    n, d, c = (int(x) for x in spec.split(","))
    run(n, d, bool(c))
