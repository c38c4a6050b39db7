// The Hopper kernel's mask: which keys of a KV tile the rows of a warp may see.
#pragma once

#include <cuda_runtime.h>  // INFINITY

#include <cstdint>

#include "hopper/params.h"
#include "hopper/tile_scheduler.cuh"

namespace sageattention2 {

// Which keys of tile `it` a warp's rows may see. Only an item's last tile can need a mask (the
// causal diagonal: a query block sees whole key tiles before it; the tail of the keys), so the
// KV loop runs the other tiles with no mask test at all: a per-warp branch in the loop made the
// compiler move the wgmma descriptors out of uniform registers, and causal loop tiles took 2,702
// cycles against 2,101 non-causal (head_dim 128, N 4K; docs/DECISIONS.md#d8).
template <bool kCausal>
struct WgmmaTileMask {
  static constexpr int kBlockK = kWgmmaBlockK;
  bool masked;
  int key_limit;   // keys of the tile that exist
  int rows_ahead;  // the thread's first row minus the tile's first key

  // kItemKeyCount: the item's keys are item_kv_len's (its key range), else kv_len (a kernel that
  // never sees key ranges; hopper/tile_scheduler.cuh's kItemKeys).
  template <bool kItemKeyCount>
  __device__ static WgmmaTileMask of(const AttentionWgmmaParams& p, const WgmmaWorkItem& w, int it, int row_in_item) {
    WgmmaTileMask mask;
    // Item-relative 32-bit offsets: the query block is w.qb, the key tile it.
    mask.rows_ahead = (w.qb - it) * kBlockK + row_in_item;
    const int warp_rows_ahead = mask.rows_ahead - row_in_item % 16;  // the warp's first row
    const int64_t kv_len = kItemKeyCount ? item_kv_len(p, w.b) : p.kv_len;
    const bool tail = static_cast<int64_t>(it + 1) * kBlockK > kv_len;
    mask.key_limit = tail ? static_cast<int>(kv_len - static_cast<int64_t>(it) * kBlockK) : kBlockK;
    mask.masked = tail || (kCausal && kBlockK - 1 > warp_rows_ahead);
    return mask;
  }

  // Applied by the masked softmax (hopper/softmax.cuh) to the score in S accumulator register i of
  // thread t (row g + 8 r with r = (i / 2) & 1, column col = 8 (i / 4) + 2 t + (i & 1)), on 32-bit
  // offsets from the tile's first key clamped to the tile (64-bit compares cost two instructions
  // and registers the causal loop does not have): the row sees the column iff col < key_limit
  // and (causal) col <= rows_ahead + 8 r; a score it does not see becomes -inf. `diagonal` is
  // diagonal(), taken once per tile.
  __device__ int diagonal() const { return rows_ahead < -9 ? -9 : (rows_ahead > kBlockK ? kBlockK : rows_ahead); }
  __device__ void apply(float& score, int i, int t, int diagonal) const {
    const int col = 8 * (i / 4) + 2 * t + (i & 1);
    if (col >= key_limit || (kCausal && col > diagonal + 8 * ((i / 2) & 1))) score = -INFINITY;
  }
};

}  // namespace sageattention2
