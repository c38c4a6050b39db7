// K of one block to per-thread INT8/INT4 codes (paper Eq. 8: 4 groups per block, smoothed by K's
// token mean), with the exact Delta-S of Q smoothing: quantize_kv's K CTA.
#pragma once

#include <cstdint>

#include "common/convert.cuh"
#include "common/geometry.h"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "preprocess/kv_tile.cuh"
#include "preprocess/params.h"
#include "preprocess/rows.cuh"

namespace sageattention2 {

template <typename T, bool kInt4, int kHeadDim>
__device__ __forceinline__ void quantize_k_tile(const QuantizeKVParams& p, T* tile, KVTileSmem& sm, int kb, int h,
                                                int b) {
  const BhndView k = item_view<T>(p.k, b);  // (key ranges: the item's keys from row 0)
  using Codes = IntCodes<kInt4>;
  float* mean = sm.mean;
  unsigned* group_amax = reinterpret_cast<unsigned*>(sm.aux);
  float* group_inv = sm.aux + kKGroupsPerBlock;
  const int head_dim = head_dim_of<kHeadDim>(k), vecs = head_dim / kElemsPerVector, pitch = kv_tile_pitch(head_dim);
  const int block_k = p.block_k;
  const int64_t row0 = static_cast<int64_t>(kb) * block_k;
  const int valid = static_cast<int>(k.tokens - row0 < block_k ? k.tokens - row0 : block_k);
  const int64_t bh = static_cast<int64_t>(b) * k.heads + h;
  const int64_t blocks = p.padded_tokens / block_k;
  // The item's codes and scales (code_head, code_row0: packed items share one slab per head).
  const int64_t code_slab = code_head(p.packed_items, b, h, k.heads);
  const int code_row = code_row0(p.packed_items, b);
  const int64_t scale_block0 = code_slab * blocks + code_row / block_k;

  start_kv_tile_copy<T, kHeadDim>(tile, k, b, h, row0, valid);
  ptx::griddepcontrol_wait();  // the means, and every write, after the kernel before (quantize_kv_kernel)
  for (int d = threadIdx.x; d < head_dim; d += kPreprocessThreads)
    mean[d] = p.k_mean != nullptr ? p.k_mean[bh * head_dim + d] : 0.0f;
  if (threadIdx.x < kKGroupsPerBlock) group_amax[threadIdx.x] = 0u;
  ptx::cp_async_wait<0>();
  __syncthreads();

  // The group maxima: a thread keeps its 4 in registers and each warp reduces them before one
  // shared atomic per group (an atomic per 16-byte vector put 16-32 lanes on one address).
  float amax[kKGroupsPerBlock] = {};
  for (int i = threadIdx.x; i < valid * vecs; i += kPreprocessThreads) {
    const float a = vector_absmax<T, true>(tile, pitch, i / vecs, i % vecs, mean);
    const int group = k_group_of_key(i / vecs);
#pragma unroll
    for (int g = 0; g < kKGroupsPerBlock; ++g) amax[g] = g == group ? ptx::max_nan(amax[g], a) : amax[g];
  }
#pragma unroll
  for (int g = 0; g < kKGroupsPerBlock; ++g) {
    const float group_max = warp_max<true>(amax[g]);
    if (threadIdx.x % 32 == 0) atomic_max_abs(&group_amax[g], group_max);
  }
  __syncthreads();
  const auto k_group = [](int r) { return k_group_of_key(r); };

  if (threadIdx.x < kKGroupsPerBlock) {
    const float scale = quant_scale(__uint_as_float(group_amax[threadIdx.x]), static_cast<float>(Codes::kQmax));
    group_inv[threadIdx.x] = quant_inverse(scale);
    p.k_scales[(scale_block0 + kb) * kKGroupsPerBlock + threadIdx.x] = scale;
  }
  __syncthreads();

  const int code_dim = kInt4 ? head_dim / 2 : head_dim;
  store_tile_codes<T, kInt4>(tile, pitch, block_k, valid, vecs, mean, k_group, group_inv,
                             p.k_codes + (code_slab * p.padded_tokens + code_row + row0) * code_dim, code_dim);

  if (p.q_mean != nullptr) {
    // Delta-S_j = q_mean . gamma(K_j) from the unquantized smoothed key: exact in float32.
    const int group_size = p.q_heads / k.heads;
    for (int i = threadIdx.x; i < group_size * block_k; i += kPreprocessThreads) {
      const int hq = h * group_size + i / block_k, r = i % block_k;
      float s = 0.0f;
      if (r < valid) {
        const float* qm = p.q_mean + (static_cast<int64_t>(b) * p.q_heads + hq) * head_dim;
        for (int c = 0; c < vecs; ++c) {
          float x[8];
          widen8<T>(*reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector), x);
#pragma unroll
          for (int e = 0; e < 8; ++e) s = fmaf(__ldg(qm + c * kElemsPerVector + e), x[e] - mean[c * kElemsPerVector + e], s);
        }
        s *= p.delta_s_multiplier;
      }
      p.delta_s[(static_cast<int64_t>(b) * p.q_heads + hq) * p.padded_tokens + row0 + r] = s;
    }
  }
}

