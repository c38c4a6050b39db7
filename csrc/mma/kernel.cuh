// The warp-level SageAttention2 kernel (paper Algorithm 1) in FlashAttention-2 form: a CTA owns
// 128 queries (8 warps of 16 with FP8 PV, 4 warps of 32 with FP16/BF16 PV), streams tiles of K
// and V (128 or 64 keys) through a cp.async pipeline, computes S = Q K^T with integer mma.sync
// from per-thread quantized codes (Q's quantized by the CTA itself before its loop, K's by
// quantize_kv), dequantizes with one Q scale and one K scale per thread and slab (Fig. 4), adds
// the exact Delta-S of Q smoothing (a compiled variant), runs the online softmax in base 2
// (sm_scale * log2(e) is folded into the Q scales) and accumulates P V in FP32.
//
// Variants are template parameters (mma/params.h): QkCodes INT8 (m16n8k32.s8) or INT4
// (m16n8k64.s4, the 4-bit kernel: same fragments, two channels a byte), and PvOperands in the
// input dtype (m16n8k16, for GPUs without FP8) or FP8 (P~ * 448 and per-channel V in E4M3,
// m16n8k32.e4m3 into a fresh accumulator per tile folded into O: paper 3.3 and 3.4).
//
// This file composes the pieces, each with one job: mma/traits.cuh (tiles, shared memory,
// per-variant choices), item.cuh (which block of which batch item or packed sequence a CTA
// runs, and where its rows and codes are), q_quantizer.cuh (the CTA's Q block to codes),
// kv_loader.cuh (the K/V tile pipeline), qk.cuh (S = Q K^T), softmax.cuh (dequantization and
// online softmax), mask.cuh (which keys a row sees), pv.cuh (O += P V) and epilogue.cuh (O and
// the LSE to global memory).
// The per-tile arrays, O and the state of the softmax and the epilogue are declared here, in the
// order of the single function the kernel was: the order of local arrays decides NVVM's PTX
// register numbering, which ptxas's allocation follows (swapping the softmax's row_max and
// row_sum changed the PTX of 14 of the 18 unit x arch builds), and this way the SASS is the one
// measured before the split.
#pragma once

#include <cstdint>

#include "common/opaque.cuh"
#include "common/ptx.cuh"
#include "mma/epilogue.cuh"
#include "mma/kv_loader.cuh"
#include "mma/mask.cuh"
#include "mma/params.h"
#include "mma/pv.cuh"
#include "mma/q_quantizer.cuh"
#include "mma/qk.cuh"
#include "mma/softmax.cuh"
#include "mma/traits.cuh"

namespace sageattention2 {

// kPacked: the variant that runs packed sequences (mma/item.cuh; INT8 QK without Q smoothing),
// launched only with packed_blocks, which the others never read.
template <typename T, int kHeadDim, bool kCausal, bool kSmoothQ, QkCodes kQk, PvOperands kPv, bool kPacked = false>
struct AttentionMmaKernel {
  using Traits = MmaTraits<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv, kPacked>;
  using Item = typename Traits::Item;
  using Smem = typename Traits::Smem;
  using Loader = MmaKvLoader<Traits>;
  using KvHead = typename Loader::KvHead;
  using Pv = MmaPv<Traits>;
  using Qk = MmaQk<Traits>;
  using Softmax = MmaSoftmax<Traits>;
  using Mask = MmaMask<Traits>;
  using Epilogue = MmaEpilogue<Traits>;
  using QQuantizer = MmaQQuantizer<Traits>;
  static constexpr bool kFp8Pv = Traits::kFp8Pv, kHeadPerTile = Traits::kHeadPerTile;
  static constexpr int kBlockQ = Traits::kBlockQ, kBlockK = Traits::kBlockK, kThreads = Traits::kThreads;
  static constexpr int kRowsPerWarp = Traits::kRowsPerWarp, kSlabs = Traits::kSlabs, kKeyTiles = Traits::kKeyTiles;
  static constexpr int kDimTiles = Traits::kDimTiles, kQkSteps = Traits::kQkSteps;
  static constexpr int kStages = Traits::kStages, kSmemBytes = Traits::kSmemBytes;

  __device__ static void run(const AttentionMmaParams& p, unsigned char* smem_base) {
    const Smem s{smem_base};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // accumulator fragment: rows g, g+8; columns 2t, 2t+1
    // Causal: the heaviest query blocks (most keys) are scheduled first (Item::of).
    const Item item = Item::template of<kCausal>(p);
    const int h = blockIdx.y;
    const int hk = h / (p.q_heads / p.kv_heads);
    const int64_t q0 = static_cast<int64_t>(item.qb) * kBlockQ;  // from the item's first query

    int64_t tiles = (item.kv_len(p) + kBlockK - 1) / kBlockK;
    if constexpr (kCausal) {
      const int64_t last_query = (q0 + kBlockQ < item.q_len(p) ? q0 + kBlockQ : item.q_len(p)) - 1;
      const int64_t needed = last_query / kBlockK + 1;
      tiles = needed < tiles ? needed : tiles;
    }
    const int kv_tiles = static_cast<int>(tiles);  // 32-bit loop counters: registers are short
    const int64_t seq_hk = static_cast<int64_t>(item.seq) * p.kv_heads + hk;
    const int warp_row0 = warp * kRowsPerWarp;
    // One Q scale per thread and slab: its rows g and g+8 of slab j are both in group 8j + g (Eq. 8).
    float q_scale[kSlabs];
    QQuantizer::quantize_block(p, s, item, h, q0, warp_row0, g, t, q_scale);
    const KvHead head = KvHead::of(p, item);
    // Prologue: tiles 0 .. kStages-2 one cp.async group each.
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < kv_tiles) Loader::load_tile(p, s, i, head, static_cast<int64_t>(i) * kBlockK, item);
      ptx::cp_async_commit();
    }

