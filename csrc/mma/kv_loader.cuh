// The load side of the warp-level kernel's KV pipeline: K codes, V, Delta-S and the K scales of
// one tile into a shared-memory stage by cp.async, kStages - 1 tiles ahead of their use.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "mma/params.h"
#include "mma/traits.cuh"

namespace sageattention2 {

template <typename Traits>
struct MmaKvLoader {
  using T = typename Traits::T;
  using Smem = typename Traits::Smem;
  using Item = typename Traits::Item;
  static constexpr int kHeadDim = Traits::kHeadDim, kThreads = Traits::kThreads, kBlockK = Traits::kBlockK;
  static constexpr int kQkRowBytes = Traits::kQkRowBytes, kQkChunks = Traits::kQkChunks;
  static constexpr int kVRows = Traits::kVRows, kVRowBytes = Traits::kVRowBytes, kVChunks = Traits::kVChunks;
  static constexpr bool kFp8Pv = Traits::kFp8Pv, kSmoothQ = Traits::kSmoothQ;

  // One KV tile into one pipeline stage. Keys past kv_len read nothing and land as zeros (the
  // K codes and Delta-S are padded by quantize_kv; V is the caller's unpadded tensor).
  //
  // With kThreads a multiple of a row's chunk count, a thread copies one fixed chunk column of
  // rows r, r + step, r + 2*step, ... with step a multiple of 8 (so the swizzle, which only sees
  // row & 7, (row >> 1) & 3 or (row >> 2) & 1, is the same for all of them): its addresses are
  // affine in the unrolled index. Written as a generic strided loop, the address arithmetic of
  // these copies was most of the kernel's integer work (SASS: ~400 instructions per tile, ncu:
  // ALU the top pipe).
  template <int kChunks, int kRows>
  struct TileCopy {
    static constexpr int kRowStep = kThreads / kChunks;
    static constexpr int kPasses = kRows / kRowStep;
    static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0, "copy geometry");
    __device__ static int row() { return threadIdx.x / kChunks; }
    __device__ static int chunk() { return threadIdx.x % kChunks; }
    __device__ static int smem_offset() { return swizzled_offset<kChunks>(row(), chunk()); }
  };
  using KCopy = TileCopy<kQkChunks, kBlockK>;
  using VCopy = TileCopy<kVChunks, kVRows>;

  // Per-(item, head) base pointers of everything a KV tile reads, held through the KV loop, or
  // derived from the block index again at every tile where their 8 registers would spill
  // (kHeadPerTile: INT8 + FP16 PV at head_dim 128, whose loop runs at 255 registers; at head_dim
  // 64 holding them measured 8-12 % faster on the H100, docs/DECISIONS.md#d22).
  struct KvHead {
    const int8_t* k;
    const float* k_scale;
    const void* v;       // the head's V rows (kInput) or its transposed E4M3 V (kFp8)
    const float* delta;  // kSmoothQ only

    // (Packed: the item's codes from its code row of its head's slab, its V from its first key.)
    __device__ static KvHead of(const AttentionMmaParams& p, const Item& item) {
      const int h = blockIdx.y, b = item.b;
      const int hk = h / (p.q_heads / p.kv_heads);
      const int64_t bhk = static_cast<int64_t>(b) * p.kv_heads + hk;
      KvHead head;
      head.k = p.k_codes + (bhk * p.k_padded + item.code_row) * kQkRowBytes;
      head.k_scale = p.k_scale + (bhk * (p.k_padded / kMmaBlockK) + item.code_row / kMmaBlockK) * 4;
      head.v = kFp8Pv ? static_cast<const void*>(static_cast<const uint8_t*>(p.v) + bhk * kHeadDim * p.k_padded +
                                                 item.code_row)
                      : static_cast<const void*>(static_cast<const T*>(p.v) + b * p.v_stride_b + hk * p.v_stride_h +
                                                 item.k_first * p.v_stride_n);
      head.delta = kSmoothQ ? p.delta_s + (static_cast<int64_t>(b) * p.q_heads + h) * p.k_padded : nullptr;
      return head;
    }
  };

  __device__ static void load_tile(const AttentionMmaParams& p, const Smem& s, int stage, const KvHead& head,
                                   int64_t k0, const Item& item) {
    const int8_t* kg = head.k + (k0 + KCopy::row()) * kQkRowBytes + KCopy::chunk() * 16;
    unsigned char* ks = s.k(stage) + KCopy::smem_offset();
#pragma unroll
    for (int j = 0; j < KCopy::kPasses; ++j)
      ptx::cp_async_16(ks + j * KCopy::kRowStep * kQkRowBytes, kg + j * KCopy::kRowStep * kQkRowBytes, true);

    unsigned char* vs = s.v(stage) + VCopy::smem_offset();
    if constexpr (kFp8Pv) {
      // Channel rows of k_padded keys, zero-padded by quantize_kv: no tail to mask.
      const uint8_t* vg = static_cast<const uint8_t*>(head.v) + VCopy::row() * p.k_padded + k0 + VCopy::chunk() * 16;
#pragma unroll
      for (int j = 0; j < VCopy::kPasses; ++j)
        ptx::cp_async_16(vs + j * VCopy::kRowStep * kVRowBytes, vg + j * VCopy::kRowStep * p.k_padded, true);
    } else {
      const T* v_head = static_cast<const T*>(head.v);
      const int64_t v_row = k0 + VCopy::row();
      const T* vg = v_head + v_row * p.v_stride_n + VCopy::chunk() * 8;
#pragma unroll
      for (int j = 0; j < VCopy::kPasses; ++j) {
        const bool valid = v_row + j * VCopy::kRowStep < item.kv_len(p);
        ptx::cp_async_16(vs + j * VCopy::kRowStep * kVRowBytes,
                         valid ? vg + j * VCopy::kRowStep * p.v_stride_n : v_head, valid);
      }
    }
    // The tile's K scales travel with it: read from global memory between the QK MMAs and the
    // softmax, their latency stalled every warp once per tile.
    if (threadIdx.x == kThreads - 1) ptx::cp_async_16(s.k_scale(stage), head.k_scale + k0 / kMmaBlockK * 4, true);
    if (kSmoothQ && threadIdx.x < kBlockK / 4)
      ptx::cp_async_16(s.delta(stage) + threadIdx.x * 4, head.delta + k0 + threadIdx.x * 4, true);
  }
};

}  // namespace sageattention2
