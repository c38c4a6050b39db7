// The consumer side of the Hopper kernel's main loop (FlashAttention-3's mainloop mma side): one
// item's KV tiles through the two wgmma products, per tile S = Q K^T (s8, both operands from
// shared memory), the online softmax (hopper/softmax.cuh), P~ to E4M3 in registers, R = P~ V
// (e4m3, A from registers, a fresh accumulator per tile; 8 extra columns of ones give the row
// sums of P~), and O = alpha O + R, l = alpha l + rowsum in FP32 (the two-level accumulation of
// paper 3.4). V comes with one FP8 scale per tile (quantize_kv's, issue 4): O is kept in units of
// the last folded tile's scale, so the fold's rescale becomes alpha * s_prev / s_tile, one
// multiply per row and tile. Only an item's last tile can need a mask (hopper/mask.cuh).
//
// The accurate tier (kFp8Pv false, issue 36) keeps everything up to P and changes the PV side:
// P in the input dtype (in [0, 1], without FP8's x448), V the caller's 16-bit tile as the
// copy engine lands it (an MN-major operand), and the product accumulated into O itself, as
// FlashAttention-3 does: the f16/bf16 wgmma accumulates in true FP32, so the per-tile products
// and folds of paper 3.4 buy nothing there, and O rescaled in place frees the 64 registers of a
// second accumulator (with them the head_dim 128 loop would not fit in 240). The row sums of P are
// FADDs in the softmax's registers, reduced across the quad once per item.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "hopper/geometry.cuh"
#include "hopper/mask.cuh"
#include "hopper/params.h"
#include "hopper/q_quantizer.cuh"  // WgmmaQRows
#include "hopper/softmax.cuh"
#include "hopper/tile_scheduler.cuh"

namespace sageattention2 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename T, int kHeadDim, bool kCausal, bool kFp8Pv, bool kPacked = false>
struct WgmmaMainloop {
  using Geometry = WgmmaGeometry<kHeadDim, kFp8Pv>;
  using Smem = typename Geometry::Smem;
  using Softmax = WgmmaSoftmax<kHeadDim, kCausal, kFp8Pv>;
  using TileMask = WgmmaTileMask<kCausal>;
  static constexpr int kBlockK = Geometry::kBlockK, kStages = Geometry::kStages;
  static constexpr int kQkSteps = Geometry::kQkSteps, kPvSteps = Geometry::kPvSteps;
  static constexpr int kSRegs = Geometry::kSRegs, kORegs = Geometry::kORegs, kRaccRegs = Geometry::kRaccRegs;
  // How ptxas is led to schedule the KV loop: the same arithmetic, three choices per
  // instantiation, each measured (docs/DECISIONS.md#d12). With the per-row Q scales the loop as
  // it was ran 7 % slower at head_dim 128 (ptxas put the 64 fold FFMAs after all the
  // exponentials, which then queued on the MUFU pipe alone) and 3.5 % at 64; with these the
  // kernel is as fast as before (within 0.5 %) or faster on every shape of
  // docs/PROTOCOL.md#speed-inputs.
  // - fold R(it - 1) into O before tile it's softmax (else after it);
  static constexpr bool kFoldBeforeSoftmax = kHeadDim == 64 || !kCausal;
  // - read the tile's K scale while QK(it) runs (else just before the softmax);
  static constexpr bool kEarlyKScale = kHeadDim == 64 || kCausal;
  // - s_O / s_tile by the exponents of the two powers of two (else by a MUFU reciprocal).
  static constexpr bool kInverseByExponent = kHeadDim == 128 && !kCausal;
  // - compute the next tile's ring slot (stage, phases, wgmma descriptors) while this tile runs
  //   (else at the tile's start).
  static constexpr bool kSlotAhead = !kCausal;
  // - (16-bit PV) tile it's softmax, row sums included, while PV(it - 1) computes (else ptxas
  //   waits for the PV before the first exponential, as at FP8: docs/DECISIONS.md#d14). A/B/A
  //   on the H100 (docs/DECISIONS.md#d45): kernel +1-4 % at head_dim 64 non-causal, -2-3 % at
  //   64 causal, -1-2 % at 128, where the other warpgroup's products already filled that wait.
  static constexpr bool kSoftmaxBesidePv = !kFp8Pv && kHeadDim == 64 && !kCausal;

