// V of one block to E4M3 (paper 3.3), transposed into the key order of the PV MMA
// (docs/DESIGN.md#v-layout), with smoothing_stats' per-channel scales or one scale per tile:
// quantize_kv's V CTA.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/geometry.h"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "preprocess/kv_tile.cuh"
#include "preprocess/params.h"
#include "preprocess/rows.cuh"

namespace sageattention2 {

template <typename T, int kHeadDim>
__device__ __forceinline__ void quantize_v_tile(const QuantizeKVParams& p, T* v_tile, KVTileSmem& sm, int kb, int h,
                                                int b) {
  const BhndView v = item_view<T>(p.v, b);  // (key ranges: the item's keys from row 0)
  const int tid = threadIdx.x;
  float* mean = sm.mean;
  float* channel_inv = sm.aux;
  const int head_dim = head_dim_of<kHeadDim>(v), pitch = kv_tile_pitch(head_dim);
  const int block_k = p.block_k;
  const int64_t row0 = static_cast<int64_t>(kb) * block_k;
  const int valid = static_cast<int>(v.tokens - row0 < block_k ? v.tokens - row0 : block_k);
  const int64_t bh = static_cast<int64_t>(b) * v.heads + h;
  // The item's codes and tile scales (code_head, code_row0: packed items share one slab per head).
  const int64_t code_slab = code_head(p.packed_items, b, h, v.heads);
  const int code_row = code_row0(p.packed_items, b);

  start_kv_tile_copy<T, kHeadDim>(v_tile, v, b, h, row0, valid);
  // The means, and every write, after the kernel before (quantize_kv_kernel); a V tile that
  // needs nothing of it and writes only memory it never touches need not wait.
  if (!(p.v_overlaps_prior_grid && p.v_mean == nullptr && p.v_scale == nullptr)) ptx::griddepcontrol_wait();
  const bool per_tile = p.v_scale == nullptr;
  for (int d = tid; d < head_dim; d += kPreprocessThreads) {
    mean[d] = p.v_mean != nullptr ? p.v_mean[bh * head_dim + d] : 0.0f;
    channel_inv[d] = per_tile ? 0.0f : quant_inverse(p.v_scale[bh * head_dim + d]);
  }
  if (tid == 0) sm.tile_amax = 0u;
  ptx::cp_async_wait<0>();
  __syncthreads();

  // fp16 V without a mean under one scale per tile (sageattn's Hopper path by default) is
  // quantized in packed fp16, with the float path's codes bit for bit: its range is exact in
  // fp16, and so is v * (1 / s), 1 / s being a power of two (v_tile_scale), while the product
  // is a normal fp16 (products below 2^-14 keep their sign and are far under 2^-10, where E4M3
  // rounds to zero, in both paths). 2-3 instructions per element fewer.
  constexpr bool kHalf = std::is_same_v<T, __half>;
  const bool packed = kHalf && per_tile && p.v_mean == nullptr;

  // One scale for the whole tile (the Hopper kernel's V): its range is known once the tile is
  // in shared memory, so V needs no pass over all tokens before this one (issue 4).
  float tile_inv = 0.0f;
  if (per_tile) {
    const int vecs = head_dim / kElemsPerVector;
    float a = 0.0f;
    for (int i = tid; i < valid * vecs; i += kPreprocessThreads) {
      if constexpr (kHalf) {
        if (packed) {
          a = fmaxf(a, vector_absmax_f16(v_tile, pitch, i / vecs, i % vecs));
          continue;
        }
      }
      a = fmaxf(a, vector_absmax(v_tile, pitch, i / vecs, i % vecs, mean));
    }
    a = warp_max(a);
    if (tid % 32 == 0) atomic_max_abs(&sm.tile_amax, a);
    __syncthreads();
    const float scale = v_tile_scale(__uint_as_float(sm.tile_amax));
    tile_inv = quant_inverse(scale);
    if (tid == 0) p.v_tile_scale[code_slab * (p.padded_tokens / block_k) + code_row / block_k + kb] = scale;
  }

  // A thread transposes a channel pair (one 32-bit word of each tile row) over a 32-key slab:
  // consecutive lanes take consecutive words, so a warp's reads of one key hit 32 banks. (One
  // channel per thread with the slabs on consecutive lanes read 8 rows 16 keys apart, all in one
  // bank: the launch was shared-memory bound at 91 % of L1 throughput, ncu.) 32 keys make each
  // thread's stores whole 32-byte sectors of its two output rows.
  constexpr int kSlabKeys = 32;
  const int words = head_dim / 2, slabs = block_k / kSlabKeys;
  const bool packed_codes = packed && tile_inv <= 32768.0f;  // 1 / s a normal fp16 (or 0)
  const __half2 packed_inv = __float2half2_rn(tile_inv);
  for (int i = tid; i < words * slabs; i += kPreprocessThreads) {
    const int d = 2 * (i % words), slab = i / words;
    const float mean0 = mean[d], mean1 = mean[d + 1];
    const float inv0 = per_tile ? tile_inv : channel_inv[d], inv1 = per_tile ? tile_inv : channel_inv[d + 1];
    uint32_t codes[2][kSlabKeys / 4];
#pragma unroll
    for (int w = 0; w < kSlabKeys / 4; ++w) {
      if constexpr (kHalf) {
        if (packed_codes) {
          uint32_t key_codes[4];  // per key: channel d's code in the low byte, d + 1's above
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = v_key_of_slot(slab * kSlabKeys + w * 4 + e);
            uint32_t word = key < valid ? *reinterpret_cast<const uint32_t*>(v_tile + key * pitch + d) : 0u;
            const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&word), packed_inv);
            key_codes[e] = ptx::cvt_e4m3x2_rn_satfinite(*reinterpret_cast<const uint32_t*>(&scaled));
          }
          const uint32_t keys01 = key_codes[0] | key_codes[1] << 16, keys23 = key_codes[2] | key_codes[3] << 16;
          codes[0][w] = __byte_perm(keys01, keys23, 0x6420);  // the low bytes: channel d of the 4 keys
          codes[1][w] = __byte_perm(keys01, keys23, 0x7531);
          continue;
        }
      }
      float x[2][4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = v_key_of_slot(slab * kSlabKeys + w * 4 + e);
        x[0][e] = x[1][e] = 0.0f;
        if (key < valid) {
          const uint32_t word = *reinterpret_cast<const uint32_t*>(v_tile + key * pitch + d);
          const T* pair = reinterpret_cast<const T*>(&word);
          x[0][e] = (widen1<T>(pair[0]) - mean0) * inv0;
          x[1][e] = (widen1<T>(pair[1]) - mean1) * inv1;
        }
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) codes[c][w] = pack_e4m3x4(x[c][0], x[c][1], x[c][2], x[c][3]);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint4* out = reinterpret_cast<uint4*>(p.v_codes + (code_slab * head_dim + d + c) * p.padded_tokens + code_row + row0 +
                                            slab * kSlabKeys);
      out[0] = make_uint4(codes[c][0], codes[c][1], codes[c][2], codes[c][3]);
      out[1] = make_uint4(codes[c][4], codes[c][5], codes[c][6], codes[c][7]);
    }
  }
}

}  // namespace sageattention2
