// The Hopper kernel's Q quantizer: each consumer thread copies its two Q rows of the next item
// into its own shared-memory staging slots (cp.async) while the current item runs, then quantizes
// them to INT8 in registers, one scale per row, into the warpgroup's Q tile that the QK wgmma
// reads (so no Q pass runs before the kernel).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "hopper/geometry.cuh"
#include "hopper/params.h"
#include "hopper/tile_scheduler.cuh"

namespace sageattention2 {

// What the quantizer tells the KV loop and the epilogue about the thread's two Q rows.
struct WgmmaQRows {
  float scale[2];       // dequantization scales of the rows g and g+8, times sm_scale * log2 e
  float k_mean_dot[2];  // q_row . k_mean for the rows g and g+8 (LSE only)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// kPacked: the variant of packed items (hopper/tile_scheduler.cuh), whose queries end at their
// item's end query.
template <typename T, int kHeadDim, bool kPacked = false>
struct WgmmaQQuantizer {
  __device__ static int64_t query_end(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
    return item_query_end<kPacked>(p, w);
  }

  using Geometry = WgmmaGeometry<kHeadDim>;
  static constexpr int kQkSteps = Geometry::kQkSteps, kQSlots = Geometry::kQSlots;

  // Byte offset of (row, byte) in a K-major tile whose rows are one swizzle span (64 or 128
  // bytes): the copy engine's SWIZZLE_64B/128B pattern, which kmajor_descriptor() describes. At
  // head_dim 256 the 64 rows' bytes 128-255 form a second such tile after the first.
  __device__ static int swizzled(int row, int byte) {
    constexpr int kRowBytes = Geometry::kSpanRowBytes;  // INT8 Q and K rows (of one span)
    if constexpr (Geometry::kRowSpans > 1) {
      const int span = byte / kRowBytes;
      byte %= kRowBytes;
      const int chunk = byte / 16;
      return span * 64 * kRowBytes + row * kRowBytes + (chunk ^ (row & 7)) * 16 + byte % 16;
    }
    const int chunk = byte / 16;
    const int mixed = kRowBytes == 128 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3);
    return row * kRowBytes + mixed * 16 + byte % 16;
  }

  // One row's codes: the max |x| over the quad that shares the row, the INT8 codes (the arithmetic
  // of docs/DESIGN.md#quantizer-arithmetic) into the warpgroup's Q tile at `row`; returns the
  // row's scale. value(s, half, i) is the row's channel 32 s + 16 half + 4 t + i.
  template <typename Value>
  __device__ static float quantize_row(const Value& value, int row, int t, uint8_t* q_tile) {
    float amax = 0.0f;
#pragma unroll
    for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = ptx::max_nan(amax, fabsf(value(s, half, i)));
    const float scale = quant_scale(quad_max(amax), kInt8Max);
    const float inv = quant_inverse(scale);
#pragma unroll
    for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t word = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          word |= static_cast<uint32_t>(quantize_to_int(value(s, half, i), inv, 127) & 0xFF) << (8 * i);
        *reinterpret_cast<uint32_t*>(q_tile + swizzled(row, 32 * s + 16 * half + 4 * t)) = word;
      }
    return scale;
  }