    float o[kSlabs][kDimTiles][4];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[sl][n][e] = 0.0f;
    Softmax softmax;
    softmax.init();

    // The warp's rows that are queries (< q_len): its row j is one iff j < warp_queries.
    const int64_t queries_left = item.q_len(p) - q0 - warp_row0;
    const int warp_queries = static_cast<int>(queries_left < kRowsPerWarp ? queries_left : kRowsPerWarp);
    // The warp's Q fragments (A operands, one per 32 bytes of codes).
    uint32_t qa[kSlabs][kQkSteps][4];
    for (int it = 0; it < kv_tiles; ++it) {
      const int stage = it % kStages;
      const int64_t k0 = static_cast<int64_t>(it) * kBlockK;
      ptx::cp_async_wait<kStages - 2>();  // tile `it` has landed
      __syncthreads();                    // ... for every thread (and, first time round, Q's codes); and
                                          // stage it-1 is free again
      // kHeadPerTile: the tile index passes through opaque(), so the tile's global addresses are
      // computed here from it and the block index rather than carried across the loop as
      // pointers (which spilled at 255 registers).
      const int ahead = kHeadPerTile ? opaque(it + kStages - 1) : it + kStages - 1;
      if (ahead < kv_tiles)
        Loader::load_tile(p, s, ahead % kStages, kHeadPerTile ? KvHead::of(p, item) : head,
                          static_cast<int64_t>(ahead) * kBlockK, item);
      ptx::cp_async_commit();
      // ---- S = Q K^T (INT8 or INT4, exact int32 accumulation) ----
      int32_t acc[kSlabs][kKeyTiles][4];
      Qk::compute(s, stage, lane, warp_row0, it, qa, acc);

      // ---- dequantize (one scale per thread), Delta-S, masks ----
      float qk_scale[kSlabs];
      Softmax::scales(s, stage, t, q_scale, qk_scale);
      const bool needs_mask = Mask::needed(p, item, k0, q0, warp_row0);
      float sc[kSlabs][kKeyTiles][4];
      Softmax::dequantize(s, stage, t, qk_scale, acc, sc);
      if (needs_mask) Mask::apply(p, item, k0, q0, warp_row0, g, t, sc);

      // ---- online softmax ----
      float tile_max[kSlabs][2];
      softmax.update(g, warp_queries, qk_scale, sc, tile_max, o);

      if constexpr (kFp8Pv) Pv::accumulate_fp8(s, stage, lane, sc, o);
      else Pv::accumulate_input(s, stage, lane, sc, o);
    }

    // ---- epilogue: normalise (FP8: times V's channel scale, plus its mean), write O (and the
    // natural-log LSE) ----
    Epilogue epilogue;
    epilogue.store(p, s, item, h, seq_hk, q0, warp_row0, g, t, o, softmax);
  }
};

// Archs before sm_89 have no FP8 MMA: their code for the FP8 variants is a stub (the launch
// refuses them there, see mma/launch.cuh).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
inline constexpr bool kCompilingFp8Mma = false;
#else
inline constexpr bool kCompilingFp8Mma = true;
#endif

// INT8 + FP16 PV (4 warps of 128 threads, 91 KB at head_dim 128) runs two CTAs per SM: at most
// 255 registers per thread, no cap in practice. The FP8 variants run where they are native, Ada,
// whose 100 KB SM holds one CTA of INT8 + FP8 at either head_dim anyway: they take the
// registers they need.
template <PvOperands kPv>
inline constexpr int kMmaMinBlocksPerSm = kPv == PvOperands::kInput ? 2 : 1;

template <typename T, int kHeadDim, bool kCausal, bool kSmoothQ, QkCodes kQk, PvOperands kPv, bool kPacked = false>
__global__ void __launch_bounds__(AttentionMmaKernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv, kPacked>::kThreads,
                                  kMmaMinBlocksPerSm<kPv>) attention_mma_kernel(const __grid_constant__ AttentionMmaParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  if constexpr (kPv == PvOperands::kFp8 && !kCompilingFp8Mma) {
    __trap();
  } else {
    // The INT4 guard's two launches (INT4 QK and INT8 QK, both with FP8 PV) each skip the other's
    // heads (mma/params.h). Only the FP8 variants check: in the others the test moved ptxas's
    // allocation (sm_89, INT8 + BF16 PV at head_dim 128: 8 more bytes of stack).
    if constexpr (kPv == PvOperands::kFp8) {
      if (p.int8_heads != nullptr &&
          p.int8_heads[static_cast<int>(blockIdx.z) * p.kv_heads +
                       static_cast<int>(blockIdx.y) / (p.q_heads / p.kv_heads)] != p.int8_heads_run)
        return;
    }
    AttentionMmaKernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv, kPacked>::run(p, smem);
  }
}

}  // namespace sageattention2
