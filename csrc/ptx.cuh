// Thin wrappers over single PTX instructions, each naming the PTX ISA section (by title, which is
// stable across ISA versions, unlike the numbers) it implements.
// Everything that touches an instruction by name lives here and nowhere else.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace sageattention2::ptx {

// PTX ISA, "Data Movement and Conversion Instructions: ld", .global.nc (non-coherent, read-only data path), 16 bytes.
// Inputs of the preprocessing kernels are read once and never written by the same launch.
__device__ __forceinline__ uint4 ld_global_nc_v4(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}

// PTX ISA, "Data Movement and Conversion Instructions: cvt", cvt.rn.satfinite.e4m3x2.f32 (sm_89+) packs two floats into two E4M3
// bytes, rounding to nearest even and saturating to +-448; `hi` lands in the upper byte. Older
// archs get the same rounding from the cuda_fp8.h software path.
__device__ __forceinline__ uint16_t cvt_e4m3x2_rn_satfinite(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
#endif
}

}  // namespace sageattention2::ptx

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

template <typename T>
__device__ __forceinline__ float widen1(T x);
template <>
__device__ __forceinline__ float widen1<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float widen1<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace sageattention2
