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

// The same from an f16x2 (cvt.rn.satfinite.e4m3x2.f16x2, sm_89+): the low half lands in the low
// byte. One instruction for two elements that are already fp16, without widening them.
__device__ __forceinline__ uint16_t cvt_e4m3x2_rn_satfinite(uint32_t f16x2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(f16x2));
  return r;
#else
  __half2_raw raw;
  raw.x = static_cast<unsigned short>(f16x2 & 0xFFFFu);
  raw.y = static_cast<unsigned short>(f16x2 >> 16);
  return static_cast<uint16_t>(__nv_cvt_halfraw2_to_fp8x2(raw, __NV_SATFINITE, __NV_E4M3));
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
// The 8-byte form (.ca: the only one below 16 bytes), same zero-fill contract.
__device__ __forceinline__ void cp_async_8(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(gmem_src), "r"(src_bytes) : "memory");
}
// PTX ISA, "cp.async.commit_group" and "cp.async.wait_group". The memory clobber keeps the
// compiler from moving shared-memory reads of the copied data above the wait.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory"); }

// PTX ISA, "griddepcontrol" (sm_90+; below it no launch is programmatic and both are no-ops).
// launch_dependents lets the grid launched after this one with programmatic stream
// serialization (CUDA's programmatic dependent launch) start once every CTA of this grid has
// executed it or exited, instead of once this grid has completed. wait blocks until the grids
// this one depends on have completed and their memory is visible; in a grid launched the
// ordinary way they completed before it started, and it returns at once.
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddepcontrol_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

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

// PTX ISA, "Floating Point Instructions: max", max.NaN.f32 (sm_80+): NaN when either operand is
// NaN, where max.f32 (fmaxf) returns the other one. The Q and K quantizers' group maxima use it,
// so that a NaN in a group makes its scale NaN and every score it touches NaN, as SDPA's would
// be (fmaxf would give a finite scale and finite, meaningless codes).
__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// PTX ISA, "Warp-level matrix multiply-accumulate: mma", mma.m16n8k32.row.col.s32.s8.s8.s32:
// native IMMA on sm_80/89/90 (1231 TOPS on the H100 through mma.sync:
// docs/PROTOCOL.md#tensor-core-rates).
__device__ __forceinline__ void mma_m16n8k32_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma.m16n8k64.row.col.s32.s4.s4.s32 (the 4-bit QK of paper 3.2): native IMMA.16864 on sm_80 and
// sm_89; sm_90a has no such SASS instruction and emulates it (~50 TOPS on the H100,
// docs/PROTOCOL.md#tensor-core-rates). Its fragments are those of m16n8k32.s8 with two nibbles
// per byte (lower channel in the lower nibble), so the INT8 tile loads serve it unchanged.
__device__ __forceinline__ void mma_m16n8k64_s4(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.s32.s4.s4.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma.m16n8k32.row.col.f32.e4m3.e4m3.f32 (sm_89+): the FP8 PV product of paper 3.3. Native
// QMMA.16832 on Ada, whose accumulator keeps only FP22 (paper 3.4, hence the two-level
// accumulation of its callers); emulated on sm_90a (no QMMA.16832 in its SASS). Older archs have
// no FP8 tensor cores: their launches refuse the FP8 variants, which trap if reached anyway.
__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
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


// ---------------------------------------------------------------------------------------------
// Hopper (sm_90): mbarriers, the bulk copy engine (TMA), warpgroup MMA (wgmma, sm_90a only) and
// register reallocation (setmaxnreg, sm_90a only). Shared-memory operands are 32-bit addresses
// in the shared window.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier.init".
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}
// PTX ISA, "membar/fence": fence.mbarrier_init makes the initialisation visible to the async
// proxy (the copy engine completes transactions on these barriers).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// PTX ISA, "mbarrier.arrive" with .expect_tx: one arrival that also announces `bytes` of
// transactions (the copies that complete on this barrier) for the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// PTX ISA, "mbarrier.arrive": a plain arrival (release semantics at CTA scope).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}
// PTX ISA, "mbarrier.test_wait/mbarrier.try_wait", .parity form: true once the phase of the
// given parity has completed. A fresh barrier is in phase 0, so waiting on parity 1 returns at
// once (how a producer starts on empty buffers).
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done)
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}
// For a producer warp that shares its scheduler with consumer warps: try_wait returns within
// ~12 cycles on sm_90 (measured with ncu: a spinning producer issued half as many instructions
// as a consumer warp, on issue slots the consumers of its scheduler needed), so back off between
// polls. A freed stage waits at most one sleep (the ring holds several ~1.5 us tiles).
__device__ __forceinline__ void mbarrier_wait_sleeping(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) __nanosleep(128);
}

