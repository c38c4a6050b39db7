// The QK product of the warp-level kernel: S = Q K^T of one KV tile from per-thread INT8 or INT4
// codes (mma.sync m16n8k32.s8 or m16n8k64.s4, exact int32 accumulation).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "mma/params.h"
#include "mma/traits.cuh"

namespace sageattention2 {

template <typename Traits>
struct MmaQk {
  using Smem = typename Traits::Smem;
  static constexpr int kSlabs = Traits::kSlabs, kKeyTiles = Traits::kKeyTiles, kQkSteps = Traits::kQkSteps;
  static constexpr int kQkChunks = Traits::kQkChunks;
  static constexpr bool kResidentQ = Traits::kResidentQ;
  static constexpr QkCodes kQk = Traits::kQk;

  // The warp's scores of tile `it` (in stage `stage`) into acc. The warp's Q fragments qa are read
  // from shared memory at every tile, or at tile 0 only where they stay in registers (kResidentQ).
  __device__ static void compute(const Smem& s, int stage, int lane, int warp_row0, int it,
                                 uint32_t (&qa)[kSlabs][kQkSteps][4], int32_t (&acc)[kSlabs][kKeyTiles][4]) {
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[sl][n][e] = 0;
#pragma unroll
    for (int kc = 0; kc < kQkSteps; ++kc) {
      if (!kResidentQ || it == 0) {
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          const int row = warp_row0 + sl * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
          ptx::ldmatrix_x4(qa[sl][kc], s.q() + swizzled_offset<kQkChunks>(row, kc * 2 + lane / 16));
        }
      }
#pragma unroll
      for (int np = 0; np < kKeyTiles / 2; ++np) {
        uint32_t bk[4];
        const int key = np * 16 + (lane % 8) + 8 * (lane / 16);
        ptx::ldmatrix_x4(bk, s.k(stage) + swizzled_offset<kQkChunks>(key, kc * 2 + (lane / 8) % 2));
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          if constexpr (kQk == QkCodes::kInt8) {
            ptx::mma_m16n8k32_s8(acc[sl][2 * np], qa[sl][kc], bk[0], bk[1]);
            ptx::mma_m16n8k32_s8(acc[sl][2 * np + 1], qa[sl][kc], bk[2], bk[3]);
          } else {
            ptx::mma_m16n8k64_s4(acc[sl][2 * np], qa[sl][kc], bk[0], bk[1]);
            ptx::mma_m16n8k64_s4(acc[sl][2 * np + 1], qa[sl][kc], bk[2], bk[3]);
          }
        }
      }
    }
  }
};

}  // namespace sageattention2
