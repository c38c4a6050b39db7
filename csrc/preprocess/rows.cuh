// Device helpers of the preprocessing kernels over rows of [B, H, N, D] views and tiles of them
// staged in shared memory: addressing, and the max |x| reductions every quantizer takes.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/key_ranges.cuh"
#include "common/ptx.cuh"
#include "preprocess/params.h"

namespace sageattention2 {

template <typename T>
__device__ __forceinline__ const T* row_ptr(const BhndView& v, int b, int h, int64_t n) {
  return static_cast<const T*>(v.data) + b * v.stride_b + h * v.stride_h + n * v.stride_n;
}

// The rows of batch item b that a view has: with key ranges, its range's (sampled) count.
__device__ __forceinline__ int64_t item_tokens(const BhndView& v, int b) {
  if (v.ranges == nullptr) return v.tokens;
  const int stride = v.sampled ? key_range_stride(v.ranges, b) : 1;
  return (key_range_end(v.ranges, b) - key_range_first(v.ranges, b) + stride - 1) / stride;
}

// The view of batch item b's rows: with key ranges, narrowed to its range (row 0 its first
// token, item_tokens rows), so that quantization groups and means never include a masked key;
// else the view itself.
template <typename T>
__device__ __forceinline__ BhndView item_view(BhndView v, int b) {
  if (v.ranges != nullptr) {
    v.tokens = item_tokens(v, b);
    v.data = static_cast<const T*>(v.data) + static_cast<int64_t>(key_range_first(v.ranges, b)) * v.stride_n;
    if (v.sampled) v.stride_n *= key_range_stride(v.ranges, b);
  }
  return v;
}

// Non-negative floats order like their bit patterns, so a shared-memory atomicMax on the bits
// is an exact (and order-independent, hence deterministic) max of |x|.
__device__ __forceinline__ void atomic_max_abs(unsigned* slot, float abs_value) {
  atomicMax(slot, __float_as_uint(abs_value));
}

// max |x - mean| over the 16-byte vector c of row r of a tile staged in shared memory (`pitch`
// elements per row): the range every tile quantizer takes, with its mean subtracted. kNaN: a NaN
// makes it NaN (ptx::max_nan: the K quantizer, whose scales must carry a NaN to the scores);
// else a NaN is passed over (V's tile scale, where E4M3's own NaN code carries it).
template <typename T, bool kNaN = false>
__device__ __forceinline__ float vector_absmax(const T* tile, int pitch, int r, int c, const float* mean) {
  float x[8];
  widen8<T>(*reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector), x);
  float a = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float d = fabsf(x[e] - mean[c * kElemsPerVector + e]);
    a = kNaN ? ptx::max_nan(a, d) : fmaxf(a, d);
  }
  return a;
}

// max |x| of such a vector of fp16 values without a mean, in packed fp16: no arithmetic but the
// sign, so the same value as vector_absmax with a zero mean (HMNMX2 passes over a NaN as fmaxf
// does).
__device__ __forceinline__ float vector_absmax_f16(const __half* tile, int pitch, int r, int c) {
  const uint4 raw = *reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector);
  const __half2* x = reinterpret_cast<const __half2*>(&raw);
  const __half2 m = __hmax2(__hmax2(__habs2(x[0]), __habs2(x[1])), __hmax2(__habs2(x[2]), __habs2(x[3])));
  return fmaxf(__low2float(m), __high2float(m));
}

template <bool kNaN = false>  // as vector_absmax's
__device__ __forceinline__ float warp_max(float a) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, a, offset);
    a = kNaN ? ptx::max_nan(a, other) : fmaxf(a, other);
  }
  return a;
}

}  // namespace sageattention2
