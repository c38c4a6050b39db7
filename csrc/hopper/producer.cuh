// The producer of the Hopper kernel (FlashAttention-3's mainloop load side): one thread of
// warpgroup 0 streams the K tiles (INT8, from quantize_kv) with their 4 group scales, and the V
// tiles (E4M3, transposed, from quantize_kv; or the caller's 16-bit V itself), of its CTA's items back to back into the kStages-deep shared-memory
// ring with the copy engine, on the full/empty mbarriers the consumers (hopper/mainloop.cuh)
// wait on and release.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "common/ptx.cuh"
#include "hopper/geometry.cuh"
#include "hopper/params.h"
#include "hopper/tile_scheduler.cuh"

namespace sageattention2 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int kHeadDim, bool kCausal, bool kFp8Pv, bool kPacked = false>
struct WgmmaProducer {
  using Geometry = WgmmaGeometry<kHeadDim, kFp8Pv>;
  using Scheduler = WgmmaSchedulerOf<kHeadDim, kCausal, kPacked>;
  static constexpr int kBlockK = Geometry::kBlockK, kStages = Geometry::kStages;
  static constexpr int kKBytes = Geometry::kKBytes, kVBytes = Geometry::kVBytes;

  __device__ static void run(const AttentionWgmmaParams& p, const CUtensorMap* k_map, const CUtensorMap* v_map,
                             typename Geometry::Smem& s) {
    ptx::prefetch_tensor_map(k_map);
    ptx::prefetch_tensor_map(v_map);
    // K, its scales and V: complete once quantize_kv, the launch before, is (after_quantize_kv;
    // otherwise it returns at once).
    ptx::griddepcontrol_wait();
    const typename Scheduler::Schedule sc = Scheduler::schedule(p.q_len, p.batch, p.q_heads, p.unit_items);
    uint32_t seq = 0;  // tiles streamed so far: the ring position
    int64_t unit = blockIdx.x;
    int half = 0;
    WgmmaWorkItem w;
    for (; Scheduler::seek(p, sc, unit, half, w); ++half) {
      // The item's slab of codes and its first row there (packed items: rows of one slab per head).
      const int bhk = item_code_slab<kPacked>(p, w), code_row = item_code_row<kPacked>(p, w);
      const float* k_scale = kPacked ? p.k_scale + item_first_tile<true>(p, w) * 4
                                     : p.k_scale + static_cast<int64_t>(bhk) * (p.k_padded / kBlockK) * 4;
      // The caller's 16-bit V from the item's first key; a key range's keys past its end are
      // the masked keys of the same item, which the mask weights by 0. Packed items: V's
      // zero-padded copy, from the item's code row (batch 0).
      const int first_key = kPacked ? code_row : kFp8Pv || kCausal ? 0 : item_first_key(p, w.b);
      const int v_batch = kPacked ? 0 : w.b;
      for (int it = 0; it < w.kv_tiles; ++it, ++seq) {
        const int stage = seq % kStages;
        const uint32_t phase = (seq / kStages) & 1;
        ptx::mbarrier_wait_sleeping(&s.empty_k[stage], phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&s.full_k[stage], kKBytes + 16);
        // One box per 128-byte span of K's rows (head_dim 256: two tiles, hopper/geometry.cuh).
#pragma unroll
        for (int span = 0; span < Geometry::kRowSpans; ++span)
          ptx::tma_load_3d(s.k[stage] + span * kBlockK * Geometry::kSpanRowBytes, k_map,
                           span * Geometry::kSpanRowBytes, code_row + it * kBlockK, bhk, &s.full_k[stage]);
        ptx::bulk_load(s.k_scale[stage], k_scale + it * 4, 16, &s.full_k[stage]);
        ptx::mbarrier_wait_sleeping(&s.empty_v[stage], phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&s.full_v[stage], kVBytes);
        if constexpr (kFp8Pv) {
          ptx::tma_load_3d(s.v[stage], v_map, code_row + it * kBlockK, 0, bhk, &s.full_v[stage]);
        } else {  // 128 keys x 64 channels per copy; keys past kv_len land as zeros
#pragma unroll
          for (int chunk = 0; chunk < kHeadDim / 64; ++chunk)
            ptx::tma_load_4d(s.v[stage] + chunk * Geometry::kVChunkBytes, v_map, chunk * 64,
                             first_key + it * kBlockK, w.hk, v_batch, &s.full_v[stage]);
        }
      }
    }
  }
};
#endif  // sm_90a

}  // namespace sageattention2
