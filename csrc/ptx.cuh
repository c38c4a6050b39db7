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

// PTX ISA, "Data Movement and Conversion Instructions: cp.async": 16-byte global -> shared copy
// through L2 only (.cg). With src_bytes = 0 nothing is read and the 16 bytes are zero-filled:
// tails of a tile (past the sequence end) come out as zeros, never as stale data.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
// PTX ISA, "cp.async.commit_group" and "cp.async.wait_group".
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending)); }

// PTX ISA, "Warp-level matrix load instruction: ldmatrix", .x4 (four 8x8 b16 matrices; lanes
// 8i..8i+7 give the row addresses of matrix i) and .trans (each matrix transposed).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// PTX ISA, "Warp-level matrix multiply-accumulate: mma", mma.m16n8k32.row.col.s32.s8.s8.s32:
// native IMMA on sm_80/89/90 (ANCHORS: 1231 TOPS on the H100 through mma.sync).
__device__ __forceinline__ void mma_m16n8k32_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: the PV product with a true FP32
// accumulator (no FP22 truncation, unlike the FP8 instruction of paper 3.4).
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16_f32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// PTX ISA, "Floating Point Instructions: ex2", ex2.approx.ftz.f32: 2^x in one MUFU op. The
// softmax runs in base 2 because sm_scale * log2(e) is folded into the Q scales.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
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