  // FP8: with V's keys stored in the order of docs/DESIGN.md#v-layout, the A fragment of k-step c
  // of the PV wgmma is the S columns of the n8 tiles 4c .. 4c+3, packed in register order, as
  // E4M3. 16-bit: V's keys in their own order, and the A fragment of k-step c (keys 16c ..
  // 16c + 15) is the accumulator registers of S's n8 tiles 2c and 2c + 1 as they are, in pairs
  // (PTX ISA, "Register Fragments", m64nNk16 A and m64nN D).
  __device__ static void pack_p(const float (&x)[kSRegs], uint32_t (&pa)[kPvSteps][4]) {
#pragma unroll
    for (int c = 0; c < kPvSteps; ++c)
#pragma unroll
      for (int reg = 0; reg < 4; ++reg) {
        if constexpr (kFp8Pv) {
          const int r = reg & 1, n = 4 * c + 2 * (reg >> 1);
          pa[c][reg] = pack_e4m3x4(x[4 * n + 2 * r], x[4 * n + 2 * r + 1], x[4 * (n + 1) + 2 * r],
                                   x[4 * (n + 1) + 2 * r + 1]);
        } else {
          pa[c][reg] = HalfPair<T>::pack(x[8 * c + 2 * reg], x[8 * c + 2 * reg + 1]);
        }
      }
  }

