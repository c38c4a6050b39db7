// Tiles, shared memory and per-thread register arrays of the Hopper kernel (hopper/kernel.cuh)
// for one head_dim: what every piece of the kernel is sized by.
#pragma once

#include <cuda_runtime.h>  // uint2

#include <cstdint>

#include "hopper/params.h"

namespace sageattention2 {

// kFp8Pv: P~ and V in E4M3 (paper 3.3, the default tier); else P and V in the input dtype (the
// accurate tier, issue 36), V read from the caller's tensor as it is.
//
// head_dim 256 (FP8 PV only) is the same kernel with three differences, each forced by a limit of
// the hardware: INT8 Q and K rows of 256 bytes are two K-major tiles of 128-byte rows (a swizzle
// span is at most 128 bytes), read by the QK k-steps 0-3 and 4-7; the PV product runs in four
// quarters of V's channels, 64, 64, 64 and 64 + the 8 ones columns (wgmma's N is at most 256,
// and beside O's 128 registers a second accumulator of 132 would not fit in 240, nor one of 68
// with what the loop keeps besides without ptxas spilling); and the ring has two
// stages of 65 KB with no shared-memory staging of the next item's Q (its 64 KB would not fit
// in the 227 KB a CTA may have; the quantizer reads Q from global memory instead).
template <int kHeadDim, bool kFp8Pv = true>
struct WgmmaGeometry {
  static constexpr int kBlockQ = kWgmmaBlockQ, kBlockK = kWgmmaBlockK;
  static constexpr int kConsumers = 2;                      // warpgroups of 64 queries
  static constexpr int kThreads = 128 * (kConsumers + 1);
  // A 16-bit V tile is twice an E4M3 one: at head_dim 128 four stages of K and V would take
  // 240 KB of the 227 KB a CTA may have, three take 192 KB.
  static constexpr int kStages = kHeadDim == 64 ? 6 : kHeadDim == 256 ? 2 : kFp8Pv ? 4 : 3;
  // K-major INT8 rows in shared memory: one swizzle span (64 or 128 bytes); a 256-byte row is
  // split into kRowSpans tiles of 128-byte rows (rows x 128 bytes each), one after the other.
  static constexpr int kSpanRowBytes = kHeadDim < 128 ? kHeadDim : 128;
  static constexpr int kRowSpans = kHeadDim / kSpanRowBytes;
  static constexpr bool kStageQ = kHeadDim <= 128;          // the next item's Q staged in shared memory
  static constexpr int kPvChunks = kHeadDim == 256 ? 4 : 1; // PV products per tile (channel ranges)
  static constexpr int kKBytes = kBlockK * kHeadDim;        // INT8 K tile, rows of head_dim bytes
  // E4M3 V^T tile, rows of 128 keys; or the caller's 16-bit V, in chunks of 64 channels x 128
  // keys (rows of 128 bytes, one 128-byte swizzle span: the MN-major operand of the PV wgmma).
  static constexpr int kVBytes = kFp8Pv ? kHeadDim * kBlockK : 2 * kBlockK * kHeadDim;
  static constexpr int kVChunkBytes = 2 * kBlockK * 64;     // (16-bit V) one chunk of 64 channels
  static constexpr int kQkSteps = kHeadDim / 32;            // k-steps of the s8 wgmma
  static constexpr int kPvSteps = kFp8Pv ? kBlockK / 32 : kBlockK / 16;  // k-steps of the e4m3 / f16 wgmma
  static constexpr int kSRegs = kBlockK / 2;                // S accumulators per thread (m64n128)
  static constexpr int kORegs = kHeadDim / 2;               // O accumulators per thread
  // The FP8 PV product has 8 columns more than V's channels: V's smem tile is followed by 8 rows
  // of E4M3 ones, so the tensor cores also sum each row of the FP8 P~ (the softmax denominator,
  // over exactly the values the numerator used) and the softmax loses 64 FADDs per tile and
  // thread (kernel +2-11 % over the twelve speed shapes; docs/DECISIONS.md#d7). The 16-bit PV
  // accumulates into O itself (its FP32 accumulator is exact, no per-tile products to fold) and
  // the softmax sums P: ones after an MN-major V would be a whole 16 KB chunk per stage.
  static constexpr int kPvN = kFp8Pv ? kHeadDim + 8 : kHeadDim;
  static constexpr int kRaccRegs = kFp8Pv ? (kHeadDim / kPvChunks + 8) / 2 : kPvN / 2;  // PV accumulators per thread (one chunk)
  static constexpr int kVStageBytes = kFp8Pv ? kVBytes + 8 * kBlockK : kVBytes;  // (FP8) then 8 rows of ones
  static constexpr int kQChunks = 4 * kQkSteps;             // 8-byte pieces of a thread's 2 Q rows
  static constexpr int kQSlots = kStageQ ? kQChunks : 1;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || (kHeadDim == 256 && kFp8Pv),
                "head_dim 64 or 128; 256 with FP8 PV");

  struct alignas(1024) Smem {
    uint8_t q[kConsumers][64 * kHeadDim];  // each warpgroup's INT8 Q codes, K-major, swizzled
    uint2 q_stage[kStageQ ? kConsumers * 4 : 1][kQSlots][32];  // fp16/bf16 Q of the next item: per
                                                  // warp, per chunk, per lane (each thread reads its own)
    uint8_t k[kStages][kKBytes];           // every tile 1024-aligned: the swizzle pattern's period
    uint8_t v[kStages][kVStageBytes];      // V as the copy engine lands it (FP8: V^T, then the ones rows)
    float k_scale[kStages][4];             // the tile's 4 K group scales travel with it
    uint64_t full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;  // + alignment slack
};

}  // namespace sageattention2
