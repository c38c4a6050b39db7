// The online softmax of the warp-level kernel (paper Algorithm 1, in base 2) over one KV tile's
// scores: dequantized with one Q scale and one K scale per thread and slab (Fig. 4), plus the
// exact Delta-S of Q smoothing (a compiled variant); the running max and sum of the thread's rows
// are this object's state. sm_scale * log2(e) is folded into the Q scales; with FP8 PV, the x448
// of P's E4M3 scale joins the exponent: P~ * 448 in [0, 448] comes out of exp2 directly (and so
// does its row sum).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "common/quant_math.cuh"  // kLog2Fp8Max
#include "mma/params.h"
#include "mma/traits.cuh"

namespace sageattention2 {

// int32 -> float32 for |x| < 2^22, exactly, without I2F: 2^23 + 2^22 + x has x in its low
// mantissa bits. An INT8 dot product over at most 256 channels is below 127^2 * 256 < 2^22.
// I2F issues at a quarter of the FMA rate on the unit that also runs ex2 (ncu: the kernel was
// issue-bound), so this moves 32 conversions per thread and tile to the integer and FMA pipes.
inline constexpr int32_t kSmallIntMagic = 0x4B400000;  // the bits of 1.5 * 2^23
inline constexpr float kSmallIntOffset = 12582912.0f;   // 1.5 * 2^23
// The float 1.5 * 2^23 + x, exactly (the first step of small_int_to_float). Floats of this form
// order as their x do.
__device__ __forceinline__ float small_int_plus_offset(int32_t x) { return __int_as_float(x + kSmallIntMagic); }
__device__ __forceinline__ float small_int_to_float(int32_t x) { return small_int_plus_offset(x) - kSmallIntOffset; }

template <typename Traits>
struct MmaSoftmax {
  using Smem = typename Traits::Smem;
  static constexpr int kSlabs = Traits::kSlabs, kKeyTiles = Traits::kKeyTiles, kDimTiles = Traits::kDimTiles;
  static constexpr bool kFp8Pv = Traits::kFp8Pv, kSmoothQ = Traits::kSmoothQ;
  static constexpr bool kFoldedExponent = Traits::kFoldedExponent;
  static constexpr float kMinFoldedScale = Traits::kMinFoldedScale;

  // Per slab, the thread's rows g and g + 8: the running sum (lane-partial, reduced in the
  // epilogue) and max (base 2). In this order, the single function's PTX (mma/kernel.cuh says why).
  float row_sum[kSlabs][2], row_max[kSlabs][2];

  __device__ void init() {
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) row_max[sl][r] = -INFINITY, row_sum[sl][r] = 0.0f;
  }

  // Dequantization (one scale per thread, Delta-S) and the scales. Keys 2t and 2t + 1 of every 8
  // are K group t (Eq. 8), so one K scale per thread too.
  // kFoldedExponent: each score stays f = 1.5 * 2^23 + x (x its integer dot product) until
  // its exponent, which is then one FFMA, f * s - (1.5 * 2^23 * s + m) = x * s - m rounded
  // once, where dequantizing and then subtracting the row max m took FADD, FMUL, FADD (two
  // instructions per score fewer: a tenth of the loop's). A thread takes its max on its f
  // (they order as x does). The constant is exact: s keeps 20 significant bits (a relative
  // change below 1e-6), so 1.5 * 2^23 * s has at most 22, and m is an integer (the row max
  // rounded up), both on the grid of their sum while s < 0.67 (|q| and |k| of ~250 at
  // head_dim 64); above, the constant's rounding moves an exponent by at most a third of a
  // unit of s, far below the quantization error. With FP8 P~ or Delta-S, scores are
  // dequantized first.

