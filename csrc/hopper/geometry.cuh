// Tiles, shared memory and per-thread register arrays of the Hopper kernel (hopper/kernel.cuh)
// for one head_dim: what every piece of the kernel is sized by.
#pragma once

#include <cuda_runtime.h>  // uint2

#include <cstdint>

#include "hopper/params.h"

namespace sageattention2 {

template <int kHeadDim>
struct WgmmaGeometry {
  static constexpr int kBlockQ = kWgmmaBlockQ, kBlockK = kWgmmaBlockK;
  static constexpr int kConsumers = 2;                      // warpgroups of 64 queries
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = kHeadDim == 64 ? 6 : 4;
  static constexpr int kKBytes = kBlockK * kHeadDim;        // INT8 K tile, rows of head_dim bytes
  static constexpr int kVBytes = kHeadDim * kBlockK;        // E4M3 V^T tile, rows of 128 keys
  static constexpr int kQkSteps = kHeadDim / 32;            // k-steps of the s8 wgmma
  static constexpr int kPvSteps = kBlockK / 32;             // k-steps of the e4m3 wgmma
  static constexpr int kSRegs = kBlockK / 2;                // S accumulators per thread (m64n128)
  static constexpr int kORegs = kHeadDim / 2;               // O accumulators per thread
  // The PV product has 8 columns more than V's channels: V's smem tile is followed by 8 rows of
  // E4M3 ones, so the tensor cores also sum each row of the FP8 P~ (the softmax denominator, over
  // exactly the values the numerator used) and the softmax loses 64 FADDs per tile and thread
  // (kernel +2-11 % over the twelve speed shapes; docs/DECISIONS.md#d7).
  static constexpr int kPvN = kHeadDim + 8;
  static constexpr int kRaccRegs = kPvN / 2;                // PV accumulators per thread
  static constexpr int kVStageBytes = kVBytes + 8 * kBlockK;  // the V^T tile, then 8 rows of ones
  static constexpr int kQChunks = 4 * kQkSteps;             // 8-byte pieces of a thread's 2 Q rows
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");

  struct alignas(1024) Smem {
    uint8_t q[kConsumers][64 * kHeadDim];  // each warpgroup's INT8 Q codes, K-major, swizzled
    uint2 q_stage[kConsumers * 4][kQChunks][32];  // fp16/bf16 Q of the next item: per warp, per
                                                  // chunk, per lane (each thread reads its own)
    uint8_t k[kStages][kKBytes];           // every tile 1024-aligned: the swizzle pattern's period
    uint8_t v[kStages][kVStageBytes];      // V^T as the copy engine lands it, then the ones rows
    float k_scale[kStages][4];             // the tile's 4 K group scales travel with it
    uint64_t full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;  // + alignment slack
};

}  // namespace sageattention2
