// The warp-level kernel's Q quantizer: the CTA's Q block to per-thread INT8/INT4 codes in shared
// memory before its KV loop.
#pragma once

#include <cstdint>

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "mma/params.h"
#include "mma/traits.cuh"

namespace sageattention2 {

template <typename Traits>
struct MmaQQuantizer {
  using T = typename Traits::T;
  using Smem = typename Traits::Smem;
  static constexpr int kHeadDim = Traits::kHeadDim, kSlabs = Traits::kSlabs, kQkChunks = Traits::kQkChunks;
  static constexpr bool kSmoothQ = Traits::kSmoothQ;
  static constexpr QkCodes kQk = Traits::kQk;
  using Item = typename Traits::Item;

  // The CTA's Q block to per-thread codes in shared memory (paper Eq. 8, the groups and the
  // arithmetic of reference.quantize_q_reference(block_q=128, warps=8): the same codes and scales, bit for bit), so
  // Q costs no pass before the kernel. The quad that shares rows {g, g+8} of a 16-row slab
  // holds one group: thread t reads the rows' 16-byte vectors t, t + 4, ... (a warp's load
  // covers 64 contiguous bytes of 8 rows), takes the group max over the quad and writes its
  // codes where the ldmatrix of the QK product reads them. Rows past q_len are zero codes and
  // stay out of the max. Returns the thread's Q scale of each slab, times sm_scale * log2(e).
  // With the LSE and K smoothing, q . k_mean of each row (raw q: the row constant K smoothing
  // drops from every score) goes to shared memory for the epilogue.
  // q0: the block's first query, counted from the item's first (packed: its q_first).
  __device__ static void quantize_block(const AttentionMmaParams& p, const Smem& s, const Item& item, int h,
                                        int64_t q0, int warp_row0, int g, int t, float (&q_scale)[kSlabs]) {
    constexpr int kVecs = kHeadDim / 8 / 4;  // 16-byte vectors of a row per quad thread
    using Codes = IntCodes<kQk == QkCodes::kInt4>;
    const int b = item.b;
    const T* q_head = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h + item.q_first * p.q_stride_n;
    const int64_t bh = static_cast<int64_t>(b) * p.q_heads + h;
    const float* mean = kSmoothQ ? p.q_mean + bh * kHeadDim : nullptr;
    const float* k_mean = p.lse != nullptr && p.k_mean != nullptr
                              ? p.k_mean + (static_cast<int64_t>(item.seq) * p.kv_heads + h / (p.q_heads / p.kv_heads)) * kHeadDim
                              : nullptr;
#pragma unroll 1
    for (int sl = 0; sl < kSlabs; ++sl) {
      uint4 raw[2][kVecs];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * r;
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
          raw[r][j] = query < item.q_len(p) ? ptx::ld_global_nc_v4(q_head + query * p.q_stride_n + (4 * j + t) * 8)
                                      : make_uint4(0, 0, 0, 0);
      }
      // Launched after quantize_kv (after_quantize_kv), the kernel may read only the caller's Q
      // before this, and write nothing: the means, K, V and Delta-S come from the launches
      // before it. Q's loads are in flight while it waits. (The next slab's wait returns at
      // once, as does every wait of a grid launched the ordinary way.)
      ptx::griddepcontrol_wait();
      float x[2][kVecs][8];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool valid = q0 + warp_row0 + sl * 16 + g + 8 * r < item.q_len(p);
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          widen8<T>(raw[r][j], x[r][j]);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int channel = (4 * j + t) * 8 + e;
            if (k_mean != nullptr) dot = fmaf(x[r][j][e], __ldg(k_mean + channel), dot);
            // Rows past q_len read as zeros and stay zeros (the mean is not subtracted there).
            if (kSmoothQ && valid) x[r][j][e] -= __ldg(mean + channel);
          }
        }
        if (k_mean != nullptr) {
          dot = quad_sum(dot);
          if (t == 0) s.row_constant()[warp_row0 + sl * 16 + g + 8 * r] = dot;
        }
      }
      float amax = 0.0f;
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) amax = ptx::max_nan(amax, fabsf(x[r][j][e]));
      const float scale = quant_scale(quad_max(amax), static_cast<float>(Codes::kQmax));
      const float inv = quant_inverse(scale);
      // A runtime slab index must not index the register array (it would go to local memory).
#pragma unroll
      for (int i = 0; i < kSlabs; ++i)
        if (i == sl) q_scale[i] = scale * p.q_scale_multiplier;
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int byte = (4 * j + t) * Codes::kBytesPer8;  // of the code row
          Codes::store(reinterpret_cast<int8_t*>(s.q() + swizzled_offset<kQkChunks>(warp_row0 + sl * 16 + g + 8 * r,
                                                                                  byte / 16) + byte % 16),
                       x[r][j], inv);
        }
    }
  }
};

}  // namespace sageattention2
