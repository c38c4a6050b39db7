// The warp-level kernel's epilogue: O normalised by the row sums (FP8 PV: times V's channel
// scale, plus its mean), written in the caller's dtype and layout; the natural-log LSE.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/quant_math.cuh"  // kLog2Fp8Max
#include "common/v_channels.cuh"
#include "mma/params.h"
#include "mma/softmax.cuh"
#include "mma/traits.cuh"

namespace sageattention2 {

template <typename Traits>
struct MmaEpilogue {
  using T = typename Traits::T;
  using Smem = typename Traits::Smem;
  static constexpr int kHeadDim = Traits::kHeadDim, kSlabs = Traits::kSlabs, kDimTiles = Traits::kDimTiles;
  static constexpr bool kFp8Pv = Traits::kFp8Pv;
  using Item = typename Traits::Item;

  Fp8PvChannels<kFp8Pv ? kDimTiles : 1> v_channels;

  // The thread's rows g and g + 8 of each slab of the warp (rows warp_row0 ...) of query block q0
  // (counted from the item's first query) of head h of `item`; V's scales and means are those of
  // the item's KV head, seq_hk (item.seq * kv_heads + its KV head).
  __device__ void store(const AttentionMmaParams& p, const Smem& s, const Item& item, int h, int64_t seq_hk,
                        int64_t q0, int warp_row0, int g, int t, const float (&o)[kSlabs][kDimTiles][4],
                        const MmaSoftmax<Traits>& softmax) {
    const int b = item.b;
    T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h + item.q_first * p.out_stride_n;
    if constexpr (kFp8Pv)
      v_channels.load(p.v_scale + seq_hk * kHeadDim, p.v_mean != nullptr ? p.v_mean + seq_hk * kHeadDim : nullptr, t);
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = softmax.row_sum[sl][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * r;
        if (query >= item.q_len(p)) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* row = out + query * p.out_stride_n;
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          const int col = n * 8 + 2 * t;
          float2 x = make_float2(o[sl][n][2 * r] * inv, o[sl][n][2 * r + 1] * inv);
          if constexpr (kFp8Pv) x = v_channels.apply(x.x, x.y, n);
          *reinterpret_cast<uint32_t*>(row + col) = HalfPair<T>::pack(x.x, x.y);
        }
        if (p.lse != nullptr && t == 0) {
          constexpr float kLn2 = 0.6931471805599453f;
          // FP8: l sums P~ * 448. K smoothing dropped the row constant sm_scale * q . k_mean,
          // which the LSE of the true scores includes (this thread wrote it, mma/q_quantizer.cuh).
          const float log2_l = __log2f(l) - (kFp8Pv ? kLog2Fp8Max : 0.0f);
          const float dropped = p.k_mean != nullptr ? p.sm_scale * s.row_constant()[warp_row0 + sl * 16 + g + 8 * r] : 0.0f;
          p.lse[(static_cast<int64_t>(b) * p.q_heads + h) * p.q_len + item.q_first + query] =
              l > 0.0f ? (softmax.row_max[sl][r] + log2_l) * kLn2 + dropped : -INFINITY;
        }
      }
  }
};

}  // namespace sageattention2
