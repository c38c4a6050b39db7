// The Hopper kernel's online softmax (paper Algorithm 1, in base 2) over one KV tile's scores.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/quant_math.cuh"  // kLog2Fp8Max
#include "hopper/geometry.cuh"
#include "hopper/mask.cuh"

namespace sageattention2 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int kHeadDim, bool kCausal, bool kFp8Pv>
struct WgmmaSoftmax {
  static constexpr int kSRegs = WgmmaGeometry<kHeadDim>::kSRegs;
  // log2 of P's scale: x448 for E4M3 (folded into the exponent); the accurate tier's 16-bit P
  // stays in [0, 1], rounded as the warp-level kernel's and the emulation's (x448 is no power
  // of two: it would move bf16's rounding points).
  static constexpr float kLog2PScale = kFp8Pv ? kLog2Fp8Max : 0.0f;

  // Over one tile's S (int32, rows g and g+8, columns 8i + 2t + {0, 1}), in place:
  // leaves P~ * 2^kLog2PScale (base 2) as floats in x and returns each row's rescale factor. The quad's 4 threads share a row, each with its own
  // K scale (`scale[r]` > 0: row r's Q scale times the thread's K scale), so the thread's row max
  // is taken on the integers and dequantized once.
  // kMasked: the scores `mask` hides (hopper/mask.cuh) count as -inf.
  template <bool kMasked>
  __device__ static void online(float (&x)[kSRegs], const int32_t (&sacc)[kSRegs], const float (&scale)[2],
                                const WgmmaTileMask<kCausal>& mask, int t, float (&m)[2], float (&alpha)[2]) {
    float bias[2];
    if constexpr (kMasked) {
      const int diagonal = mask.diagonal();
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        x[i] = static_cast<float>(sacc[i]) * scale[(i / 2) & 1];
        mask.apply(x[i], i, t, diagonal);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m[r];
#pragma unroll
        for (int i = 0; i < kSRegs / 4; ++i) mx = fmaxf(mx, fmaxf(x[4 * i + 2 * r], x[4 * i + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row that has seen only masked keys keeps max -inf; exp2 against 0 keeps it at 0.
        const float ref = mx == -INFINITY ? 0.0f : mx;
        alpha[r] = ptx::exp2_approx(m[r] - ref);
        m[r] = mx;
        bias[r] = ref - kLog2PScale;
      }
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) x[i] -= bias[(i / 2) & 1];
    } else {
      int32_t imax[2] = {sacc[0], sacc[2]};
#pragma unroll
      for (int i = 0; i < kSRegs / 4; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) imax[r] = max(imax[r], max(sacc[4 * i + 2 * r], sacc[4 * i + 2 * r + 1]));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = fmaxf(m[r], static_cast<float>(imax[r]) * scale[r]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[r] = ptx::exp2_approx(m[r] - mx);
        m[r] = mx;
        bias[r] = mx - kLog2PScale;
      }
      // One FFMA per score: s * scale - bias.
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) x[i] = fmaf(static_cast<float>(sacc[i]), scale[(i / 2) & 1], -bias[(i / 2) & 1]);
    }
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) x[i] = ptx::exp2_approx(x[i]);  // P~ * 448, in [0, 448] (16-bit: [0, 1])
  }
};
#endif  // sm_90a

}  // namespace sageattention2
