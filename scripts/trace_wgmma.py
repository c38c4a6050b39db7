"""Per-item phase timings of the Hopper kernel, from a traced build (scripts/make_traced_kernel.py
writes clock stamps into the LSE buffer; scripts/device_trace_wgmma.sh builds and runs this).
Prints, per shape, the median cycles of each phase of a work item and its share, in units of one
KV-loop tile. Experiment tooling, not a test.

    python3 scripts/trace_wgmma.py 1024,128,0 4096,128,1   (N,D,causal; B=4 H=32 fp16)
"""
import sys

import numpy as np
import torch

from sageattention2 import ops

SLOTS, ITEMS = 16, 4


def run(n, d, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 32, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    st = ops.smoothing_stats(None, k, None, False)
    kv = ops.quantize_kv(k, v, st.k_mean, None, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    for _ in range(5):
        out, lse = ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None, None, n, d ** -0.5,
                                       causal, False, True)
    lse.zero_()
    out, lse = ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, None, None, n, d ** -0.5,
                                   causal, False, True)
    torch.cuda.synchronize()
    raw = lse.view(torch.int32).flatten().cpu().numpy().view(np.uint32).astype(np.int64)
    ctas = raw.size // (2 * ITEMS * SLOTS)
    rec = raw[: ctas * 2 * ITEMS * SLOTS].reshape(ctas, 2, ITEMS, SLOTS)
    valid = (rec[..., 14] >> 16) == 0xA5A5
    r = rec[valid]

    def dt(a, b):
        return (r[:, b] - r[:, a]) % (1 << 32)

    tiles = r[:, 0]
    total = dt(8, 7)
    phases = {"q wait": dt(8, 1), "quantize": dt(1, 13), "stage+bar": dt(13, 2), "k0 wait": dt(2, 3), "tile0": dt(3, 4),
              "loop": dt(4, 5), "last tile+pv": dt(5, 6), "epilogue": dt(6, 7)}
    ns = (r[:, 15] - r[:, 12]) % (1 << 32)
    ghz = total.sum() / ns.sum()
    loop_tiles = np.maximum(tiles - 2, 1)
    per_tile = (phases["loop"] / loop_tiles)[tiles > 2]
    print(f"\n== N={n} D={d} causal={causal}: {valid.sum()} items, {ctas} CTAs traced, clock {ghz:.2f} GHz, "
          f"tiles/item mean {tiles.mean():.1f}")
    print(f"  loop per tile: median {np.median(per_tile):.0f} cycles; waits per tile: full_k "
          f"{np.median((r[:, 9] / loop_tiles)[tiles > 2]):.0f}, full_v {np.median((r[:, 10] / loop_tiles)[tiles > 2]):.0f}")
    tot = total.sum()
    for k_, v_ in phases.items():
        print(f"  {k_:14} median {np.median(v_):8.0f} cycles  mean {v_.mean():8.0f}  share {v_.sum() / tot:6.1%}"
              f"  = {v_.mean() / np.median(per_tile):5.2f} tiles")
    ptile = np.median(per_tile)
    over = total - tiles * ptile
    print(f"  item total mean {total.mean():.0f} cycles = {total.mean() / ptile:.2f} loop tiles for {tiles.mean():.1f} tiles"
          f" -> overhead {over.mean() / ptile:.2f} tiles ({over.sum() / tot:.1%})")
    # How far warpgroup 1 runs behind warpgroup 0 on the same item (same SM clock), at the item's
    # start (slot 8) and at the start of its KV loop (slot 4), in loop tiles.
    both = valid[:, 0, :] & valid[:, 1, :]
    for slot, what in ((8, "item start"), (4, "loop start")):
        lag = ((rec[:, 1, :, slot] - rec[:, 0, :, slot] + (1 << 31)) % (1 << 32) - (1 << 31))[both]
        print(f"  warpgroup 1 behind warpgroup 0 at {what}: p10/p50/p90 "
              f"{np.percentile(lag, [10, 50, 90]) / np.median(per_tile)} tiles")
    g0 = r[:, 12]
    base = g0.min()
    starts = (g0 - base) % (1 << 32)
    ends = (r[:, 15] - base) % (1 << 32)
    print(f"  timeline (us): first item starts {np.percentile(starts, [0, 50, 100]) / 1e3} ; last end {ends.max() / 1e3:.1f}; "
          f"CTA busy-until p0/p50/p100 {np.percentile(ends, [0, 50, 100]) / 1e3}")
    if causal:
        for lo, hi in ((0, 4), (4, 12), (12, 40)):
            sel = (tiles > lo) & (tiles <= hi)
            if sel.any():
                print(f"    tiles {lo + 1}-{hi}: item {total[sel].mean():.0f} cycles, overhead "
                      f"{(total[sel] - tiles[sel] * ptile).mean() / ptile:.2f} tiles")


for spec in sys.argv[1:] or ["1024,128,0", "4096,128,0", "4096,128,1", "1024,128,1", "1024,64,0", "4096,64,0", "4096,64,1"]:
    n, d, c = spec.split(",")
    run(int(n), int(d), c == "1")