  // Copies rows r0 and r0 + 8 of item w's Q (channels {32s + 4t .. +3, 32s + 16 + 4t .. +3}, the
  // thread's part of the A fragment layout) into the thread's own staging slots; rows past the end
  // come out as zeros. Only this thread reads them back, so cp.async.wait_group is all the sync.
  // Without staging (head_dim 256) nothing happens here: quantize() reads the rows itself.
  __device__ static void stage(const AttentionWgmmaParams& p, const WgmmaWorkItem& w, int64_t r0, int t,
                               uint2 (&slots)[kQSlots][32], int lane) {
    if constexpr (!Geometry::kStageQ) return;
    const T* q_head = static_cast<const T*>(p.q) + w.b * p.q_stride_b + w.h * p.q_stride_h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = w.q0 + r0 + 8 * r;
      const bool valid = row < query_end(p, w);
      const T* src = q_head + (valid ? row : 0) * p.q_stride_n + 4 * t;
#pragma unroll
      for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          ptx::cp_async_8(&slots[(r * kQkSteps + s) * 2 + half][lane], src + 32 * s + 16 * half, valid);
    }
    ptx::cp_async_commit();
  }

  // Takes the staged rows, each row's max |x| over the quad that shares it, quantizes with the
  // arithmetic of docs/DESIGN.md#quantizer-arithmetic and stores the codes into the warpgroup's
  // Q tile. One scale per query row, finer than the paper's per-thread group of rows {g, g+8}
  // (Eq. 8), for one multiply per tile and one register in the loop: the softmax treats a
  // thread's two rows apart anyway (row max, bias), so it dequantizes with one scale per row
  // nearly as cheaply as with one per thread. It is what brings the outliers family (large
  // channels that vary per token) within the official kernel's accuracy (docs/DECISIONS.md#d3).
  // r0: the thread's first row in the item, as stage() takes it.
  __device__ static WgmmaQRows quantize(const AttentionWgmmaParams& p, const WgmmaWorkItem& w, int slab_row, int t,
                                        const uint2 (&slots)[kQSlots][32], int lane, uint8_t* q_tile, int64_t r0) {
    if constexpr (Geometry::kStageQ) return quantize_staged(p, w, slab_row, t, slots, lane, q_tile);
    else return quantize_unstaged(p, w, slab_row, t, q_tile, r0);
  }

  __device__ static WgmmaQRows quantize_staged(const AttentionWgmmaParams& p, const WgmmaWorkItem& w, int slab_row,
                                               int t, const uint2 (&slots)[kQSlots][32], int lane, uint8_t* q_tile) {
    float x[2][kQkSteps][2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint2 raw = slots[(r * kQkSteps + s) * 2 + half][lane];
          const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int i = 0; i < 4; ++i) x[r][s][half][i] = widen1<T>(e[i]);
        }
    WgmmaQRows info;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const auto value = [&](int s, int half, int i) { return x[r][s][half][i]; };
      info.scale[r] = quantize_row(value, slab_row + 8 * r, t, q_tile) * (p.sm_scale * 1.4426950408889634f);
    }
    info.k_mean_dot[0] = info.k_mean_dot[1] = 0.0f;
    if (p.lse != nullptr && p.k_mean != nullptr) {
      const float* km = p.k_mean + (static_cast<int64_t>(w.b) * p.kv_heads + w.hk) * kHeadDim + 4 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float dot = 0.0f;
#pragma unroll
        for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int i = 0; i < 4; ++i) dot = fmaf(x[r][s][half][i], __ldg(km + 32 * s + 16 * half + i), dot);
        info.k_mean_dot[r] = quad_sum(dot);
      }
    }
    return info;
  }

  // quantize() without staging (head_dim 256): the same arithmetic and codes, each row read from
  // global memory (the same 8-byte pieces stage() would copy; rows past the end read as zeros) and
  // finished before the next, its 16-bit values kept packed: 128 floats of two rows at once,
  // with K's means for the LSE beside them, made ptxas spill the item's state.
  __device__ static WgmmaQRows quantize_unstaged(const AttentionWgmmaParams& p, const WgmmaWorkItem& w, int slab_row,
                                                 int t, uint8_t* q_tile, int64_t r0) {
    const T* q_head = static_cast<const T*>(p.q) + w.b * p.q_stride_b + w.h * p.q_stride_h + 4 * t;
    const bool lse_dot = p.lse != nullptr && p.k_mean != nullptr;
    const float* km = lse_dot ? p.k_mean + (static_cast<int64_t>(w.b) * p.kv_heads + w.hk) * kHeadDim + 4 * t : nullptr;
    WgmmaQRows info;
#pragma unroll 1
    for (int r = 0; r < 2; ++r) {
      const int64_t row = w.q0 + r0 + 8 * r;
      uint2 raw[kQkSteps][2];
#pragma unroll
      for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          raw[s][half] = row < query_end(p, w) ? __ldg(reinterpret_cast<const uint2*>(q_head + row * p.q_stride_n + 32 * s + 16 * half))
                                       : make_uint2(0u, 0u);
      const auto value = [&](int s, int half, int i) {
        return widen1<T>(reinterpret_cast<const T*>(&raw[s][half])[i]);
      };
      info.scale[r] = quantize_row(value, slab_row + 8 * r, t, q_tile) * (p.sm_scale * 1.4426950408889634f);
      float dot = 0.0f;
      if (lse_dot) {
#pragma unroll
        for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float4 m4 = __ldg(reinterpret_cast<const float4*>(km + 32 * s + 16 * half));
            dot = fmaf(value(s, half, 0), m4.x, dot);
            dot = fmaf(value(s, half, 1), m4.y, dot);
            dot = fmaf(value(s, half, 2), m4.z, dot);
            dot = fmaf(value(s, half, 3), m4.w, dot);
          }
      }
      info.k_mean_dot[r] = lse_dot ? quad_sum(dot) : 0.0f;
    }
    return info;
  }
};
#endif  // sm_90a

}  // namespace sageattention2
