// The warp-level kernel's work item: one CTA's block of 128 queries of one head, of a batch item
// or (kPacked) of one packed sequence (docs/DESIGN.md#packed-sequences): where its rows, codes
// and statistics are.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/key_ranges.cuh"
#include "mma/params.h"

namespace sageattention2 {

template <bool kPacked>
struct MmaItem {
  int qb;            // the query block within the item
  int b;             // the batch item of q, out, lse, the codes and V (packed: 0, one slab per head)
  int seq;           // the item of K's and V's means and V's scales: b, or the sequence
  // 32-bit, as the tables are (registers are short: the head_dim 128 loops run at 255).
  int q_first;   // the item's first row of q, out and lse (0 unpacked)
  int code_row;  // its first row of the codes and the first column of FP8 V (0 unpacked)
  int k_first;   // its first row of the caller's V (0 unpacked)
  int queries, keys;  // (packed) its query and key counts

  // Unpacked, the counts are the call's, read where they are used (as the kernel always did).
  __device__ int64_t q_len(const AttentionMmaParams& p) const {
    if constexpr (kPacked) return queries;
    else return p.q_len;
  }
  __device__ int64_t kv_len(const AttentionMmaParams& p) const {
    if constexpr (kPacked) return keys;
    else return p.kv_len;
  }

  // This CTA's item. Causal, the heaviest query blocks (most keys) are scheduled first: the
  // grid's blocks in reverse (packed: the table's entries in reverse, each sequence's last
  // blocks first).
  template <bool kCausal>
  __device__ static MmaItem of(const AttentionMmaParams& p) {
    MmaItem w;
    const int x = static_cast<int>(blockIdx.x);
    const int entry = kCausal ? static_cast<int>(gridDim.x) - 1 - x : x;
    if constexpr (kPacked) {
      w.seq = __ldg(p.packed_blocks + 2 * entry);
      w.qb = __ldg(p.packed_blocks + 2 * entry + 1);
      w.b = 0;
      w.q_first = packed_q_first(p.packed_items, w.seq);
      w.queries = packed_q_end(p.packed_items, w.seq) - w.q_first;
      w.code_row = packed_code_row(p.packed_items, w.seq);
      w.k_first = key_range_first(p.key_ranges, w.seq);
      w.keys = key_range_end(p.key_ranges, w.seq) - w.k_first;
    } else {
      w.qb = entry;
      w.b = w.seq = static_cast<int>(blockIdx.z);
      w.q_first = w.code_row = w.k_first = 0;
      w.queries = w.keys = 0;
    }
    return w;
  }
};

}  // namespace sageattention2