// PTX ISA, "Data Movement and Conversion Instructions: cp.async.bulk.tensor", 3-D tile mode:
// the box at coordinates (c0 innermost, c1, c2) of the tensor map lands in shared memory (with
// the map's swizzle) and completes `box bytes` of transactions on `bar`. Out-of-range elements
// are filled with zeros.
__device__ __forceinline__ void tma_load_3d(void* dst, const void* tensor_map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(smem_address(dst)), "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(bar))
      : "memory");
}
// The 4-D tile mode, same contract: boxes of a caller's [B, H, N, D] tensor (c0 the channel,
// c1 the token, c2 the head, c3 the batch item), read through its own strides.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* tensor_map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(smem_address(dst)), "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(bar))
      : "memory");
}
// PTX ISA, "cp.async.bulk": a contiguous copy (16-byte multiple, 16-byte aligned) global ->
// shared, completing on `bar` like the tensor copies.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
}
// PTX ISA, "red" with a vector type (sm_90): four float32 added at a 16-byte aligned global
// address in the L2, relaxed, no return value: the attention backward's dQ over key blocks.
__device__ __forceinline__ void red_add_v4_f32(float* dst, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
// PTX ISA, "membar/fence", fence.proxy.async: shared memory written by ordinary stores becomes
// visible to the async proxy (wgmma operands, the copy engine). Each writing thread fences, then
// the readers synchronise.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// PTX ISA, "bar.sync" with a thread count: a barrier among `threads` threads (whole warps) only,
// e.g. one warpgroup, leaving barrier 0 (__syncthreads) to the whole CTA.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
// PTX ISA, "bar.arrive": count this warp in at barrier kId (of kThreads) without waiting; the
// threads that bar.sync on it wait for these arrivals. A one-way signal between warpgroups.
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
// The same two with the barrier's number in a register (PTX ISA: operand a, "an immediate constant
// or register with value 0 through 15").
template <int kThreads>
__device__ __forceinline__ void named_barrier_sync(uint32_t id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_barrier_arrive(uint32_t id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}
// PTX ISA, "prefetch.tensormap": bring a tensor map (a kernel parameter) into the cache.
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(tensor_map) : "memory");
}
#endif  // sm_90

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// PTX ISA, "setmaxnreg": hand registers from the producer warpgroup (which only issues copies) to
// the consumer warpgroups (which hold the accumulators). Needs a register cap at kernel entry.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs)); }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs)); }

// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions":
// wgmma.fence orders earlier register writes (A fragments, accumulators) before the next
// wgmma.mma_async; commit_group closes a group of issued MMAs; wait_group<N> waits until at
// most N groups are pending.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory"); }
// wait_group<N> where the source puts it, after the work that computes `anchor`: ptxas moves a
// wait up to just after the previous one, above independent work (the accurate tier's
// exponentials then waited for their own tile's PV product, docs/DECISIONS.md#d45), but it does
// not move it out of a branch. Both arms wait, so any anchor is correct; `anchor` >= 0 or NaN
// (a sum of exponentials) always takes the first, and the second's nanosleep only keeps the
// compiler from merging the arms back into one wait above the branch.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_after(float anchor) {
  if (!(anchor < 0.0f)) {
    wgmma_wait<kPending>();
  } else {
    wgmma_wait<kPending>();
    __nanosleep(1);
  }
}
// Pins a register across the asynchronous MMA: the compiler may neither read an accumulator
// before wgmma_wait nor move this past it (volatile asm statements keep their order).
__device__ __forceinline__ void register_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void register_fence(int32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void register_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
#endif  // sm_90a

// PTX ISA, "Matrix Descriptor Format" of wgmma: a K-major shared-memory operand whose rows are
// exactly one swizzle span long (64 or 128 bytes), written by the copy engine with the same
// swizzle. Bits 0-13 start address >> 4, 16-29 leading offset (unused for swizzled K-major),
// 32-45 stride offset >> 4 (8 rows: the distance between 8-row core-matrix groups), 62-63 the
// swizzle (1 = 128 B, 2 = 64 B). The tile base must be aligned to the swizzle pattern (1024 B).
// Stepping along K inside the span is adding the byte offset to the start address.
template <int kRowBytes>
__device__ __forceinline__ uint64_t kmajor_descriptor(const void* tile) {
  static_assert(kRowBytes == 64 || kRowBytes == 128, "rows of one 64- or 128-byte swizzle span");
  constexpr uint64_t kSwizzle = kRowBytes == 128 ? 1 : 2;
  constexpr uint64_t kStride = (8 * kRowBytes) >> 4;
  return static_cast<uint64_t>((smem_address(tile) & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (kStride << 32) |
         (kSwizzle << 62);
}

// The same format for an MN-major operand (PTX ISA, "Shared Memory Matrix Layout", canonical
// layout of 128-byte swizzling, MN-major: ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)) with T = 8
// 16-bit elements): rows of 64 16-bit elements along N (one 128-byte span per k), 8 consecutive
// k rows forming one 1024-byte swizzle atom (SBO = 1024), and the next 64 N elements
// `n_chunk_bytes` further on (LBO). Stepping 16 along K is adding 2048 bytes to the start.
__device__ __forceinline__ uint64_t mnmajor_descriptor_128b(const void* tile, uint32_t n_chunk_bytes) {
  return static_cast<uint64_t>((smem_address(tile) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((n_chunk_bytes & 0x3FFFF) >> 4) << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SAGE_WGMMA_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SAGE_WGMMA_D64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SAGE_WGMMA_D68 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, " \
  "%66, %67}"
#define SAGE_WGMMA_D36 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}"
#define SAGE_OPS4(c, d, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3])
#define SAGE_OPS8(c, d, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]), c(d[i + 7])
#define SAGE_OPS32(c, d) SAGE_OPS8(c, d, 0), SAGE_OPS8(c, d, 8), SAGE_OPS8(c, d, 16), SAGE_OPS8(c, d, 24)
#define SAGE_OPS64(c, d) SAGE_OPS32(c, d), SAGE_OPS8(c, d, 32), SAGE_OPS8(c, d, 40), SAGE_OPS8(c, d, 48), SAGE_OPS8(c, d, 56)

// wgmma.mma_async.m64n128k32.s32.s8.s8, A (the warpgroup's 64 queries x 32 channels) and B (128
// keys x 32 channels), both K-major INT8 in shared memory: S = Q K^T of paper Algorithm 1 with
// exact int32 accumulation. kAccumulate = false starts a fresh accumulator (scale-d = 0).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n128k32_s8(int32_t (&d)[64], uint64_t a_desc, uint64_t b_desc) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " SAGE_WGMMA_D64 ", %64, %65, p; }"
      : SAGE_OPS64("+r", d)
      : "l"(a_desc), "l"(b_desc), "n"(kAccumulate ? 1 : 0));
}

// wgmma.mma_async.m64nNk32.f32.e4m3.e4m3 with N = head_dim + 8 (136 or 72), A = P~ in FP8 from
// registers, B = V (head_dim rows x 32 keys, K-major) from shared memory followed by 8 rows of
// E4M3 ones: the PV product of paper 3.3 into an FP32-declared accumulator (the two-level
// accumulation of paper 3.4 starts each KV tile fresh), whose last 8 columns are the row sums of
// the FP8 P~ (the softmax's denominator, summed where the numerator is).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n136k32_e4m3(float (&d)[68], const uint32_t (&a)[4], uint64_t b_desc) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %73, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 " SAGE_WGMMA_D68 ", {%68, %69, %70, %71}, %72, p, 1, 1; }"
      : SAGE_OPS64("+f", d), SAGE_OPS4("+f", d, 64)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(kAccumulate ? 1 : 0));
}
// N = 64: a quarter of head_dim 256's channels (hopper/mainloop.cuh), without ones rows (the
// last quarter, m64n72k32, has them).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " SAGE_WGMMA_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1; }"
      : SAGE_OPS32("+f", d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(kAccumulate ? 1 : 0));
}
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n72k32_e4m3(float (&d)[36], const uint32_t (&a)[4], uint64_t b_desc) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %41, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n72k32.f32.e4m3.e4m3 " SAGE_WGMMA_D36 ", {%36, %37, %38, %39}, %40, p, 1, 1; }"
      : SAGE_OPS32("+f", d), SAGE_OPS4("+f", d, 32)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(kAccumulate ? 1 : 0));
}

