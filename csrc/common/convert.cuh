// Conversions between the kernels' number formats: fp16/bf16 to float32 and back, float32 to E4M3.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/ptx.cuh"  // cvt_e4m3x2_rn_satfinite

namespace sageattention2 {

// 8 fp16/bf16 values held in one 16-byte vector, widened to float32 (exact).
template <typename T>
__device__ __forceinline__ void widen8(const uint4& raw, float (&out)[8]);

template <>
__device__ __forceinline__ void widen8<__half>(const uint4& raw, float (&out)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void widen8<__nv_bfloat16>(const uint4& raw, float (&out)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Eight float32 values from 32-byte aligned global memory, by two 16-byte read-only loads (a K
// mean's eight channels: center_keys, the backward kernel).
__device__ __forceinline__ void load8(const float* src, float (&out)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(src)), b = __ldg(reinterpret_cast<const float4*>(src) + 1);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

template <typename T>
__device__ __forceinline__ float widen1(T x);
template <>
__device__ __forceinline__ float widen1<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float widen1<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// Two float32 values rounded to one fp16x2 / bf16x2 word (`lo` in the low half): the output
// stores of both attention kernels and the P operand of the fp16/bf16 PV MMA.
template <typename T>
struct HalfPair;
template <>
struct HalfPair<__half> {
  static constexpr bool kBf16 = false;
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct HalfPair<__nv_bfloat16> {
  static constexpr bool kBf16 = true;
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Four fp32 values to four E4M3 bytes (first value in the lowest byte), saturating to +-448: the
// P~ operand of both FP8 PV products (mma.sync m16n8k32 and wgmma k32 take one row's 4
// consecutive K elements per register).
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  return static_cast<uint32_t>(ptx::cvt_e4m3x2_rn_satfinite(a, b)) |
         (static_cast<uint32_t>(ptx::cvt_e4m3x2_rn_satfinite(c, d)) << 16);
}

}  // namespace sageattention2
