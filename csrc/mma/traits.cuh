// Tiles, shared memory and code-generation choices of the warp-level kernel (mma/kernel.cuh) for
// one variant: what its pieces are sized by.
#pragma once

#include <cstdint>

#include "mma/item.cuh"
#include "mma/params.h"

namespace sageattention2 {

// Shared-memory tiles are rows of 16-byte chunks; ldmatrix reads 8 rows of one chunk column at
// once, so the chunk index is XOR-ed with the row to put those 8 rows in 8 different bank
// groups (rows of 4 chunks share a 128-byte line two by two, hence the shift).
// Rows of 2 chunks (INT4 codes at head_dim 64) share a line four by four.
template <int kChunksPerRow>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  static_assert(kChunksPerRow == 2 || kChunksPerRow == 4 || kChunksPerRow % 8 == 0,
                "rows of 32 or 64 bytes or multiples of 128");
  const int mixed = kChunksPerRow >= 8   ? chunk ^ (row & 7)
                    : kChunksPerRow == 4 ? chunk ^ ((row >> 1) & 3)
                                         : chunk ^ ((row >> 2) & 1);
  return row * kChunksPerRow * 16 + mixed * 16;
}

// The variant's template parameters and everything derived from them.
template <typename T_, int kHeadDim_, bool kCausal_, bool kSmoothQ_, QkCodes kQk_, PvOperands kPv_,
          bool kPacked_ = false>
