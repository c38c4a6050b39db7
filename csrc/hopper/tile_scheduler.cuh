// The Hopper kernel's tile scheduler: which work items (blocks of 128 queries of one head) a CTA
// runs, in what order. The producer and both consumer warpgroups walk the same sequence, each on
// its own (hopper/kernel.cuh).
#pragma once

#include <cstdint>

#include "common/key_ranges.cuh"
#include "hopper/params.h"

namespace sageattention2 {

// The keys batch item b attends: kv_len, or its key range's length (AttentionWgmmaParams::key_ranges).
__device__ __forceinline__ int64_t item_kv_len(const AttentionWgmmaParams& p, int b) {
  return p.key_ranges == nullptr ? p.kv_len : key_range_end(p.key_ranges, b) - key_range_first(p.key_ranges, b);
}

// Its first key in the caller's K and V (0 without key ranges).
__device__ __forceinline__ int item_first_key(const AttentionWgmmaParams& p, int b) {
  return p.key_ranges == nullptr ? 0 : key_range_first(p.key_ranges, b);
}

struct WgmmaWorkItem {  // one work item: a block of 128 queries of one head
  int qb, h, b, hk;
  int64_t q0;  // the block's first query: its row in q, out and lse (packed items: from the item's first)
  int kv_tiles;
};

// What differs for packed items (hopper/params.h), in the kernel variant that runs them
// (kPacked: the instantiation launched with packed_items; every other variant reads none of
// them and keeps its code).
// The row after item w's last query: q_len, or its end query, read where it is needed (its Q
// rows, its output) rather than kept in registers across the KV loop.
template <bool kPacked>
__device__ __forceinline__ int64_t item_query_end(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
  if constexpr (kPacked) return packed_q_end(p.packed_items, w.b);
  return p.q_len;
}
// Where item w's K codes (and FP8 V) are: its [B][Hkv] slab from row 0, or with packed items
// row packed_code_row of its KV head's one slab.
template <bool kPacked>
__device__ __forceinline__ int item_code_slab(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
  return kPacked ? w.hk : w.b * p.kv_heads + w.hk;
}
template <bool kPacked>
__device__ __forceinline__ int item_code_row(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
  if constexpr (kPacked) return packed_code_row(p.packed_items, w.b);
  return 0;
}
// The index of the item's first 128-key tile among the per-tile scales (K's four group scales per
// tile, V's tile scale).
template <bool kPacked>
__device__ __forceinline__ int64_t item_first_tile(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
  constexpr int kBlockK = kWgmmaBlockK;
  if constexpr (!kPacked) return (static_cast<int64_t>(w.b) * p.kv_heads + w.hk) * (p.k_padded / kBlockK);
  return static_cast<int64_t>(w.hk) * (p.k_padded / kBlockK) + item_code_row<true>(p, w) / kBlockK;
}

// Whether a kernel variant reads each item's key count through item_kv_len (key ranges come
// only without is_causal: a causal kernel reads kv_len). The causal head_dim 256 kernel takes
// item_kv_len's form too, whose value is kv_len there: with it ptxas keeps that kernel's KV loop
// free of spills (8 local accesses per tile fewer), kernel +12-16 % (A/B/A on the H100,
// docs/DECISIONS.md#d43); the causal head_dim 64 kernel in that form ran 2-6 % slower.
template <int kHeadDim, bool kCausal>
inline constexpr bool kItemKeys = !kCausal || kHeadDim == 256;

// Every kernel variant has an instantiation for packed items (hopper/params.h), causal (each
// item top-left aligned) or not; they read each item's key count (item_kv_len). Their schedule
// walks a table of the items' Q blocks (packed_blocks) rather than skipping the blocks past each
// item's queries: with the skip, a data-dependent loop in the consumers' seek, ptxas scheduled
// the head_dim 128 KV loop's exponentials as one run of 40 MUFUs (hopper/mainloop.cuh: the slow
// schedule), with the table as before (2); at head_dim 256 the KV loop keeps 6 local accesses
// per tile (5 unpacked), causal 1 (0). The accurate tier's packed V is a zero-padded copy in
// code rows, as the FP8 codes are: an item's last tile never reaches the next item's keys.

// kByMultiply: the unit's head and the query head's KV head by multiply and shift (FastDivisor,
// set up by the launch) instead of 64-bit and 32-bit divisions, ~500 fewer instructions per
// kernel: at 512-1K tokens, where a CTA walks many short items, the divisions were ~7 % of the
// kernel's warp samples (ncu), and without them the call runs 3-4 % faster (A/B/A, H100,
// docs/DECISIONS.md#d46). Not at head_dim 256: there ptxas then serialized a causal kernel's
// wgmma for lack of registers, in each of the three forms compiled.
template <bool kCausal, bool kItemKeyCount = !kCausal, bool kPacked = false, bool kByMultiply = true>
struct WgmmaTileScheduler {
  static constexpr int kBlockQ = kWgmmaBlockQ, kBlockK = kWgmmaBlockK;
  // Work units: Q blocks q_blocks - 1 - k and k of one (batch, head), the longer first. Under
  // causal masking a pair holds q_blocks + 1 key tiles whatever k is, so a static round-robin
  // of units over the persistent CTAs is balanced (no global tile counter to reset per call);
  // consecutive units belong to the same head (its K/V stay in L2), GQA heads sharing a KV head
  // are adjacent. A persistent non-causal grid takes units of one block (unit_items 1, set by
  // the launch): its items all cost the same, and pairs would leave the busiest CTA up to two
  // items above the average rather than one (4608 queries x 24 heads: 864 items on 132 SMs ran
  // 8 items on 36 CTAs, 6.5 on average; hopper/launch.cuh).
  struct Schedule {
    int q_blocks, units_per_head, unit_items;
    int64_t units;
  };

