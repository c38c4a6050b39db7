// The warp-level kernel's mask: which keys of a KV tile the thread's rows may see (the tail of
// kv_len and, causal, the query's own position).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mma/params.h"
#include "mma/traits.cuh"

namespace sageattention2 {

template <typename Traits>
struct MmaMask {
  static constexpr int kBlockK = Traits::kBlockK, kSlabs = Traits::kSlabs, kKeyTiles = Traits::kKeyTiles;
  static constexpr bool kCausal = Traits::kCausal;
  using Item = typename Traits::Item;

  // Whether the tile of keys k0 .. k0 + kBlockK - 1 hides keys from some row of the warp (k0 and
  // q0 count from the item's first key and query: packed, each sequence's diagonal top-left).
  __device__ static bool needed(const AttentionMmaParams& p, const Item& item, int64_t k0, int64_t q0, int warp_row0) {
    return k0 + kBlockK > item.kv_len(p) || (kCausal && k0 + kBlockK - 1 > q0 + warp_row0);
  }

  // The scores of the keys the thread's rows do not see to -inf.
  __device__ static void apply(const AttentionMmaParams& p, const Item& item, int64_t k0, int64_t q0, int warp_row0,
                               int g, int t, float (&sc)[kSlabs][kKeyTiles][4]) {
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // The row's last visible key as an offset into the tile, in [-1, kBlockK - 1] (int32
        // compares: the int64 ones cost the registers that spilled at head_dim 128): the
        // tail of kv_len and, causal, the query's own position.
        int64_t last = item.kv_len(p) - 1 - k0;
        if (kCausal) {
          const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * r;
          last = query - k0 < last ? query - k0 : last;
        }
        const int last_key = static_cast<int>(last < -1 ? -1 : (last > kBlockK - 1 ? kBlockK - 1 : last));
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (n * 8 + 2 * t + c > last_key) sc[sl][n][2 * r + c] = -INFINITY;
      }
  }
};

}  // namespace sageattention2