struct MmaTraits {
  using T = T_;
  // kPacked: the variant that runs packed sequences (mma/item.cuh), INT8 QK without Q smoothing.
  static constexpr bool kPacked = kPacked_;
  using Item = MmaItem<kPacked>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kCausal = kCausal_, kSmoothQ = kSmoothQ_;
  static constexpr QkCodes kQk = kQk_;
  static constexpr PvOperands kPv = kPv_;
  static constexpr bool kFp8Pv = kPv == PvOperands::kFp8;
  // The dequantization folded into the exponent (mma/softmax.cuh says how): for P~ in the input
  // dtype without Delta-S (sageattn's INT8 default on sm_80/sm_90), whose lazy running max
  // already lets P~ exceed 1 (up to 256), so the max may be rounded up to an integer. At head_dim
  // 64 only: +4-7 % there on the H100; at 128, whose loop runs at 255 registers, it measured
  // within 1 % and kept a value in local memory (docs/DECISIONS.md#d23).
  static constexpr bool kFoldedExponent = !kFp8Pv && !kSmoothQ && kHeadDim == 64;
  // The folded exponent's least scale: only all-zero Q or K groups (codes 0) have a smaller one
  // (0); fp16/bf16 inputs give at least ~1e-20. A power of two, so 1.5 * 2^23 * s stays exact.
  static constexpr float kMinFoldedScale = 0x1p-100f;
  static constexpr int kBlockQ = kMmaBlockQ;
  // Execution geometry. The FP8 variants (Ada's fast path, registers tight): 8 warps of one
  // 16-row MMA slab, 128-key tiles. INT8 + FP16 PV: 4 warps of two slabs and 64-key tiles, as
  // FlashAttention-2: every K/V fragment a warp reads from shared memory feeds both slabs'
  // MMAs, which halves the shared-memory traffic per MMA (8 warps of one slab read 384 KB per
  // 128 x 128 tile, more than half the tile's time at 365 TOPS on the H100), and the CTA fits
  // in 91 KB, so two run per SM (and one on a 99 KB Ada/Ampere SM). The per-thread groups are
  // the same either way: Q groups of 16-row slabs (reference.quantize_q_reference(warps=kMmaWarps)), K groups of
  // kMmaBlockK-key blocks, of which a 64-key tile is half (its keys 8i + 2t + {0,1} are still
  // group t).
  static constexpr int kWarps = kFp8Pv ? kMmaWarps : kMmaInputPvWarps;
  static constexpr int kBlockK = kFp8Pv ? kMmaBlockK : kMmaInputPvTileK;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockQ / kWarps;  // 16 or 32: one or two MMA slabs
  static constexpr int kSlabs = kRowsPerWarp / 16;
  static constexpr int kKeyTiles = kBlockK / 8;          // n8 tiles of S per KV tile
  static constexpr int kDimTiles = kHeadDim / 8;         // n8 tiles of O
  // A QK k-step reads 32 bytes of a code row: 32 INT8 or 64 INT4 channels.
  static constexpr int kQkRowBytes = kQk == QkCodes::kInt8 ? kHeadDim : kHeadDim / 2;
  static constexpr int kQkSteps = kQkRowBytes / 32;
  static constexpr int kQkChunks = kQkRowBytes / 16;     // 16-byte chunks of a code row
  // The V tile: kBlockK key rows of D input-dtype values, or (FP8, transposed by quantize_kv) D
  // channel rows of kBlockK E4M3 keys, the K-major B operand of the FP8 MMA.
  static constexpr int kVRows = kFp8Pv ? kHeadDim : kBlockK;
  static constexpr int kVRowBytes = kFp8Pv ? kBlockK : kHeadDim * 2;
  static constexpr int kVChunks = kVRowBytes / 16;
  static constexpr int kPvSteps = kBlockK / 32;          // k-steps of the FP8 PV MMA per tile
  static_assert(kMmaBlockQ % kWarps == 0 && kMmaBlockK % kBlockK == 0 && kBlockK % 32 == 0, "geometry");
  static constexpr int kQBytes = kBlockQ * kQkRowBytes;
  static constexpr int kRowConstantBytes = kBlockQ * 4;  // q . k_mean per query (LSE only)
  static constexpr int kKBytes = kBlockK * kQkRowBytes;
  static constexpr int kVBytes = kVRows * kVRowBytes;
  static constexpr int kDeltaBytes = kBlockK * 4;
  static constexpr int kKScaleBytes = 16;  // the 4 K group scales of the tile
  static constexpr int kStageBytes = kKBytes + kVBytes + kDeltaBytes + kKScaleBytes;
  // Three stages: a K/V tile is requested two tiles ahead of its use. The FP8 variants must fit
  // the 99 KB a block may have on Ada (sm_89), where they are the fast path: INT8 + FP8 at
  // head_dim 128 takes 81 KB with two stages (114 KB with three). INT8 + FP16 at head_dim 128
  // takes 91 KB (64-key tiles): two CTAs per SM on sm_80/sm_90, one on sm_86/sm_89.
  static constexpr int kStages = kFp8Pv && kQk == QkCodes::kInt8 && kHeadDim == 128 ? 2 : 3;
  static constexpr int kSmemBytes = kQBytes + kRowConstantBytes + kStages * kStageBytes;
  // Q's fragments stay in registers for the whole KV loop (INT8 + FP16 PV at head_dim 64) or are
  // re-read from shared memory every tile (head_dim 128, and FP8 PV: 16 or 32 registers fewer,
  // which there is the difference between spilling and not).
  static constexpr bool kResidentQ = !kFp8Pv && kHeadDim == 64;
  static constexpr bool kHeadPerTile = !kFp8Pv && kHeadDim == 128;
  static_assert(!kFp8Pv || kSmemBytes <= 99 * 1024, "the FP8 variants must fit an Ada SM");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(127 * 127 * kHeadDim < (1 << 22), "small_int_to_float needs |QK int32| < 2^22");
  static_assert(kQk == QkCodes::kInt8 || kFp8Pv, "INT4 QK is built with FP8 PV only (the 4-bit kernel)");
  static_assert(!kPacked || (kQk == QkCodes::kInt8 && !kSmoothQ), "packed sequences: INT8 QK, no Q smoothing");

  // Shared memory: the Q codes, the row constants of the LSE, then kStages pipeline stages of
  // {K codes, V, Delta-S}. Stage addresses are computed, not indexed from an array, so nothing
  // lands in local memory.
  struct Smem {
    unsigned char* base;
    __device__ unsigned char* q() const { return base; }
    __device__ float* row_constant() const { return reinterpret_cast<float*>(base + kQBytes); }
    __device__ unsigned char* stage(int i) const { return base + kQBytes + kRowConstantBytes + i * kStageBytes; }
    __device__ unsigned char* k(int i) const { return stage(i); }
    __device__ unsigned char* v(int i) const { return stage(i) + kKBytes; }
    __device__ float* delta(int i) const { return reinterpret_cast<float*>(stage(i) + kKBytes + kVBytes); }
    __device__ float* k_scale(int i) const { return delta(i) + kBlockK; }
  };
};

}  // namespace sageattention2