  __host__ __device__ static Schedule schedule(int64_t q_len, int batch, int q_heads, int unit_items) {
    Schedule sc;
    sc.q_blocks = static_cast<int>((q_len + kBlockQ - 1) / kBlockQ);
    sc.unit_items = kCausal ? 2 : unit_items;
    sc.units_per_head = sc.unit_items == 2 ? (sc.q_blocks + 1) / 2 : sc.q_blocks;
    sc.units = static_cast<int64_t>(batch) * q_heads * sc.units_per_head;
    return sc;
  }

  // The item `half` (0 or 1) of `unit`; false where a pair's second item is its odd middle block
  // alone, or the unit is one block.
  __device__ static bool item(const AttentionWgmmaParams& p, const Schedule& sc, int64_t unit, int half,
                              WgmmaWorkItem& w) {
    int k;
    int64_t head;
    if constexpr (kByMultiply) {  // (unit < 2^31: the launch's check)
      head = p.units_per_head.quotient(static_cast<uint32_t>(unit));
      k = static_cast<int>(unit - head * sc.units_per_head);
    } else {
      k = static_cast<int>(unit % sc.units_per_head);
      head = unit / sc.units_per_head;
    }
    if (half == 1 && (sc.unit_items == 1 || sc.q_blocks - 1 - k == k)) return false;
    w.qb = half == 0 && sc.unit_items == 2 ? sc.q_blocks - 1 - k : k;
    if constexpr (kByMultiply) {
      const uint32_t b = p.q_heads_divisor.quotient(static_cast<uint32_t>(head));
      w.h = static_cast<int>(static_cast<uint32_t>(head) - b * static_cast<uint32_t>(p.q_heads));
      w.b = static_cast<int>(b);
      w.hk = static_cast<int>(p.group_divisor.quotient(static_cast<uint32_t>(w.h)));
    } else {
      w.h = static_cast<int>(head % p.q_heads);
      w.b = static_cast<int>(head / p.q_heads);
      w.hk = w.h / (p.q_heads / p.kv_heads);
    }
    w.q0 = static_cast<int64_t>(w.qb) * kBlockQ;
    // The block's first query and the queries of its item, counted from the item's first (the
    // causal diagonal's coordinates).
    [[maybe_unused]] int64_t item_q0 = 0, item_queries = 0;
    if constexpr (kPacked) {  // block qb of the schedule is the packed_blocks entry's block of its item
      w.b = __ldg(p.packed_blocks + 2 * w.qb);
      w.qb = __ldg(p.packed_blocks + 2 * w.qb + 1);
      const int first = packed_q_first(p.packed_items, w.b);
      item_q0 = static_cast<int64_t>(w.qb) * kBlockQ;
      w.q0 = item_q0 + first;
      if constexpr (kCausal) item_queries = packed_q_end(p.packed_items, w.b) - first;
    }
    int64_t tiles = ((kItemKeyCount ? item_kv_len(p, w.b) : p.kv_len) + kBlockK - 1) / kBlockK;
    if constexpr (kCausal && kPacked) {
      const int64_t last_query = (item_q0 + kBlockQ < item_queries ? item_q0 + kBlockQ : item_queries) - 1;
      const int64_t needed = last_query / kBlockK + 1;  // key j visible to query i of the item iff j <= i
      tiles = needed < tiles ? needed : tiles;
    } else if constexpr (kCausal) {
      const int64_t last_query = (w.q0 + kBlockQ < p.q_len ? w.q0 + kBlockQ : p.q_len) - 1;
      const int64_t needed = last_query / kBlockK + 1;  // SDPA causal: key j visible to query i iff j <= i
      tiles = needed < tiles ? needed : tiles;
    }
    w.kv_tiles = static_cast<int>(tiles);
    return true;
  }

  // Steps (unit, half) to this CTA's next item at or after it; false when none is left.
  __device__ static bool seek(const AttentionWgmmaParams& p, const Schedule& sc, int64_t& unit, int& half,
                              WgmmaWorkItem& w) {
    for (; unit < sc.units; unit += gridDim.x, half = 0)
      for (; half < 2; ++half)
        if (item(p, sc, unit, half, w)) return true;
    return false;
  }
};

// A kernel variant's scheduler.
template <int kHeadDim, bool kCausal, bool kPacked>
using WgmmaSchedulerOf =
    WgmmaTileScheduler<kCausal, kItemKeys<kHeadDim, kCausal> || kPacked, kPacked, kHeadDim != 256>;

}  // namespace sageattention2
