// The Hopper SageAttention2 kernel (sm_90a): INT8 per-thread QK^T and FP8 PV on wgmma, after
// FlashAttention-3's warp-specialised design.
//
// A CTA has three warpgroups. The producer (warpgroup 0, one thread) streams 128-key tiles of
// the quantized K (INT8, from quantize_kv) and V (E4M3, transposed; in the accurate tier,
// kFp8Pv false, the caller's fp16/bf16 V as it is) into a kStages-deep
// shared-memory ring with the copy engine, on full/empty mbarriers (hopper/producer.cuh). Two
// consumer warpgroups own 64 queries each: they read their fp16/bf16 Q rows once, quantize them
// to INT8 in registers (one scale per query row, computed by the quad that holds it, so no Q pass
// runs before the kernel) into the warpgroup's shared-memory Q tile (hopper/q_quantizer.cuh),
// then run the item's KV loop (hopper/mainloop.cuh: both wgmma products, the online softmax of
// hopper/softmax.cuh, the last tile's mask of hopper/mask.cuh) and its epilogue, which applies
// s / l (and V's mean, with smooth V) and writes the output in the caller's layout
// (hopper/epilogue.cuh). This file composes them.
//
// Work comes in units of two Q blocks of one head (hopper/tile_scheduler.cuh). A CTA walks its
// units' items in turn: the producer streams their tiles back to back through the same ring, and
// each consumer thread copies its next item's Q rows into shared memory (cp.async) as soon as it
// has quantized the current ones, so a new item starts with its Q and first K/V tiles on chip.
// With few units (short sequences) the grid is persistent, one CTA per SM (hopper/launch.cuh
// says when).
//
// The consumer warpgroups run the KV loop unsynchronised: FA3's pingpong (taking turns to issue
// the GEMMs) measured slower each of the three times it was tried (up to 12 %), since with two
// warps per scheduler each softmax then hides its own latencies alone (docs/DECISIONS.md#d10).
// Only their start of an item is ordered, so that they run it a fraction of a tile apart
// (hopper/mainloop.cuh, docs/DECISIONS.md#d11).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "common/ptx.cuh"
#include "hopper/epilogue.cuh"
#include "hopper/geometry.cuh"
#include "hopper/mainloop.cuh"
#include "hopper/params.h"
#include "hopper/producer.cuh"
#include "hopper/q_quantizer.cuh"
#include "hopper/tile_scheduler.cuh"

namespace sageattention2 {

// kPacked: the variant that runs packed items (hopper/params.h; every variant has one): launched
// only with packed_items, which the others never read.
template <typename T, int kHeadDim, bool kCausal, bool kFp8Pv, bool kPacked = false>
struct AttentionWgmmaKernel {
  using Geometry = WgmmaGeometry<kHeadDim, kFp8Pv>;
  using Smem = typename Geometry::Smem;
  using Scheduler = WgmmaSchedulerOf<kHeadDim, kCausal, kPacked>;
  static constexpr int kThreads = Geometry::kThreads, kSmemBytes = Geometry::kSmemBytes;
  static constexpr int kBlockK = Geometry::kBlockK, kStages = Geometry::kStages, kVBytes = Geometry::kVBytes;
  static constexpr int kConsumers = Geometry::kConsumers, kQSlots = Geometry::kQSlots, kORegs = Geometry::kORegs;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Producer = WgmmaProducer<kHeadDim, kCausal, kFp8Pv, kPacked>;
  using QQuantizer = WgmmaQQuantizer<T, kHeadDim, kPacked>;
  using Mainloop = WgmmaMainloop<T, kHeadDim, kCausal, kFp8Pv, kPacked>;
  using Epilogue = WgmmaEpilogue<T, kHeadDim, kCausal, kFp8Pv, kPacked>;