// wgmma.mma_async.m64nNk16.f32.{f16,bf16} with N = head_dim (128 or 64), A = P from registers
// (the accumulator layout of S, packed in pairs), B = V (16 keys x head_dim channels) MN-major
// from shared memory (imm-trans-b = 1: the caller's V rows as the copy engine lands them, no
// transposing pass): the accurate tier's PV product, accumulating into O in true FP32 (unlike the
// e4m3 instruction's, paper 3.4).
// One such instruction in TYPE (f16 or bf16): SHAPE, the D register list, the operand list of A's
// four registers, the operand numbers of B's descriptor and of scale-d (always 1: O accumulates),
// D's operands last.
#define SAGE_WGMMA_INPUT(SHAPE, TYPE, DLIST, ALIST, B, P, ...)                                     \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %" P ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " DLIST ", " ALIST     \
               ", %" B ", p, 1, 1, 1; }"                                                           \
               : __VA_ARGS__                                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(1))
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n128k16_input(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc) {
  if constexpr (kBf16) SAGE_WGMMA_INPUT("m64n128k16", "bf16", SAGE_WGMMA_D64, "{%64, %65, %66, %67}", "68", "69", SAGE_OPS64("+f", d));
  else SAGE_WGMMA_INPUT("m64n128k16", "f16", SAGE_WGMMA_D64, "{%64, %65, %66, %67}", "68", "69", SAGE_OPS64("+f", d));
}
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_input(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc) {
  if constexpr (kBf16) SAGE_WGMMA_INPUT("m64n64k16", "bf16", SAGE_WGMMA_D32, "{%32, %33, %34, %35}", "36", "37", SAGE_OPS32("+f", d));
  else SAGE_WGMMA_INPUT("m64n64k16", "f16", SAGE_WGMMA_D32, "{%32, %33, %34, %35}", "36", "37", SAGE_OPS32("+f", d));
}
#undef SAGE_WGMMA_INPUT

// wgmma.mma_async.m64n64k16.f32.{f16,bf16}, both operands in shared memory: the attention
// backward's S^T = K Q^T and dP^T = V dO^T (both K-major, kTransA = kTransB = 0), and its
// dQ = dS K (dS stored as dS^T: A MN-major, kTransA = 1; K's rows: B MN-major, kTransB = 1; the
// transpose bits exist for 16-bit operands only, PTX ISA "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate: wgmma.mma_async"). scale_d = 0 starts a fresh accumulator.
template <bool kBf16, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a_desc, uint64_t b_desc, int scale_d) {
  if constexpr (kBf16)
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SAGE_WGMMA_D32 ", %32, %33, p, 1, 1, %35, %36; }"
        : SAGE_OPS32("+f", d)
        : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB));
  else
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " SAGE_WGMMA_D32 ", %32, %33, p, 1, 1, %35, %36; }"
        : SAGE_OPS32("+f", d)
        : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB));
}
#undef SAGE_OPS64
#undef SAGE_OPS32
#undef SAGE_OPS8
#undef SAGE_OPS4
#undef SAGE_WGMMA_D32
#undef SAGE_WGMMA_D36
#undef SAGE_WGMMA_D68
#undef SAGE_WGMMA_D64
#endif  // sm_90a

}  // namespace sageattention2::ptx
