// The bit-level quantizer arithmetic of docs/DESIGN.md#quantizer-arithmetic, shared by host and
// device code.
//
// Host-callable so GoogleTest checks it against hand-made values; the reference in
// sageattention2/reference.py follows the same steps in torch float32.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#include "common/ptx.cuh"  // max_nan (quad_max)
#define SAGE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SAGE_HOST_DEVICE inline
#endif

namespace sageattention2 {

inline constexpr float kInt8Max = 127.0f;
inline constexpr float kInt4Max = 7.0f;
inline constexpr float kFp8E4M3Max = 448.0f;  // largest finite E4M3 (paper 3.3)
// log2(448): both attention kernels fold the x448 of P's FP8 scale into the softmax's base-2
// exponent, so that P~ * 448 in [0, 448] comes out of exp2 directly.
inline constexpr float kLog2Fp8Max = 8.807354922057604f;

// scale = amax / qmax, IEEE division (no fast-math anywhere in this project).
SAGE_HOST_DEVICE float quant_scale(float amax, float qmax) { return amax / qmax; }

// An all-zero group gets scale 0 and codes 0 rather than 0 * inf = NaN.
SAGE_HOST_DEVICE float quant_inverse(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// One FP8 scale per tile of V (the Hopper kernel's V, issue 4): the tile's max |V - v_mean| /
// 448, floored, then rounded up to a power of two. The floor keeps an all-zero tile's ratio
// s_prev / s_tile finite when the kernel folds O into the tile's units, and V values down to
// 2^-39 keep E4M3's relative precision; the fold stays in float32 while a head's tile maxima
// stay below 2^60 (always for fp16 inputs). A power of two makes V * (1 / s), the fold's ratios
// and the output's rescale exact, so a code is E4M3's own rounding of V (over five draws of the
// input families as accurate as per-channel scales, bias4 2.4-3.8 % better: docs/DECISIONS.md#d6).
// The reference: reference.quantize_v_per_tile.
inline constexpr float kVTileScaleMin = 9.313225746154785e-10f;  // 2^-30
SAGE_HOST_DEVICE float v_tile_scale(float amax) {
  float scale = quant_scale(amax, kFp8E4M3Max);
  scale = scale > kVTileScaleMin ? scale : kVTileScaleMin;
  uint32_t bits;
  __builtin_memcpy(&bits, &scale, sizeof bits);
  if (bits & 0x007FFFFFu) bits = (bits & 0x7F800000u) + 0x00800000u;  // the next power of two
  __builtin_memcpy(&scale, &bits, sizeof bits);
  return scale;
}

// 1 / s of a v_tile_scale s (a power of two in [2^-30, 2^126)), exactly, by the exponent alone:
// 2^k has the bits (127 + k) << 23 and 2^-k the bits (127 - k) << 23. An integer subtraction
// instead of a MUFU reciprocal in the Hopper kernel's fold: one of the choices that lead ptxas
// to a faster schedule of its KV loop (at head_dim 128 non-causal; docs/DECISIONS.md#d12).
SAGE_HOST_DEVICE float inverse_of_power_of_two(float s) {
  uint32_t bits;
  __builtin_memcpy(&bits, &s, sizeof bits);
  bits = 0x7F000000u - bits;
  __builtin_memcpy(&s, &bits, sizeof bits);
  return s;
}

// rint (round half to even, the default rounding mode) of x * inv, clamped to [-qmax, qmax].
// On the GPU by the float adder: clamped to the integers +-qmax first (which commutes with rint),
// y + 1.5 * 2^23 lands where the float spacing is 1, so the sum is rounded to an integer with
// the adder's round-half-even, and its low mantissa bits are that integer plus 2^22. F2I, the
// conversion instruction, issues at 16 per clock and SM against the adder's 128: the same codes
// for 4 full-rate instructions instead of F2I and two integer clamps (its effect on
// quantize_kv's time, whose tiles are latency-bound, was not separated: docs/DECISIONS.md#d17).
// A NaN becomes -qmax here, 0 through F2I: neither is the code of anything; the Q and K
// quantizers' group maxima (ptx::max_nan) make the group's scale NaN instead, so the scores it
// touches are NaN, as SDPA's.
SAGE_HOST_DEVICE int quantize_to_int(float x, float inv, int qmax) {
#if defined(__CUDA_ARCH__)
  const float bound = static_cast<float>(qmax);
  const float clamped = fminf(fmaxf(x * inv, -bound), bound);
  return __float_as_int(clamped + 12582912.0f) - 0x4B400000;
#else
  int q = static_cast<int>(std::nearbyint(x * inv));
  return q > qmax ? qmax : (q < -qmax ? -qmax : q);
#endif
}

// INT4 operands of mma.m16n8k64.s4 are read along K from the low nibble up: channel 2c in the
// low nibble, 2c+1 in the high nibble, two's complement.
SAGE_HOST_DEVICE uint8_t pack_int4x2(int low, int high) {
  return static_cast<uint8_t>((low & 0xF) | ((high & 0xF) << 4));
}
SAGE_HOST_DEVICE int unpack_int4_low(uint8_t byte) { return static_cast<int8_t>(byte << 4) >> 4; }
SAGE_HOST_DEVICE int unpack_int4_high(uint8_t byte) { return static_cast<int8_t>(byte) >> 4; }

#if defined(__CUDACC__)
// A per-thread Q group (paper Eq. 8: rows {g, g+8} of a 16-row slab) is held by the quad of lanes
// 4g .. 4g+3, each with a quarter of its channels: the group's max |x| (and a row's q . k_mean
// for the LSE) is the quad's reduction. Both attention kernels quantize Q this way.
__device__ __forceinline__ float quad_max(float x) {
  x = ptx::max_nan(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return ptx::max_nan(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Per-thread quantization of a 16-byte vector of 8 channels (the arithmetic above), stored as
// 8 INT8 bytes or 4 bytes of packed INT4: quantize_kv and the warp-level attention kernel's own
// Q quantizer write their codes through this.
template <bool kInt4>
struct IntCodes {
  static constexpr int kQmax = kInt4 ? 7 : 127;
  static constexpr int kBytesPer8 = kInt4 ? 4 : 8;

  __device__ static __forceinline__ void store(int8_t* dst, const float (&x)[8], float inv) {
    int q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = quantize_to_int(x[i], inv, kQmax);
    if constexpr (kInt4) {
      uint32_t w = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>(pack_int4x2(q[2 * i], q[2 * i + 1])) << (8 * i);
      *reinterpret_cast<uint32_t*>(dst) = w;
    } else {
      uint2 w = make_uint2(0, 0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.x |= static_cast<uint32_t>(q[i] & 0xFF) << (8 * i);
        w.y |= static_cast<uint32_t>(q[4 + i] & 0xFF) << (8 * i);
      }
      *reinterpret_cast<uint2*>(dst) = w;
    }
  }
  __device__ static __forceinline__ void store_zero(int8_t* dst) {
    if constexpr (kInt4) *reinterpret_cast<uint32_t*>(dst) = 0u;
    else *reinterpret_cast<uint2*>(dst) = make_uint2(0, 0);
  }
};
#endif  // __CUDACC__

}  // namespace sageattention2