  // The thread's scale of each slab, from its Q scales and the tile's K scale.
  __device__ static void scales(const Smem& s, int stage, int t, const float (&q_scale)[kSlabs],
                                float (&qk_scale)[kSlabs]) {
    const float k_scale = s.k_scale(stage)[t];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl) {
      if constexpr (kFoldedExponent)  // (an all-zero group's scale 0 would give -inf * 0 for masked keys)
        qk_scale[sl] = fmaxf(__uint_as_float(__float_as_uint(q_scale[sl] * k_scale) & 0xFFFFFFF0u), kMinFoldedScale);
      else
        qk_scale[sl] = q_scale[sl] * k_scale;
    }
  }

  // The tile's scores from the integer products acc (in the folded form with kFoldedExponent).
  __device__ static void dequantize(const Smem& s, int stage, int t, const float (&qk_scale)[kSlabs],
                                    const int32_t (&acc)[kSlabs][kKeyTiles][4], float (&sc)[kSlabs][kKeyTiles][4]) {
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      const float2 ds = kSmoothQ ? *reinterpret_cast<const float2*>(s.delta(stage) + n * 8 + 2 * t)
                                  : make_float2(0.0f, 0.0f);
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sc[sl][n][e] = kFoldedExponent ? small_int_plus_offset(acc[sl][n][e])
                                         : small_int_to_float(acc[sl][n][e]) * qk_scale[sl] + ((e & 1) ? ds.y : ds.x);
    }
  }

  // The tile's exponentials P~ (times 448 with FP8 PV) in place of its scores, its row maxima in
  // tile_max, the running max moved (and O and the sums rescaled) where needed, the row sums
  // updated. warp_queries: the warp's rows that are queries.
  __device__ void update(int g, int warp_queries, const float (&qk_scale)[kSlabs], float (&sc)[kSlabs][kKeyTiles][4],
                         float (&tile_max)[kSlabs][2], float (&o)[kSlabs][kDimTiles][4]) {
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) mx = fmaxf(mx, fmaxf(sc[sl][n][2 * r], sc[sl][n][2 * r + 1]));
        // Folded: dequantized before the quad's reduction, since its threads' K scales differ
        // (K groups 2t, 2t + 1 of every 8 keys).
        if constexpr (kFoldedExponent) mx = (mx - kSmallIntOffset) * qk_scale[sl];  // -inf stays -inf
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        tile_max[sl][r] = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      }
    // FP16/BF16 PV: the running max moves, and O and l are rescaled, only when a tile's max
    // passes it by more than 2^kMmaLazyRescaleLog2 in some row of the warp (rows past q_len do
    // not count, so the emulation can follow). P~ then stays below 256, far inside both types'
    // range, whose relative rounding does not depend on the magnitude. Past the first tiles a
    // rescale is rare, and a tile skips kSlabs * 2 * kDimTiles * 2 FMULs on O (H100: +4-8 % at
    // head_dim 128, +1-4 % at 64; docs/DECISIONS.md#d22). FP8 P~ * 448 must stay within E4M3's
    // 448: exact max there.
    bool rescale = true;
    if constexpr (!kFp8Pv) {
      bool grows = false;
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          grows |= sl * 16 + 8 * r + g < warp_queries && tile_max[sl][r] > row_max[sl][r] + kMmaLazyRescaleLog2;
      rescale = __any_sync(0xffffffffu, grows);
    }
    if (rescale) {
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float mx = kFoldedExponent ? ceilf(fmaxf(row_max[sl][r], tile_max[sl][r]))
                                           : fmaxf(row_max[sl][r], tile_max[sl][r]);
          // A row that has seen only masked keys keeps max -inf; exp2 against 0 keeps it at 0.
          const float alpha = ptx::exp2_approx(row_max[sl][r] - (mx == -INFINITY ? 0.0f : mx));
          row_max[sl][r] = mx;
          row_sum[sl][r] *= alpha;
#pragma unroll
          for (int n = 0; n < kDimTiles; ++n) {
            o[sl][n][2 * r] *= alpha;
            o[sl][n][2 * r + 1] *= alpha;
          }
        }
    }
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float ref = row_max[sl][r] == -INFINITY ? 0.0f : row_max[sl][r];
        const float bias = kFp8Pv ? ref - kLog2Fp8Max : ref;
        const float shift = kFoldedExponent ? fmaf(-kSmallIntOffset, qk_scale[sl], -bias) : 0.0f;
        const auto exponent = [&](float x) { return kFoldedExponent ? fmaf(x, qk_scale[sl], shift) : x - bias; };
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          sc[sl][n][2 * r] = ptx::exp2_approx(exponent(sc[sl][n][2 * r]));
          sc[sl][n][2 * r + 1] = ptx::exp2_approx(exponent(sc[sl][n][2 * r + 1]));
          sum += sc[sl][n][2 * r] + sc[sl][n][2 * r + 1];
        }
        row_sum[sl][r] += sum;  // lane-partial; reduced at the end
      }
  }
};

}  // namespace sageattention2