  // (16-bit PV) The thread's part of each row's sum of P, over its 32 of the tile's columns.
  __device__ static void row_sums(const float (&x)[kSRegs], float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float a = 0.0f, b = 0.0f;  // two chains: half the dependent FADD latency
#pragma unroll
      for (int n = 0; n < kSRegs / 4; n += 2) {
        a += x[4 * n + 2 * r] + x[4 * n + 2 * r + 1];
        b += x[4 * (n + 1) + 2 * r] + x[4 * (n + 1) + 2 * r + 1];
      }
      sum[r] = a + b;
    }
  }

  // +32 bytes along K per step; at head_dim 256 steps 4-7 read the second 128-byte span's tiles
  // (hopper/geometry.cuh), which start 64 (Q) or 128 (K) rows of 128 bytes further on.
  static constexpr int kStepsPerSpan = Geometry::kSpanRowBytes / 32;
  static constexpr uint64_t kQSpanDesc = 64 * Geometry::kSpanRowBytes / 16, kKSpanDesc = kBlockK * Geometry::kSpanRowBytes / 16;
  __device__ static void issue_qk(int32_t (&sacc)[kSRegs], uint64_t q_desc, uint64_t k_desc) {
    ptx::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kQkSteps; ++step) {
      const int span = step / kStepsPerSpan, within = step % kStepsPerSpan;
      if (step == 0) ptx::wgmma_m64n128k32_s8<false>(sacc, q_desc, k_desc);
      else ptx::wgmma_m64n128k32_s8<true>(sacc, q_desc + span * kQSpanDesc + 2 * within,
                                          k_desc + span * kKSpanDesc + 2 * within);
    }
    ptx::wgmma_commit();
  }

  // (head_dim 256) R = P~ V for V's channels 64 c .. 64 c + 63 into a fresh accumulator (V^T
  // rows 64 c on, N 64; the last chunk also the 8 rows of ones after them, N 72, the row sums in
  // racc[32 ..]), then folded into O's quarter (paper 3.4, factor = alpha * s_O / s_tile).
  template <int kChunk>
  __device__ static void issue_pv_chunk(float (&racc)[kRaccRegs], uint32_t (&pa)[kPvSteps][4], uint64_t v_desc) {
    static_assert(kFp8Pv && kRaccRegs == 36 && kORegs == 128, "head_dim 256 with FP8 PV");
    constexpr bool kLast = kChunk == Geometry::kPvChunks - 1;
    const uint64_t desc = v_desc + kChunk * (64 * kBlockK / 16);
    ptx::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kPvSteps; ++step) {
      if constexpr (kLast) {
        if (step == 0) ptx::wgmma_m64n72k32_e4m3<false>(racc, pa[step], desc);
        else ptx::wgmma_m64n72k32_e4m3<true>(racc, pa[step], desc + 2 * step);
      } else {
        float(&first)[32] = *reinterpret_cast<float(*)[32]>(&racc[0]);
        if (step == 0) ptx::wgmma_m64n64k32_e4m3<false>(first, pa[step], desc);
        else ptx::wgmma_m64n64k32_e4m3<true>(first, pa[step], desc + 2 * step);
      }
    }
    ptx::wgmma_commit();
  }
  template <int kChunk, int kPending>
  __device__ static void fold_chunk(float (&o)[kORegs], float (&racc)[kRaccRegs], const float (&factor)[2]) {
    ptx::wgmma_wait<kPending>();
#pragma unroll
    for (int j = 0; j < kRaccRegs; ++j) ptx::register_fence(racc[j]);
#pragma unroll
    for (int j = 0; j < 32; ++j) o[32 * kChunk + j] = fmaf(o[32 * kChunk + j], factor[(j / 2) & 1], racc[j]);
  }

  // FP8: R = P~ V into a fresh accumulator (racc). 16-bit: O += P V (racc is O).
  __device__ static void issue_pv(float (&racc)[kRaccRegs], uint32_t (&pa)[kPvSteps][4], uint64_t v_desc) {
    ptx::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kPvSteps; ++step) {
      if constexpr (!kFp8Pv) {  // +16 keys: 16 rows of 128 bytes
        if constexpr (kHeadDim == 128) ptx::wgmma_m64n128k16_input<HalfPair<T>::kBf16>(racc, pa[step], v_desc + 128 * step);
        else ptx::wgmma_m64n64k16_input<HalfPair<T>::kBf16>(racc, pa[step], v_desc + 128 * step);
      } else if constexpr (kHeadDim == 128) {
        if (step == 0) ptx::wgmma_m64n136k32_e4m3<false>(racc, pa[step], v_desc);
        else ptx::wgmma_m64n136k32_e4m3<true>(racc, pa[step], v_desc + 2 * step);
      } else {
        if (step == 0) ptx::wgmma_m64n72k32_e4m3<false>(racc, pa[step], v_desc);
        else ptx::wgmma_m64n72k32_e4m3<true>(racc, pa[step], v_desc + 2 * step);
      }
    }
    ptx::wgmma_commit();
  }

  __device__ static uint64_t v_descriptor(Smem& s, int stage) {
    if constexpr (kFp8Pv) return ptx::kmajor_descriptor<128>(s.v[stage]);
    else return ptx::mnmajor_descriptor_128b(s.v[stage], Geometry::kVChunkBytes);
  }

  // The named barrier on which the consumer warpgroups order an item's start, warpgroup 0
  // arriving once it has tile 0's P, warpgroup 1 waiting before its first QK: barrier 3 + the
  // ring slot of the item's first tile (0-2 are __syncthreads' and each warpgroup's own). Each
  // phase then has one blocking instruction, the aligned bar.sync's contract (D35's rendezvous,
  // both warpgroups blocking on barrier 3 from two sites, is what synccheck reported). One
  // barrier for every item over-counts: with items of a tile or two warpgroup 0 can start
  // several items before warpgroup 1 starts one, and two arrivals of its 128 threads completed
  // the 256-thread phase alone; warpgroup 1 then waited an item behind and, at the CTA's last
  // item, forever (causal 4096 queries x 256 keys x 64 heads hung within seconds; D35). One per
  // slot cannot: two items on one barrier start kStages or more tiles apart, and warpgroup 0
  // reaches the later one's tile 0 only once the producer has refilled that slot, i.e. once
  // every consumer warp has freed the earlier item's tile 0 there, which warpgroup 1 does after
  // its wait.
  static_assert(3 + kStages <= 16, "a CTA has 16 named barriers");
  __device__ static uint32_t item_start_barrier(uint32_t seq) { return 3 + seq % kStages; }

  // Everything of one KV tile between its QK product and its PV product: free the K stage, then
  // the softmax (masked as `mask` says when kMasked).
  template <bool kMasked>
  __device__ static void scores_to_p(Smem& s, int stage, float k_scale, const WgmmaQRows& q, const TileMask& mask,
                                     int lane, int t, int32_t (&sacc)[kSRegs], float (&x)[kSRegs], float (&m)[2],
                                     float (&alpha)[2]) {
    const float scale[2] = {q.scale[0] * k_scale, q.scale[1] * k_scale};
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&s.empty_k[stage]);
    Softmax::template online<kMasked>(x, sacc, scale, mask, t, m, alpha);
  }

  // One item's KV tiles, from tile 0's QK product to the last tile's PV product folded into O; its
  // first tile sits at ring position seq. before_last_pv() runs between the last tile's softmax
  // and its PV product (the epilogue's early loads, hopper/epilogue.cuh); finish(o, m, l, o_scale)
  // receives the result: O in units of the V scale o_scale, the rows' max m (base 2) and sum l
  // of P~ * 448.
  template <typename BeforeLastPv, typename Finish>
  __device__ static void run(const AttentionWgmmaParams& p, Smem& s, const WgmmaWorkItem& w, const WgmmaQRows& q,
                             uint32_t seq, int consumer, BeforeLastPv&& before_last_pv, Finish&& finish) {
    const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int row_in_item = consumer * 64 + warp_in_group * 16 + g;  // the thread's rows: this and + 8
    const uint64_t q_desc = ptx::kmajor_descriptor<Geometry::kSpanRowBytes>(s.q[consumer]);

    float o[kORegs];
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float alpha[2], alpha_prev[2] = {0.0f, 0.0f};  // (alpha_prev: set by tile 0, before its first use)
    int32_t sacc[kSRegs];
    float x[kSRegs];
    float racc[kFp8Pv ? kRaccRegs : 1];  // (FP8: the tile's R; 16-bit PV accumulates into o)
    uint32_t pa[kPvSteps][4];
    // V's per-tile scales: R of tile j is in units of s_j, O in those of the last folded tile.
    // Read through L2 (.cg). Nothing writes them while this grid runs any more, so the read-only
    // path would do as well; .cg keeps the KV loop's code as it was measured.
    const float* v_tile_scale =  // (FP8 only)
        kFp8Pv ? p.v_tile_scale + item_first_tile<kPacked>(p, w) : nullptr;
    float o_scale = 1.0f;  // O is 0 until tile 0 is folded, so any finite start will do

    // Once PV(it - 1) is done: free its V stage, then O = alpha O s_O / s_tile + R and
    // l = alpha l + the ones columns' row sums (the two-level accumulation of paper 3.4; R, and
    // from now on O, in units of the tile's V scale).
    auto release_v = [&](int v_stage) {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&s.empty_v[v_stage]);
    };
    auto release_and_fold = [&](int v_stage, float tile_scale) {
      release_v(v_stage);
      const float units =  // s_O / s_tile, exact either way
          kInverseByExponent ? o_scale * inverse_of_power_of_two(tile_scale) : __fdividef(o_scale, tile_scale);
      const float factor[2] = {alpha_prev[0] * units, alpha_prev[1] * units};
      o_scale = tile_scale;
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] = fmaf(o[i], factor[(i / 2) & 1], racc[i]);
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = fmaf(l[r], alpha_prev[r], racc[kORegs + 2 * r]);
    };
    // (16-bit PV) Once PV(it - 1) is done and tile it's softmax gave alpha: O and l to tile it's
    // max, and l += tile it's row sums; PV(it) then adds into O in the same units.
    auto rescale_to_tile = [&](const float(&tile_alpha)[2], const float(&sum)[2]) {
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] *= tile_alpha[(i / 2) & 1];
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = fmaf(l[r], tile_alpha[r], sum[r]);
    };

    // Tile 0: S, softmax.
    // The ring position, the last tile and (below) the loop's tile index pass through a shuffle
    // from lane 0: the compiler then knows they are warp-uniform and computes the stages' wgmma
    // descriptors in uniform registers. Without them the causal loop's counter lived in a vector
    // register (24 R2UR per tile instead of 8, 33 more instructions) and the item state spilled.
    const int last = __shfl_sync(0xffffffffu, w.kv_tiles - 1, 0);
    seq = __shfl_sync(0xffffffffu, seq, 0);
    const TileMask unmasked{false, kBlockK, 0};
    const int stage0 = seq % kStages;
    ptx::mbarrier_wait(&s.full_k[stage0], (seq / kStages) & 1);
    // Warpgroup 1 starts an item once warpgroup 0 has its tile 0's P (item_start_barrier, below):
    // the two then run the KV loop a fraction of a tile apart instead of in step. Left to itself,
    // their offset depended on the per-item code by accident, and the loop tile took 1,644 cycles
    // at 0.3-0.4 tiles apart, 1,960 in step (head_dim 64, N 1K; docs/DECISIONS.md#d11).
    const uint32_t start_barrier = item_start_barrier(seq);
    if (consumer == 1) ptx::named_barrier_sync<256>(start_barrier);
    issue_qk(sacc, q_desc, ptx::kmajor_descriptor<Geometry::kSpanRowBytes>(s.k[stage0]));
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) ptx::register_fence(sacc[i]);
    const TileMask mask0 = last == 0 ? TileMask::template of<kItemKeys<kHeadDim, kCausal> || kPacked>(p, w, 0, row_in_item) : unmasked;
    if (mask0.masked) scores_to_p<true>(s, stage0, s.k_scale[stage0][t], q, mask0, lane, t, sacc, x, m, alpha_prev);
    else scores_to_p<false>(s, stage0, s.k_scale[stage0][t], q, mask0, lane, t, sacc, x, m, alpha_prev);
    if constexpr (!kFp8Pv) {
      float sum[2];
      row_sums(x, sum);
      rescale_to_tile(alpha_prev, sum);
    }
    pack_p(x, pa);
    if (consumer == 0) ptx::named_barrier_arrive<256>(start_barrier);

    // Tile it: QK(it) and PV(it - 1) go to the tensor cores together; S(it)'s row maxima are
    // taken while PV(it - 1) computes (ptxas waits for the PV before the exponentials:
    // docs/DECISIONS.md#d14; with kSoftmaxBesidePv after them); R(it - 1) is folded into O (paper 3.4) before or after the
    // softmax (kFoldBeforeSoftmax), and P(it) packed. A masked tile (the last) first waits for
    // PV(it - 1) and folds it: the masked softmax then has the PV accumulators' registers to
    // itself and spills nothing.
    // Where tile it's K and tile it - 1's V sit in the ring. With kSlotAhead the loop takes the
    // next tile's index (the warp-uniform shuffle) and slot while this tile runs: the per-tile
    // trace (docs/DECISIONS.md#d13) puts ~330 cycles between a tile's start and its
    // last GEMM issued, a chain of shuffle, uniform-datapath arithmetic and descriptors. ptxas
    // still recomputes part of the slot at the top, but the shuffle leaves the chain: the hd128
    // loop's encoded stall cycles fall from 910 to 867 per tile and the kernel gains 1-2 %
    // non-causal. The causal loops came out 4-19 instructions longer and 1-3 % slower with it.
    struct Slot {
      int stage, prev;
      uint32_t phase, prev_phase;
      uint64_t k_desc, v_desc;
    };
    auto slot = [&](int it) {
      const uint32_t pos = seq + it;
      Slot r;
      r.stage = pos % kStages;
      r.prev = (pos - 1) % kStages;
      r.phase = (pos / kStages) & 1;
      r.prev_phase = ((pos - 1) / kStages) & 1;
      r.k_desc = ptx::kmajor_descriptor<Geometry::kSpanRowBytes>(s.k[r.stage]);
      r.v_desc = v_descriptor(s, r.prev);
      return r;
    };
    auto step = [&](int it, const Slot& r, const TileMask& mask, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      const int stage = r.stage, prev = r.prev;
      const uint32_t phase = r.phase, prev_phase = r.prev_phase;
      ptx::mbarrier_wait(&s.full_k[stage], phase);
      // The tile's K group scale (keys 8i + 2t + {0, 1} are group t): read while QK(it) runs.
      const float early_k_scale = kEarlyKScale ? s.k_scale[stage][t] : 0.0f;
      auto k_scale = [&] { return kEarlyKScale ? early_k_scale : s.k_scale[stage][t]; };
      issue_qk(sacc, q_desc, r.k_desc);
      ptx::mbarrier_wait(&s.full_v[prev], prev_phase);
      [[maybe_unused]] float prev_scale = 1.0f;
      if constexpr (kFp8Pv) {
        issue_pv(racc, pa, r.v_desc);
        prev_scale = __ldcg(v_tile_scale + it - 1);  // lands while PV(it - 1) runs
      } else {
        issue_pv(o, pa, r.v_desc);
      }
      // anchor (kSoftmaxBesidePv): a value of tile it's softmax, which the wait then follows.
      auto pv_done = [&](float anchor = 0.0f) {
        if constexpr (kMasked) {
          // (waited for both just below)
        } else if constexpr (kSoftmaxBesidePv) {
          ptx::wgmma_wait_after<0>(anchor);
        } else {
          ptx::wgmma_wait<0>();
        }
#pragma unroll
        for (int i = 0; i < kRaccRegs; ++i) {
          if constexpr (kFp8Pv) ptx::register_fence(racc[i]);
          else ptx::register_fence(o[i]);
        }
#pragma unroll
        for (int c = 0; c < kPvSteps; ++c)
#pragma unroll
          for (int reg = 0; reg < 4; ++reg) ptx::register_fence(pa[c][reg]);  // read by PV until now
      };
      ptx::wgmma_wait<kMasked ? 0 : 1>();  // S(it) is ready; unmasked, PV(it - 1) may still run
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) ptx::register_fence(sacc[i]);
      if constexpr (!kFp8Pv) {
        scores_to_p<kMasked>(s, stage, k_scale(), q, mask, lane, t, sacc, x, m, alpha);
        float sum[2];
        if constexpr (kSoftmaxBesidePv && !kMasked) {
          row_sums(x, sum);
          pv_done(fminf(sum[0], sum[1]));
          release_v(prev);
        } else {
          pv_done();
          release_v(prev);
          row_sums(x, sum);
        }
        rescale_to_tile(alpha, sum);
      } else if constexpr (kMasked || kFoldBeforeSoftmax) {
        pv_done();  // (ptxas waits for PV(it - 1) before the exponentials anyway: docs/DECISIONS.md#d14)
        release_and_fold(prev, prev_scale);
        scores_to_p<kMasked>(s, stage, k_scale(), q, mask, lane, t, sacc, x, m, alpha);
      } else {
        scores_to_p<false>(s, stage, k_scale(), q, mask, lane, t, sacc, x, m, alpha);
        pv_done();
        release_and_fold(prev, prev_scale);
      }
      pack_p(x, pa);
      alpha_prev[0] = alpha[0];
      alpha_prev[1] = alpha[1];
    };
    if constexpr (kSlotAhead) {
      int it = 1;
      Slot cur = slot(1);
#pragma unroll 1
      while (it < last) {
        const int next = __shfl_sync(0xffffffffu, it + 1, 0);
        const Slot upcoming = slot(next);
        step(it, cur, unmasked, std::false_type{});
        it = next;
        cur = upcoming;
      }
    } else {
#pragma unroll 1
      for (int it = 1; it < last; ++it) {
        const int now = __shfl_sync(0xffffffffu, it, 0);
        step(now, slot(now), unmasked, std::false_type{});
      }
    }
    if (last > 0) {
      const TileMask mask = TileMask::template of<kItemKeys<kHeadDim, kCausal> || kPacked>(p, w, last, row_in_item);
      if (mask.masked) step(last, slot(last), mask, std::true_type{});
      else step(last, slot(last), unmasked, std::false_type{});
    }
    before_last_pv();
    {  // the last tile's PV
      const uint32_t last_pos = seq + last;
      const int stage = last_pos % kStages;
      ptx::mbarrier_wait(&s.full_v[stage], (last_pos / kStages) & 1);
      if constexpr (kFp8Pv) {
        issue_pv(racc, pa, v_descriptor(s, stage));
        const float last_scale = __ldcg(v_tile_scale + last);
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kRaccRegs; ++i) ptx::register_fence(racc[i]);
        release_and_fold(stage, last_scale);
      } else {
        issue_pv(o, pa, v_descriptor(s, stage));
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kORegs; ++i) ptx::register_fence(o[i]);
        release_v(stage);
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // the quad's parts of each row's sum
          l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
          l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        }
      }
    }
    finish(o, m, l, o_scale);
  }

  // The same item at head_dim 256 (FP8 PV, hopper/geometry.cuh), one tile at a time: QK(it),
  // the softmax, then PV(it) in four channel ranges, each folded into its part of O as soon as it
  // is done (paper 3.4, with alpha of tile it itself). O's 128 registers leave room for S or for
  // one range's accumulator, not for QK(it + 1) beside PV(it) as at 64 and 128: the tensor cores
  // are kept busy by the other consumer warpgroup, a fraction of a tile apart
  // (item_start_barrier), and a tile's GEMMs here take twice as long against the same softmax.
  template <typename BeforeLastPv, typename Finish>
  __device__ static void run_in_chunks(const AttentionWgmmaParams& p, Smem& s, const WgmmaWorkItem& w,
                                       const WgmmaQRows& q, uint32_t seq, int consumer,
                                       BeforeLastPv&& before_last_pv, Finish&& finish) {
    static_assert(Geometry::kPvChunks == 4 && kORegs == 128, "head_dim 256");
    const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int row_in_item = consumer * 64 + warp_in_group * 16 + g;
    const uint64_t q_desc = ptx::kmajor_descriptor<Geometry::kSpanRowBytes>(s.q[consumer]);
    float o[kORegs];
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2];
    int32_t sacc[kSRegs];
    float x[kSRegs];
    float racc[2][kRaccRegs];  // two chunks' accumulators: one computes while the other is folded
    uint32_t pa[kPvSteps][4];
    const float* v_tile_scale = p.v_tile_scale + item_first_tile<kPacked>(p, w);
    float o_scale = 1.0f;  // O is 0 until tile 0 is folded, so any finite start will do
    const int last = __shfl_sync(0xffffffffu, w.kv_tiles - 1, 0);  // warp-uniform (see run())
    seq = __shfl_sync(0xffffffffu, seq, 0);
    const TileMask unmasked{false, kBlockK, 0};
    const uint32_t start_barrier = item_start_barrier(seq);
    // One tile; only the last can need a mask.
    auto tile = [&](int it, const TileMask& mask, auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
      const uint32_t pos = seq + it;
      const int stage = pos % kStages;
      const uint32_t phase = (pos / kStages) & 1;
      ptx::mbarrier_wait(&s.full_k[stage], phase);
      if (it == 0 && consumer == 1) ptx::named_barrier_sync<256>(start_barrier);  // as in run()
      issue_qk(sacc, q_desc, ptx::kmajor_descriptor<Geometry::kSpanRowBytes>(s.k[stage]));
      const float tile_scale = __ldcg(v_tile_scale + it);  // lands while QK(it) runs
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < kSRegs; ++j) ptx::register_fence(sacc[j]);
      scores_to_p<kMasked>(s, stage, s.k_scale[stage][t], q, mask, lane, t, sacc, x, m, alpha);
      pack_p(x, pa);
      if (it == 0 && consumer == 0) ptx::named_barrier_arrive<256>(start_barrier);
      if (it == last) before_last_pv();
      const float units = __fdividef(o_scale, tile_scale);  // s_O / s_tile, exact (powers of two)
      const float factor[2] = {alpha[0] * units, alpha[1] * units};
      o_scale = tile_scale;
      const uint64_t v_desc = ptx::kmajor_descriptor<128>(s.v[stage]);
      ptx::mbarrier_wait(&s.full_v[stage], phase);
      // Two accumulators: chunk c + 1 computes while chunk c is folded (full call +2-5 % over
      // one accumulator and a wait per chunk, A/B/A on the H100).
      issue_pv_chunk<0>(racc[0], pa, v_desc);
      issue_pv_chunk<1>(racc[1], pa, v_desc);
      fold_chunk<0, 1>(o, racc[0], factor);
      issue_pv_chunk<2>(racc[0], pa, v_desc);
      fold_chunk<1, 1>(o, racc[1], factor);
      issue_pv_chunk<3>(racc[1], pa, v_desc);
      fold_chunk<2, 1>(o, racc[0], factor);
      fold_chunk<3, 0>(o, racc[1], factor);
