// V's channel vectors in the epilogue of both attention kernels' FP8 PV product.
#pragma once

#include <cuda_runtime.h>

namespace sageattention2 {

// The epilogue of an FP8 PV product (paper Alg. 1, A.3): the normalised accumulator of channel c
// times V's FP8 scale (P's x448 cancels against the row sum, which sums P~ * 448), plus V's mean
// under smooth V. A thread writes the channels 8n + 2t, 8n + 2t + 1 of its rows; it loads their
// means (and per-channel scales) into registers once, all loads in flight together, before the
// first store: loaded next to the stores, each load would wait for the one before (the compiler
// cannot move a load above a store to the output, which might alias it), 16 to 32 global
// latencies in a row while the SM's tensor cores idle.
template <int kTiles>  // n8 tiles of head_dim
struct VChannelMeans {  // the Hopper kernel's V: one scale per tile, folded into 1 / l
  float2 mean[kTiles];
  __device__ __forceinline__ void load(const float* v_mean, int t) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
      mean[n] = v_mean != nullptr ? __ldg(reinterpret_cast<const float2*>(v_mean + 8 * n + 2 * t)) : make_float2(0.0f, 0.0f);
  }
  // lo, hi: the normalised, scaled accumulators of the channels 8n + 2t and 8n + 2t + 1.
  __device__ __forceinline__ float2 apply(float lo, float hi, int n) const {
    return make_float2(lo + mean[n].x, hi + mean[n].y);
  }
};

template <int kTiles>
struct Fp8PvChannels {  // the warp-level kernels' V: one scale per channel over all tokens
  float2 scale[kTiles];
  VChannelMeans<kTiles> means;
  __device__ __forceinline__ void load(const float* v_scale, const float* v_mean, int t) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n) scale[n] = __ldg(reinterpret_cast<const float2*>(v_scale + 8 * n + 2 * t));
    means.load(v_mean, t);
  }
  // lo, hi: the normalised accumulators of the channels 8n + 2t and 8n + 2t + 1.
  __device__ __forceinline__ float2 apply(float lo, float hi, int n) const {
    return make_float2(fmaf(lo, scale[n].x, means.mean[n].x), fmaf(hi, scale[n].y, means.mean[n].y));
  }
};

}  // namespace sageattention2
