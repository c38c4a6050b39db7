// The K or V tile of one block_k-key block that a quantize_kv CTA stages in shared memory, and
// what the K and the V path share around it.
#pragma once

#include <cstdint>

#include "common/geometry.h"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "preprocess/params.h"
#include "preprocess/rows.cuh"

namespace sageattention2 {

// The head_dim of a view: kHeadDim where the launch compiled it in (64, 128, 256: the loops below then
// index with shifts, not divisions), else the view's.
template <int kHeadDim>
__device__ __forceinline__ int head_dim_of(const BhndView& view) {
  return kHeadDim != 0 ? kHeadDim : view.head_dim;
}

// The valid rows of a K or V tile go to shared memory by cp.async, all in flight from the CTA's
// first instructions on (loaded one 16-byte vector at a time, then processed, the launch reached
// 40-50 % of DRAM bandwidth: ncu, B4 H32 N1024-4096).
template <typename T, int kHeadDim>
__device__ __forceinline__ void start_kv_tile_copy(T* tile, const BhndView& view, int b, int h, int64_t row0,
                                                   int valid) {
  const int head_dim = head_dim_of<kHeadDim>(view), vecs = head_dim / kElemsPerVector, pitch = kv_tile_pitch(head_dim);
  for (int i = threadIdx.x; i < valid * vecs; i += kPreprocessThreads) {
    const int r = i / vecs, c = i % vecs;
    ptx::cp_async_16(tile + r * pitch + c * kElemsPerVector, row_ptr<T>(view, b, h, row0 + r) + c * kElemsPerVector,
                     true);
  }
  ptx::cp_async_commit();
}

// Per-CTA channel vectors in shared memory, shared by the K and the V path (a CTA runs one), so
// that six CTAs fit an SM at head_dim 128.
struct KVTileSmem {
  float mean[kMaxHeadDim];
  float aux[kMaxHeadDim];  // K: the group maxima (per warp, or as bits) and inverses; V: the channel inverses
  unsigned tile_amax;      // V with one scale per tile: max |V - mean| (as bits)
};

// Writes `rows` rows of codes to `dst` (row stride `code_dim` bytes); rows past `valid` are the
// zero padding of the tile.
template <typename T, bool kInt4, typename GroupOf>
__device__ __forceinline__ void store_tile_codes(const T* tile, int pitch, int rows, int valid, int vecs,
                                                 const float* mean, GroupOf group_of, const float* group_inv,
                                                 int8_t* dst, int code_dim) {
  using Codes = IntCodes<kInt4>;
  for (int i = threadIdx.x; i < rows * vecs; i += kPreprocessThreads) {
    const int r = i / vecs, c = i % vecs;
    int8_t* out = dst + static_cast<int64_t>(r) * code_dim + c * Codes::kBytesPer8;
    if (r >= valid) {
      Codes::store_zero(out);
      continue;
    }
    float x[8];
    widen8<T>(*reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] -= mean[c * kElemsPerVector + e];
    Codes::store(out, x, group_inv[group_of(r)]);
  }
}

}  // namespace sageattention2
