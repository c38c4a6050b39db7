"""Runs every preprocessing and attention kernel variant once on small shapes (tails, GQA, both
causal modes), for compute-sanitizer (scripts/device_check.sh --sanitize runs all three tools):

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 scripts/sanitize_kernels.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_kernels.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python3 scripts/sanitize_kernels.py

Each part prints a line when its launches ran; a part whose op this build or GPU lacks is said
to be skipped.
"""
from __future__ import annotations

import argparse

import torch

from sageattention2 import api, ops, sageattn


def preprocess() -> None:
    """smoothing_stats (Q, K, V, smooth V) and quantize_kv: both QK formats and block sizes with
    per-channel V scales (the warp-level paths), and per-tile V scales (the Hopper path)."""
    for dtype in (torch.float16, torch.bfloat16):
        for n, d in ((130, 128), (33, 64), (70, 256)):
            # Q as a strided view (NHD memory read as HND): the kernels take any view whose last
            # dimension is contiguous.
            q = torch.randn(1, 4, n, d, device="cuda", dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
            k = torch.randn(1, 2, n, d, device="cuda", dtype=dtype)
            v = torch.randn(1, 2, n, d, device="cuda", dtype=dtype)
            q_mean, k_mean, v_mean, v_scale = ops.smoothing_stats(q, k, v, True)
            for qk in ("int8", "int4"):
                for block_k in (64, 128):
                    ops.quantize_kv(k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk, 0.1)
            if d in ops.WGMMA_HEAD_DIMS:  # the Hopper path's: V with one scale per tile (no v_scale)
                ops.quantize_kv(k, v, k_mean, v_mean, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
    torch.cuda.synchronize()
    print("sanitize: preprocessing variants ran")


def attention_mma(fp8: bool) -> None:
    """Every attention_mma variant: INT8 + FP16/BF16 PV, and (sm_89+) INT8 + FP8 PV and INT4 + FP8
    PV with smooth V; Q smoothing on and off (a kernel variant)."""
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
                    for smooth_q in (False, True):
                        q_mean, delta_s = (stats.q_mean, kv.delta_s) if smooth_q else (None, None)
                        ops.attention_mma(q, q_mean, kv.k_quant, kv.k_scale, delta_s, *pv, stats.k_mean, qk, n + 7,
                                          0.1 / 1.4426950408889634, causal, causal, True)
    torch.cuda.synchronize()
    print(f"sanitize: attention_mma variants ran: {variants}")


def attention_wgmma() -> None:
    """The Hopper kernel: every head dim, causal on/off, GQA, a tail tile, NHD output, smooth V;
    both PV tiers (the accurate one reads the caller's V, here an NHD view, through a 4-D
    tensor map; head_dim 256 has the FP8 tier only)."""
    for dtype in (torch.float16, torch.bfloat16):
        for n, d in ((130, 128), (33, 64), (260, 256)):
            q = torch.randn(1, 4, n, d, device="cuda", dtype=dtype)
            k = torch.randn(1, 2, n + 7, d, device="cuda", dtype=dtype)
            v = torch.randn(1, 2, n + 7, d, device="cuda", dtype=dtype)
            stats = ops.smoothing_stats(None, k, v, True)
            kv = ops.quantize_kv(k, v, stats.k_mean, stats.v_mean, None, None, ops.WGMMA_BLOCK_K, "int8", 1.0)
            for causal in (False, True):
                ops.attention_wgmma(q, kv.k_quant, kv.k_scale, kv.v_fp8, kv.v_tile_scale, stats.v_mean, stats.k_mean,
                                    n + 7, d ** -0.5, causal, causal, True)
                if d not in ops.WGMMA_INPUT_PV_HEAD_DIMS:
                    continue
                v_nhd = v.transpose(1, 2).contiguous().transpose(1, 2)
                ops.attention_wgmma(q, kv.k_quant, kv.k_scale, v_nhd, None, None, stats.k_mean, n + 7, d ** -0.5,
                                    causal, causal, True)
    torch.cuda.synchronize()
    print("sanitize: attention_wgmma variants ran")


def sageattn_wgmma() -> None:
    """sageattn's Hopper path as one op: fewer queries than keys (causal: only the key blocks
    the kernel reads matter), both head dims; key ranges (key_ranges()); and end to end through
    sageattn, its smoothing means over a strided token sample (stride 5 at 1100 keys), smooth V,
    the LSE. Head_dim 64 with 3 KV tiles: the loop's unmasked step, where the accurate tier
    waits for PV(it - 1) after its softmax (docs/DECISIONS.md#d45)."""
    for n, d in ((300, 128), (120, 64), (129, 256)):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, 3 * n + 7, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for causal in (False, True):
            for pv in ("fp8", "input") if d in ops.WGMMA_INPUT_PV_HEAD_DIMS else ("fp8",):
                ops.sageattn_wgmma(q, k, v, pv, True, causal, 3, d ** -0.5, causal, causal, True)
    key_ranges()
    q, k, v = (torch.randn(1, 2, 1100, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    assert api.smoothing_sample_stride(1100) == 5
    sageattn(q, k, v, smooth_v=True, return_lse=True, qk_quant="int8", strict=True)  # the kernel
    torch.cuda.synchronize()
    print("sanitize: sageattn_wgmma and sageattn's Hopper path ran")


def key_ranges() -> None:
    """A key-padding mask in one launch (docs/DESIGN.md#key-ranges): items of one key, of a range
    ending at the last key and starting past the first, both PV tiers; the ranges given, and
    read from a bool mask per query and an additive one-row mask, one item's mask broken (the
    poison launch writes its rows)."""
    ranges = [(0, 200), (37, 263), (130, 131), (5, 6)]
    b, n_k = len(ranges), 263
    for d in (64, 128, 256):
        q = torch.randn(b, 4, 70, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(b, 2, n_k, d, device="cuda", dtype=torch.float16) for _ in range(2))
        given = torch.tensor([(s, e, api.smoothing_sample_stride(e - s)) for s, e in ranges], dtype=torch.int32,
                             device="cuda")
        keep = torch.zeros(b, 1, 1, n_k, dtype=torch.bool, device="cuda")
        for i, (s, e) in enumerate(ranges):
            keep[i, ..., s:e] = True
        per_query = keep.expand(b, 1, 70, n_k).contiguous()
        per_query[3, 0, 9, 100] = True  # item 3's rows differ: NaN rows
        additive = torch.zeros(keep.shape, device="cuda", dtype=torch.float16).masked_fill(~keep, -torch.inf)
        for pv in ("fp8", "input") if d in ops.WGMMA_INPUT_PV_HEAD_DIMS else ("fp8",):
            args = (q, k, v, pv, True, True, 1, d ** -0.5, False, False, True)
            ops.sageattn_wgmma(*args, key_ranges=given)
            for mask in (per_query, additive):
                ops.sageattn_wgmma(*args, key_mask=mask, sample_tokens=256)
    torch.cuda.synchronize()
    print("sanitize: key ranges (given and read from masks) ran")


def packed_sequences() -> None:
    """sageattn_wgmma_varlen: packed sequences of 1 to 300 tokens (a keyless and a queryless one),
    queries and keys of different lengths, GQA, d 64/128/256, with and without smoothing, causal or
    not; FP8 PV and (d 64/128) the accurate tier through V's zero-padded copy. Then
    sageattn_mma_varlen on the same sequences, d 64/128, 16-bit and FP8 PV."""
    from sageattention2 import _execute

    lengths_q, lengths_k = [1, 300, 0, 129, 2, 77], [3, 257, 5, 128, 1, 0]
    bq = [0]
    bk = [0]
    for nq, nk in zip(lengths_q, lengths_k):
        bq.append(bq[-1] + nq)
        bk.append(bk[-1] + nk)
    spans = [s for s in zip(bq, bq[1:], bk, bk[1:]) if s[1] > s[0] and s[3] > s[2]]
    items, blocks, code_rows = ops.packed_items(spans, _execute.smoothing_sample_stride)
    for dtype, d, smooth in ((torch.float16, 64, True), (torch.bfloat16, 128, False), (torch.float16, 256, True)):
        q = torch.randn(bq[-1], 4, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(bk[-1], 2, d, device="cuda", dtype=dtype) for _ in range(2))
        v_rows = ops.packed_v_rows(items, bk[-1], code_rows).cuda()
        for causal in (False, True):
            for rows in (None, v_rows) if d in ops.WGMMA_INPUT_PV_HEAD_DIMS else (None,):
                ops.sageattn_wgmma_varlen(q, k, v, items.cuda(), blocks.cuda(), 257, code_rows, smooth, smooth,
                                          d ** -0.5, causal, True, rows)
    # The warp-level kernel's one launch (sageattn_mma_varlen; its FP8 PV takes every key's
    # statistics: sample stride 1).
    every_key = ops.packed_items(spans, lambda _: 1)
    for dtype, d, smooth in ((torch.float16, 64, True), (torch.bfloat16, 128, False)):
        q = torch.randn(bq[-1], 4, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(bk[-1], 2, d, device="cuda", dtype=dtype) for _ in range(2))
        for pv, (its, blks, rows_) in (("input", (items, blocks, code_rows)), ("fp8", every_key)):
            for causal in (False, True):
                ops.sageattn_mma_varlen(q, k, v, its.cuda(), blks.cuda(), 257, rows_, pv, smooth, smooth,
                                        d ** -0.5, causal, True)
    torch.cuda.synchronize()
    print("sanitize: packed sequences (sageattn_wgmma_varlen, sageattn_mma_varlen) ran")


def sageattn_mma(fp8: bool) -> None:
    """sageattn's warp-level path as one op (each launch a programmatic dependent of the one
    before), every variant, with and without a statistics launch before quantize_kv."""
    variants = [("int8", "input")] + ([("int8", "fp8"), ("int4", "fp8")] if fp8 else [])
    for n, d in ((130, 128), (33, 64)):
        q = torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, 3 * n + 7, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for qk, pv in variants:
            for smooth_q, smooth_k in ((True, True), (False, False)):
                for causal in (False, True):
                    ops.sageattn_mma(q, k, v, qk, pv, smooth_q, smooth_k, pv == "fp8", 3, d ** -0.5, causal,
                                     causal, True)
        if fp8:  # the INT4 guard: K head 1 wide in 4 channels runs INT8, head 0 INT4 (two launches each)
            k[:, 1, :, :4] *= 8
            for causal in (False, True):
                ops.sageattn_mma(q, k, v, "int4", "fp8", True, True, True, 3, d ** -0.5, causal, causal, True, 2.0)
    torch.cuda.synchronize()
    print(f"sanitize: sageattn_mma variants ran: {variants}" + (", and INT4 guarded" if fp8 else ""))


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    capability = torch.cuda.get_device_capability()
    fp8 = ops.family_runs_on(ops.MMA_FP8_FAMILY, capability)
    hopper = ops.family_runs_on(ops.WGMMA_FAMILY, capability)
    preprocess()
    parts = [("attention_mma", lambda: attention_mma(fp8), True),
             ("attention_wgmma", attention_wgmma, hopper),
             ("sageattn_wgmma", sageattn_wgmma, hopper),
             ("sageattn_wgmma_varlen", packed_sequences, hopper),
             ("sageattn_mma", lambda: sageattn_mma(fp8), True)]
    for op, run, runs_here in parts:
        if ops.has_op(op) and runs_here:
            run()
        else:
            print(f"sanitize: {op} skipped (not in this build, or no code for sm_{capability[0]}{capability[1]})")


if __name__ == "__main__":
    main()
