// The PV product of the warp-level kernel: O += P V in the input dtype (FP16/BF16 mma.sync, FP32
// accumulation) or with FP8 operands (paper 3.3, 3.4).
#pragma once

#include <cstdint>

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "mma/traits.cuh"

namespace sageattention2 {

template <typename Traits>
struct MmaPv {
  using T = typename Traits::T;
  using Smem = typename Traits::Smem;
  static constexpr int kBlockK = Traits::kBlockK, kSlabs = Traits::kSlabs, kKeyTiles = Traits::kKeyTiles;
  static constexpr int kDimTiles = Traits::kDimTiles, kVChunks = Traits::kVChunks, kPvSteps = Traits::kPvSteps;

  // O += P V in the input dtype (FP32 accumulation). The S fragment of two n8 tiles is the A
  // fragment of m16n8k16, so P goes from registers straight into the MMA.
  __device__ static void accumulate_input(const Smem& s, int stage, int lane, const float (&sc)[kSlabs][kKeyTiles][4],
                                          float (&o)[kSlabs][kDimTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      uint32_t pa[kSlabs][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl) {
        pa[sl][0] = HalfPair<T>::pack(sc[sl][2 * kk][0], sc[sl][2 * kk][1]);
        pa[sl][1] = HalfPair<T>::pack(sc[sl][2 * kk][2], sc[sl][2 * kk][3]);
        pa[sl][2] = HalfPair<T>::pack(sc[sl][2 * kk + 1][0], sc[sl][2 * kk + 1][1]);
        pa[sl][3] = HalfPair<T>::pack(sc[sl][2 * kk + 1][2], sc[sl][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDimTiles / 2; ++dp) {
        uint32_t bv[4];
        const int key = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
        ptx::ldmatrix_x4_trans(bv, s.v(stage) + swizzled_offset<kVChunks>(key, dp * 2 + lane / 16));
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          ptx::mma_m16n8k16_f32<HalfPair<T>::kBf16>(o[sl][2 * dp], pa[sl], bv[0], bv[1]);
          ptx::mma_m16n8k16_f32<HalfPair<T>::kBf16>(o[sl][2 * dp + 1], pa[sl], bv[2], bv[3]);
        }
      }
    }
  }

  // O += P~ V with FP8 operands (paper 3.3, 3.4). With V's keys stored in the order of
  // docs/DESIGN.md#v-layout, the S fragment of n8 tiles 4c .. 4c+3 is, packed to E4M3, the A
  // fragment of k-step c. Each pair of n8 channel tiles gets a fresh accumulator over the tile's
  // kPvSteps k-steps, then folded into O (already rescaled by alpha): the two-level accumulation,
  // which on Ada keeps the FP22 accumulator of the FP8 MMA to 128 products of a row.
  __device__ static void accumulate_fp8(const Smem& s, int stage, int lane, const float (&sc)[kSlabs][kKeyTiles][4],
                                        float (&o)[kSlabs][kDimTiles][4]) {
    uint32_t pa[kSlabs][kPvSteps][4];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int c = 0; c < kPvSteps; ++c)
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
          const int r = reg & 1, n = 4 * c + 2 * (reg >> 1);
          pa[sl][c][reg] = pack_e4m3x4(sc[sl][n][2 * r], sc[sl][n][2 * r + 1], sc[sl][n + 1][2 * r],
                                       sc[sl][n + 1][2 * r + 1]);
        }
#pragma unroll
    for (int dp = 0; dp < kDimTiles / 2; ++dp) {
      float racc[kSlabs][2][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int e = 0; e < 4; ++e) racc[sl][0][e] = racc[sl][1][e] = 0.0f;
#pragma unroll
      for (int c = 0; c < kPvSteps; ++c) {
        // Matrices: channels 16dp + 0..7 and + 8..15, keys 32c + 0..15 and + 16..31.
        uint32_t bv[4];
        const int channel = dp * 16 + (lane % 8) + 8 * (lane / 16);
        ptx::ldmatrix_x4(bv, s.v(stage) + swizzled_offset<kVChunks>(channel, c * 2 + (lane / 8) % 2));
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          ptx::mma_m16n8k32_e4m3(racc[sl][0], pa[sl][c], bv[0], bv[1]);
          ptx::mma_m16n8k32_e4m3(racc[sl][1], pa[sl][c], bv[2], bv[3]);
        }
      }
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[sl][2 * dp][e] += racc[sl][0][e];
          o[sl][2 * dp + 1][e] += racc[sl][1][e];
        }
    }
  }
};

}  // namespace sageattention2