// K of one 128-key block from registers, for a head_dim known at compile time and no Delta-S
// (sageattn's INT8 paths). Warp w holds rows 16w .. 16w + 15; lane l the 16-byte vector l % kVecs
// of rows 16w + j * kRowsPerPass + l / kVecs. Its values are loaded once and stay in registers,
// each group max is reduced by shuffles and one shared slot per warp, and the codes are written
// from the same registers. Same groups and arithmetic as quantize_k_tile, so the same codes and
// scales bit for bit, without its divisions, second pass over shared memory and shared atomics:
// at B4 H32 N4096 hd128 the K + V launch, which had kept 68 % of the issue slots and 62 % of DRAM
// bandwidth busy (ncu), went from 185 to 146 us, 72 to 92 % of copy bandwidth
// (docs/DECISIONS.md#d16).
template <typename T, bool kInt4, int kHeadDim>
__device__ __forceinline__ void quantize_k_block_in_registers(const QuantizeKVParams& p, KVTileSmem& sm, int kb, int h,
                                                              int b) {
  const BhndView k = item_view<T>(p.k, b);
  using Codes = IntCodes<kInt4>;
  constexpr int kBlockK = kRegisterKBlock, kWarps = kPreprocessThreads / 32, kWarpRows = kBlockK / kWarps;
  constexpr int kVecs = kHeadDim / kElemsPerVector, kRowsPerPass = 32 / kVecs, kPasses = kWarpRows / kRowsPerPass;
  static_assert(32 % kVecs == 0 && kWarpRows % kRowsPerPass == 0 && kWarpRows % 8 == 0, "lane geometry");
  constexpr int kCodeDim = kInt4 ? kHeadDim / 2 : kHeadDim;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, c = lane % kVecs, sub = lane / kVecs;
  const int64_t row0 = static_cast<int64_t>(kb) * kBlockK;
  const int valid = static_cast<int>(k.tokens - row0 < kBlockK ? k.tokens - row0 : kBlockK);
  const int64_t bh = static_cast<int64_t>(b) * k.heads + h;
  const int64_t code_slab = code_head(p.packed_items, b, h, k.heads);
  const int code_row = code_row0(p.packed_items, b);
  const int first_row = warp * kWarpRows + sub;  // the lane's row of pass 0; pass j adds j * kRowsPerPass

  uint4 raw[kPasses];
  const T* src = row_ptr<T>(k, b, h, row0 + first_row) + c * kElemsPerVector;
#pragma unroll
  for (int j = 0; j < kPasses; ++j)
    raw[j] = first_row + j * kRowsPerPass < valid ? ptx::ld_global_nc_v4(src + j * kRowsPerPass * k.stride_n)
                                                  : make_uint4(0u, 0u, 0u, 0u);
  ptx::griddepcontrol_wait();  // the means, and every write, after the kernel before (quantize_kv_kernel)
  float mean[kElemsPerVector];
#pragma unroll
  for (int e = 0; e < kElemsPerVector; ++e)
    mean[e] = p.k_mean != nullptr ? __ldg(p.k_mean + bh * kHeadDim + c * kElemsPerVector + e) : 0.0f;

  // Rows of a warp's pass j are keys with (j * kRowsPerPass + sub) % 8 fixed: their K group.
  const auto group_of_pass = [&](int j) { return k_group_of_key(j * kRowsPerPass + sub); };
  float amax[kKGroupsPerBlock] = {};
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    if (first_row + j * kRowsPerPass >= valid) continue;
    float x[kElemsPerVector];
    widen8<T>(raw[j], x);
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) a = ptx::max_nan(a, fabsf(x[e] - mean[e]));
    const int group = group_of_pass(j);
#pragma unroll
    for (int g = 0; g < kKGroupsPerBlock; ++g) amax[g] = g == group ? ptx::max_nan(amax[g], a) : amax[g];
  }
  float* warp_amax = sm.aux;  // [kWarps][kKGroupsPerBlock]
#pragma unroll
  for (int g = 0; g < kKGroupsPerBlock; ++g) {
    const float group_max = warp_max<true>(amax[g]);
    if (lane == 0) warp_amax[warp * kKGroupsPerBlock + g] = group_max;
  }
  __syncthreads();
  float* group_inv = sm.aux + kWarps * kKGroupsPerBlock;
  if (tid < kKGroupsPerBlock) {
    float group_max = 0.0f;
    for (int w = 0; w < kWarps; ++w) group_max = ptx::max_nan(group_max, warp_amax[w * kKGroupsPerBlock + tid]);
    const float scale = quant_scale(group_max, static_cast<float>(Codes::kQmax));
    group_inv[tid] = quant_inverse(scale);
    p.k_scales[(code_slab * (p.padded_tokens / kBlockK) + code_row / kBlockK + kb) * kKGroupsPerBlock + tid] = scale;
  }
  __syncthreads();

  int8_t* dst = p.k_codes + (code_slab * p.padded_tokens + code_row + row0 + first_row) * kCodeDim + c * Codes::kBytesPer8;
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    int8_t* out = dst + j * kRowsPerPass * kCodeDim;
    if (first_row + j * kRowsPerPass >= valid) {
      Codes::store_zero(out);  // the block's padding rows
      continue;
    }
    float x[kElemsPerVector];
    widen8<T>(raw[j], x);
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) x[e] -= mean[e];
    Codes::store(out, x, group_inv[group_of_pass(j)]);
  }
}

}  // namespace sageattention2