  // The consumer warpgroup's items in turn. Item i + 1's Q copy is issued as soon as item i's Q
  // is in registers, so it lands while item i's tiles compute.
  __device__ static void consume(const AttentionWgmmaParams& p, Smem& s, int consumer) {
    const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int slab_row = warp_in_group * 16 + g;  // the thread's rows in the item: q0 + consumer * 64 + slab_row (+8)
    uint2(&slots)[kQSlots][32] = s.q_stage[Geometry::kStageQ ? consumer * 4 + warp_in_group : 0];
    const typename Scheduler::Schedule sc = Scheduler::schedule(p.q_len, p.batch, p.q_heads, p.unit_items);
    int64_t unit = blockIdx.x;
    int half = 0;
    WgmmaWorkItem w;
    bool have = Scheduler::seek(p, sc, unit, half, w);
    if (have) QQuantizer::stage(p, w, consumer * 64 + slab_row, t, slots, lane);
    // Up to here only the caller's Q is read (complete before smoothing_stats started); the means
    // and V's tile scales are written by the launches before (after_quantize_kv).
    ptx::griddepcontrol_wait();
    uint32_t seq = 0;  // tiles consumed so far: the ring position
    while (have) {
      int64_t next_unit = unit;
      int next_half = half + 1;
      WgmmaWorkItem next;
      const bool have_next = Scheduler::seek(p, sc, next_unit, next_half, next);
      ptx::cp_async_wait<0>();
      // Item i's Q codes overwrite item i - 1's: this warp's wgmma, the only reader of its own
      // 16 rows, completed before its epilogue.
      const WgmmaQRows q = QQuantizer::quantize(p, w, slab_row, t, slots, lane, s.q[consumer], consumer * 64 + slab_row);
      if (have_next) QQuantizer::stage(p, next, consumer * 64 + slab_row, t, slots, lane);
      ptx::fence_proxy_async_shared();  // the codes are read by wgmma (async proxy)
      // ... once the whole warpgroup wrote them (barrier 1 + consumer: one per warpgroup).
      if (consumer == 0) ptx::named_barrier_sync<1, 128>();
      else ptx::named_barrier_sync<2, 128>();
      attend(p, s, w, q, seq, consumer);
      seq += static_cast<uint32_t>(w.kv_tiles);
      unit = next_unit;
      half = next_half;
      w = next;
      have = have_next;
    }
  }

  // One item's KV loop and epilogue; its first tile sits at ring position seq. The loop keeps O,
  // m, l and o_scale as its own locals and hands them to the epilogue when it ends, and the
  // epilogue's state (V's means, 1 / l) is declared here: the order in which these arrays are
  // declared, and in which function, decides NVVM's PTX register numbering, and with them
  // declared elsewhere ptxas scheduled the item's start differently (the same instructions in
  // another order). This way the kernel's SASS is the one measured before the split.
  __device__ static void attend(const AttentionWgmmaParams& p, Smem& s, const WgmmaWorkItem& w, const WgmmaQRows& q,
                                uint32_t seq, int consumer) {
    Epilogue epilogue;
    auto before_last_pv = [&] {
      if constexpr (Epilogue::kEarlyVMeans) epilogue.load_v_means(p, w);
    };
    auto finish = [&](const float(&o)[kORegs], const float(&m)[2], const float(&l)[2], float o_scale) {
      epilogue.store(p, w, q, o, m, l, o_scale, s.q[consumer], consumer);
    };
    if constexpr (Geometry::kPvChunks > 1) Mainloop::run_in_chunks(p, s, w, q, seq, consumer, before_last_pv, finish);
    else Mainloop::run(p, s, w, q, seq, consumer, before_last_pv, finish);
  }
#endif  // sm_90a

  __device__ static void run(const AttentionWgmmaParams& p, const CUtensorMap* k_map, const CUtensorMap* v_map,
                             unsigned char* smem_raw) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
    Smem& s = *reinterpret_cast<Smem*>(base);
    // The 8 rows of E4M3 ones after every V stage (the copy engine writes only the tile before
    // them); the PV wgmma reads them through the async proxy.
    if constexpr (kFp8Pv) {
      constexpr int kOnesWords = 8 * kBlockK / 4;
      for (int i = threadIdx.x; i < kStages * kOnesWords; i += kThreads)
        reinterpret_cast<uint32_t*>(s.v[i / kOnesWords] + kVBytes)[i % kOnesWords] = 0x38383838u;  // E4M3 1.0
      ptx::fence_proxy_async_shared();
    }
    if (threadIdx.x == 0) {
      for (int i = 0; i < kStages; ++i) {
        ptx::mbarrier_init(&s.full_k[i], 1);  // the producer's arrive.expect_tx
        ptx::mbarrier_init(&s.full_v[i], 1);
        ptx::mbarrier_init(&s.empty_k[i], kConsumers * 4);  // one arrival per consumer warp
        ptx::mbarrier_init(&s.empty_v[i], kConsumers * 4);
      }
      ptx::fence_mbarrier_init();
    }
    __syncthreads();
    const int group = threadIdx.x / 128;
    if (group == 0) {
      ptx::setmaxnreg_dec<24>();
      if (threadIdx.x == 0) Producer::run(p, k_map, v_map, s);
    } else {
      ptx::setmaxnreg_inc<240>();
      consume(p, s, group - 1);
    }
#endif
  }
};

// One CTA per SM: 384 threads, registers rebalanced by setmaxnreg (24 for the producer, 240 for
// the consumers: 128 * 24 + 256 * 240 = 64,512 of 65,536).
template <typename T, int kHeadDim, bool kCausal, bool kFp8Pv, bool kPacked = false>
__global__ void __launch_bounds__(384, 1)
    attention_wgmma_kernel(const __grid_constant__ AttentionWgmmaParams p, const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map) {
  extern __shared__ __align__(1024) unsigned char smem[];
  AttentionWgmmaKernel<T, kHeadDim, kCausal, kFp8Pv, kPacked>::run(p, &k_map, &v_map, smem);
}

}  // namespace sageattention2