#pragma unroll
      for (int c = 0; c < kPvSteps; ++c)
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) ptx::register_fence(pa[c][reg]);  // read by PV until now
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&s.empty_v[stage]);
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = fmaf(l[r], alpha[r], racc[1][32 + 2 * r]);
    };
    // Causal, the masked last tile runs after the loop (8 spill accesses per tile in the loop
    // instead of 13, +2-7 %); non-causal, the loop keeps it (after the loop: -6-8 %, though
    // spill-free). A/B/A on the H100, docs/DECISIONS.md#d39.
    if constexpr (kCausal) {
#pragma unroll 1
      for (int i = 0; i < last; ++i) tile(__shfl_sync(0xffffffffu, i, 0), unmasked, std::false_type{});
      const TileMask mask = TileMask::template of<kItemKeys<kHeadDim, kCausal> || kPacked>(p, w, last, row_in_item);
      if (mask.masked) tile(last, mask, std::true_type{});
      else tile(last, unmasked, std::false_type{});
    } else {
#pragma unroll 1
      for (int i = 0; i <= last; ++i) {
        const int it = __shfl_sync(0xffffffffu, i, 0);
        const TileMask mask = it == last ? TileMask::template of<kItemKeys<kHeadDim, kCausal> || kPacked>(p, w, it, row_in_item) : unmasked;
        if (mask.masked) tile(it, mask, std::true_type{});
        else tile(it, mask, std::false_type{});
      }
    }
    finish(o, m, l, o_scale);
  }
};
#endif  // sm_90a

}  // namespace sageattention2
