// The Hopper SageAttention2 kernel (sm_90a): INT8 per-thread QK^T and FP8 PV on wgmma, after
// FlashAttention-3's warp-specialised design.
//
// A CTA has three warpgroups. The producer (warpgroup 0, one thread) streams 128-key tiles of
// the quantized K (INT8, from quantize_kv) and V (E4M3, transposed) into a kStages-deep
// shared-memory ring with the copy engine, on full/empty mbarriers. Two consumer warpgroups own
// 64 queries each: they read their fp16/bf16 Q rows once, quantize them to INT8 in registers
// (one scale per query row, computed by the quad that holds it, so no Q pass runs before the
// kernel) into the warpgroup's shared-memory Q tile, then per tile: S = Q K^T (wgmma s8, both
// operands from shared memory), dequantize with one K scale per thread (Fig. 4) and the Q scale
// of each of its two rows, online softmax in base 2 (sm_scale * log2 e folded
// into the Q scale, the x448 of P's FP8 scale folded into the exponent), P~ to E4M3 in registers,
// R = P~ V (wgmma e4m3, A from registers, a fresh accumulator per tile; 8 extra columns of ones
// give the row sums of P~) and O = alpha O + R, l = alpha l + rowsum in FP32 (the two-level
// accumulation of paper 3.4). V comes with one FP8 scale per tile (quantize_kv's, issue 4): O is
// kept in units of the last folded tile's scale, so the fold's rescale becomes alpha * s_prev /
// s_tile, one multiply per row and tile. Only an item's last tile can need a mask (causal
// diagonal, key tail): the loop runs the others with no mask code. The epilogue applies s / l
// (and V's mean, with smooth V) and writes the output in the caller's layout, through shared
// memory as 16-byte row segments.
//
// Work comes in units of two Q blocks of one head (Schedule). A CTA walks its units' items in
// turn: the producer streams their tiles back to back through the same ring, and each consumer
// thread copies its next item's Q rows into shared memory (cp.async) as soon as it has quantized
// the current ones, so a new item starts with its Q and first K/V tiles on chip. With few units
// (short sequences) the grid is persistent, one CTA per SM (attention_wgmma.cu says when).
//
// The consumer warpgroups run the KV loop unsynchronised: FA3's pingpong (taking turns to issue
// the GEMMs) measured 9-12 % slower here, since with two warps per scheduler each softmax then
// hides its own latencies alone (benchmarks/RESULTS.md, sessions 3 and 14). Only their start of
// an item is ordered, so that they run it a fraction of a tile apart (attend()).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>
#include <type_traits>

#include "hopper/params.h"
#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "common/v_channels.cuh"

namespace sageattention2 {

template <typename T, int kHeadDim, bool kCausal>
struct AttentionWgmmaKernel {
  static constexpr int kBlockQ = kWgmmaBlockQ, kBlockK = kWgmmaBlockK;
  static constexpr int kConsumers = 2;                      // warpgroups of 64 queries
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = kHeadDim == 64 ? 6 : 4;
  static constexpr int kKBytes = kBlockK * kHeadDim;        // INT8 K tile, rows of head_dim bytes
  static constexpr int kVBytes = kHeadDim * kBlockK;        // E4M3 V^T tile, rows of 128 keys
  static constexpr int kQkSteps = kHeadDim / 32;            // k-steps of the s8 wgmma
  static constexpr int kPvSteps = kBlockK / 32;             // k-steps of the e4m3 wgmma
  static constexpr int kSRegs = kBlockK / 2;                // S accumulators per thread (m64n128)
  static constexpr int kORegs = kHeadDim / 2;               // O accumulators per thread
  // The PV product has 8 columns more than V's channels: V's smem tile is followed by 8 rows of
  // E4M3 ones, so the tensor cores also sum each row of the FP8 P~ (the softmax denominator, over
  // exactly the values the numerator used) and the softmax loses 64 FADDs per tile and thread
  // (+4-14 % measured with the sums dropped; benchmarks/RESULTS.md, session 5).
  static constexpr int kPvN = kHeadDim + 8;
  static constexpr int kRaccRegs = kPvN / 2;                // PV accumulators per thread
  static constexpr int kVStageBytes = kVBytes + 8 * kBlockK;  // the V^T tile, then 8 rows of ones
  static constexpr int kQChunks = 4 * kQkSteps;             // 8-byte pieces of a thread's 2 Q rows
  // How ptxas is led to schedule the KV loop: the same arithmetic, three choices per
  // instantiation, each measured (benchmarks/RESULTS.md, session 17). With the per-row Q scales
  // the loop as it was ran 7 % slower at head_dim 128 (ptxas put the 64 fold FFMAs after all the
  // exponentials, which then queued on the MUFU pipe alone) and 3.5 % at 64; with these the
  // kernel is as fast as before (within 0.5 %) or faster on every ANCHORS shape.
  // - fold R(it - 1) into O before tile it's softmax (else after it);
  static constexpr bool kFoldBeforeSoftmax = kHeadDim == 64 || !kCausal;
  // - read the tile's K scale while QK(it) runs (else just before the softmax);
  static constexpr bool kEarlyKScale = kHeadDim == 64 || kCausal;
  // - s_O / s_tile by the exponents of the two powers of two (else by a MUFU reciprocal).
  static constexpr bool kInverseByExponent = kHeadDim == 128 && !kCausal;
  // - compute the next tile's ring slot (stage, phases, wgmma descriptors) while this tile runs
  //   (else at the tile's start).
  static constexpr bool kSlotAhead = !kCausal;
  static constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448): P~ * 448 in the exponent
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");

  struct alignas(1024) Smem {
    uint8_t q[kConsumers][64 * kHeadDim];  // each warpgroup's INT8 Q codes, K-major, swizzled
    uint2 q_stage[kConsumers * 4][kQChunks][32];  // fp16/bf16 Q of the next item: per warp, per
                                                  // chunk, per lane (each thread reads its own)
    uint8_t k[kStages][kKBytes];           // every tile 1024-aligned: the swizzle pattern's period
    uint8_t v[kStages][kVStageBytes];      // V^T as the copy engine lands it, then the ones rows
    float k_scale[kStages][4];             // the tile's 4 K group scales travel with it
    uint64_t full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;  // + alignment slack

  struct Tile {  // one work item: a block of 128 queries of one head
    int qb, h, b, hk;
    int64_t q0;
    int kv_tiles;
  };

  // Work units: Q blocks q_blocks - 1 - k and k of one (batch, head), the longer first. Under
  // causal masking a pair holds q_blocks + 1 key tiles whatever k is, so a static round-robin
  // of units over the persistent CTAs is balanced (no global tile counter to reset per call);
  // consecutive units belong to the same head (its K/V stay in L2), GQA heads sharing a KV head
  // are adjacent.
  struct Schedule {
    int q_blocks, pairs;
    int64_t units;
  };

  __host__ __device__ static Schedule schedule(int64_t q_len, int batch, int q_heads) {
    Schedule sc;
    sc.q_blocks = static_cast<int>((q_len + kBlockQ - 1) / kBlockQ);
    sc.pairs = (sc.q_blocks + 1) / 2;
    sc.units = static_cast<int64_t>(batch) * q_heads * sc.pairs;
    return sc;
  }

  // The item `half` (0 or 1) of `unit`; false where the pair is the odd middle block alone.
  __device__ static bool item(const AttentionWgmmaParams& p, const Schedule& sc, int64_t unit, int half, Tile& w) {
    const int k = static_cast<int>(unit % sc.pairs);
    const int64_t head = unit / sc.pairs;
    if (half == 1 && sc.q_blocks - 1 - k == k) return false;
    w.qb = half == 0 ? sc.q_blocks - 1 - k : k;
    w.h = static_cast<int>(head % p.q_heads);
    w.b = static_cast<int>(head / p.q_heads);
    w.hk = w.h / (p.q_heads / p.kv_heads);
    w.q0 = static_cast<int64_t>(w.qb) * kBlockQ;
    int64_t tiles = (p.kv_len + kBlockK - 1) / kBlockK;
    if constexpr (kCausal) {
      const int64_t last_query = (w.q0 + kBlockQ < p.q_len ? w.q0 + kBlockQ : p.q_len) - 1;
      const int64_t needed = last_query / kBlockK + 1;  // SDPA causal: key j visible to query i iff j <= i
      tiles = needed < tiles ? needed : tiles;
    }
    w.kv_tiles = static_cast<int>(tiles);
    return true;
  }

  // Steps (unit, half) to this CTA's next item at or after it; false when none is left.
  __device__ static bool seek(const AttentionWgmmaParams& p, const Schedule& sc, int64_t& unit, int& half, Tile& w) {
    for (; unit < sc.units; unit += gridDim.x, half = 0)
      for (; half < 2; ++half)
        if (item(p, sc, unit, half, w)) return true;
    return false;
  }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // ---- producer: one thread feeds the ring, item after item ----
  __device__ static void produce(const AttentionWgmmaParams& p, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                 Smem& s) {
    ptx::prefetch_tensor_map(k_map);
    ptx::prefetch_tensor_map(v_map);
    // K, its scales and V: complete once quantize_kv, the launch before, is (after_quantize_kv;
    // otherwise it returns at once).
    ptx::griddepcontrol_wait();
    const Schedule sc = schedule(p.q_len, p.batch, p.q_heads);
    uint32_t seq = 0;  // tiles streamed so far: the ring position
    int64_t unit = blockIdx.x;
    int half = 0;
    Tile w;
    for (; seek(p, sc, unit, half, w); ++half) {
      const int bhk = w.b * p.kv_heads + w.hk;
      const float* k_scale = p.k_scale + static_cast<int64_t>(bhk) * (p.k_padded / kBlockK) * 4;
      for (int it = 0; it < w.kv_tiles; ++it, ++seq) {
        const int stage = seq % kStages;
        const uint32_t phase = (seq / kStages) & 1;
        ptx::mbarrier_wait_sleeping(&s.empty_k[stage], phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&s.full_k[stage], kKBytes + 16);
        ptx::tma_load_3d(s.k[stage], k_map, 0, it * kBlockK, bhk, &s.full_k[stage]);
        ptx::bulk_load(s.k_scale[stage], k_scale + it * 4, 16, &s.full_k[stage]);
        ptx::mbarrier_wait_sleeping(&s.empty_v[stage], phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&s.full_v[stage], kVBytes);
        ptx::tma_load_3d(s.v[stage], v_map, it * kBlockK, 0, bhk, &s.full_v[stage]);
      }
    }
  }

  // ---- consumer: Q codes in shared memory, then the pipelined KV loop, then the epilogue ----
  struct QInfo {
    float scale[2];       // dequantization scales of the rows g and g+8, times sm_scale * log2 e
    float k_mean_dot[2];  // q_row . k_mean for the rows g and g+8 (LSE only)
  };

  // Byte offset of (row, byte) in a K-major tile whose rows are one swizzle span (64 or 128
  // bytes): the copy engine's SWIZZLE_64B/128B pattern, which kmajor_descriptor() describes.
  __device__ static int swizzled(int row, int byte) {
    constexpr int kRowBytes = kHeadDim;  // INT8 Q and K rows
    const int chunk = byte / 16;
    const int mixed = kRowBytes == 128 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3);
    return row * kRowBytes + mixed * 16 + byte % 16;
  }

  // Copies rows r0 and r0 + 8 of item w's Q (channels {32s + 4t .. +3, 32s + 16 + 4t .. +3}, the
  // thread's part of the A fragment layout) into the thread's own staging slots; rows past q_len
  // come out as zeros. Only this thread reads them back, so cp.async.wait_group is all the sync.
  __device__ static void stage_q(const AttentionWgmmaParams& p, const Tile& w, int64_t r0, int t,
                                 uint2 (&stage)[kQChunks][32], int lane) {
    const T* q_head = static_cast<const T*>(p.q) + w.b * p.q_stride_b + w.h * p.q_stride_h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = w.q0 + r0 + 8 * r;
      const bool valid = row < p.q_len;
      const T* src = q_head + (valid ? row : 0) * p.q_stride_n + 4 * t;
#pragma unroll
      for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          ptx::cp_async_8(&stage[(r * kQkSteps + s) * 2 + half][lane], src + 32 * s + 16 * half, valid);
    }
    ptx::cp_async_commit();
  }

  // Takes the staged rows, each row's max |x| over the quad that shares it, quantizes with
  // DESIGN.md's arithmetic and stores the codes into the warpgroup's Q tile. One scale per query
  // row, finer than the paper's per-thread group of rows {g, g+8} (Eq. 8) at no cost in the loop:
  // the softmax treats a thread's two rows apart anyway (row max, bias), so it dequantizes with
  // one scale per row as cheaply as with one per thread. It is what brings the outliers family
  // (large channels that vary per token) within the official kernel's accuracy (benchmarks/
  // RESULTS.md, session 17).
  __device__ static QInfo quantize_staged_q(const AttentionWgmmaParams& p, const Tile& w, int slab_row, int t,
                                            const uint2 (&stage)[kQChunks][32], int lane, uint8_t* q_tile) {
    float x[2][kQkSteps][2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint2 raw = stage[(r * kQkSteps + s) * 2 + half][lane];
          const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int i = 0; i < 4; ++i) x[r][s][half][i] = widen1<T>(e[i]);
        }
    QInfo info;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float amax = 0.0f;
#pragma unroll
      for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(x[r][s][half][i]));
      const float scale = quant_scale(quad_max(amax), kInt8Max);
      const float inv = quant_inverse(scale);
#pragma unroll
      for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t word = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i)
            word |= static_cast<uint32_t>(quantize_to_int(x[r][s][half][i], inv, 127) & 0xFF) << (8 * i);
          *reinterpret_cast<uint32_t*>(q_tile + swizzled(slab_row + 8 * r, 32 * s + 16 * half + 4 * t)) = word;
        }
      info.scale[r] = scale * (p.sm_scale * 1.4426950408889634f);
    }
    info.k_mean_dot[0] = info.k_mean_dot[1] = 0.0f;
    if (p.lse != nullptr && p.k_mean != nullptr) {
      const float* km = p.k_mean + (static_cast<int64_t>(w.b) * p.kv_heads + w.hk) * kHeadDim + 4 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float dot = 0.0f;
#pragma unroll
        for (int s = 0; s < kQkSteps; ++s)
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int i = 0; i < 4; ++i) dot = fmaf(x[r][s][half][i], __ldg(km + 32 * s + 16 * half + i), dot);
        info.k_mean_dot[r] = quad_sum(dot);
      }
    }
    return info;
  }

  // Online softmax over one tile's S (int32, rows g and g+8, columns 8i + 2t + {0, 1}), in place:
  // leaves P~ * 448 (base 2, the x448 of P's FP8 scale folded into the exponent) as floats in x
  // and returns each row's rescale factor. The quad's 4 threads share a row, each with its own
  // K scale (`scale[r]` > 0: row r's Q scale times the thread's K scale), so the thread's row max
  // is taken on the integers and dequantized once.
  // kMasked: `key_limit` keys of the tile exist; (causal) the thread's row r sees column c iff
  // c <= rows_ahead + 8 r, rows_ahead = its first row minus the tile's first key.
  template <bool kMasked>
  __device__ static void softmax(float (&x)[kSRegs], const int32_t (&sacc)[kSRegs], const float (&scale)[2], int key_limit,
                                 int rows_ahead, int t, float (&m)[2], float (&alpha)[2]) {
    float bias[2];
    if constexpr (kMasked) {
      // 32-bit offsets from the tile's first key, clamped to the tile (64-bit compares cost two
      // instructions and registers the causal loop does not have).
      const int diagonal = rows_ahead < -9 ? -9 : (rows_ahead > kBlockK ? kBlockK : rows_ahead);
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) {
        x[i] = static_cast<float>(sacc[i]) * scale[(i / 2) & 1];
        const int col = 8 * (i / 4) + 2 * t + (i & 1);
        if (col >= key_limit || (kCausal && col > diagonal + 8 * ((i / 2) & 1))) x[i] = -INFINITY;
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
        bias[r] = ref - kLog2Fp8Max;
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
        bias[r] = mx - kLog2Fp8Max;
      }
      // One FFMA per score: s * scale - bias.
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) x[i] = fmaf(static_cast<float>(sacc[i]), scale[(i / 2) & 1], -bias[(i / 2) & 1]);
    }
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) x[i] = ptx::exp2_approx(x[i]);  // P~ * 448, in [0, 448]
  }

  // With V's keys stored in the order of DESIGN.md, the A fragment of k-step c of the PV wgmma is
  // the S columns of the n8 tiles 4c .. 4c+3, packed in register order, as E4M3.
  __device__ static void pack_p(const float (&x)[kSRegs], uint32_t (&pa)[kPvSteps][4]) {
#pragma unroll
    for (int c = 0; c < kPvSteps; ++c)
#pragma unroll
      for (int reg = 0; reg < 4; ++reg) {
        const int r = reg & 1, n = 4 * c + 2 * (reg >> 1);
        pa[c][reg] = pack_e4m3x4(x[4 * n + 2 * r], x[4 * n + 2 * r + 1], x[4 * (n + 1) + 2 * r],
                                 x[4 * (n + 1) + 2 * r + 1]);
      }
  }

  __device__ static void issue_qk(int32_t (&sacc)[kSRegs], uint64_t q_desc, uint64_t k_desc) {
    ptx::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kQkSteps; ++step) {  // +32 bytes along K per step
      if (step == 0) ptx::wgmma_m64n128k32_s8<false>(sacc, q_desc, k_desc);
      else ptx::wgmma_m64n128k32_s8<true>(sacc, q_desc + 2 * step, k_desc + 2 * step);
    }
    ptx::wgmma_commit();
  }

  __device__ static void issue_pv(float (&racc)[kRaccRegs], uint32_t (&pa)[kPvSteps][4], uint64_t v_desc) {
    ptx::wgmma_fence();
#pragma unroll
    for (int step = 0; step < kPvSteps; ++step) {
      if constexpr (kHeadDim == 128) {
        if (step == 0) ptx::wgmma_m64n136k32_e4m3<false>(racc, pa[step], v_desc);
        else ptx::wgmma_m64n136k32_e4m3<true>(racc, pa[step], v_desc + 2 * step);
      } else {
        if (step == 0) ptx::wgmma_m64n72k32_e4m3<false>(racc, pa[step], v_desc);
        else ptx::wgmma_m64n72k32_e4m3<true>(racc, pa[step], v_desc + 2 * step);
      }
    }
    ptx::wgmma_commit();
  }

  // Which keys of tile `it` a warp's rows may see. Only an item's last tile can need a mask (the
  // causal diagonal: a query block sees whole key tiles before it; the tail of the keys), so the
  // KV loop runs the other tiles with no mask test at all: a per-warp branch in the loop made the
  // compiler move the wgmma descriptors out of uniform registers and the causal loop ran 27 %
  // slower per tile (benchmarks/RESULTS.md, session 7).
  struct TileMask {
    bool masked;
    int key_limit;   // keys of the tile that exist
    int rows_ahead;  // the thread's first row minus the tile's first key
  };
  __device__ static TileMask tile_mask(const AttentionWgmmaParams& p, const Tile& w, int it, int row_in_item) {
    TileMask mask;
    // Item-relative 32-bit offsets: the query block is w.qb, the key tile it.
    mask.rows_ahead = (w.qb - it) * kBlockK + row_in_item;
    const int warp_rows_ahead = mask.rows_ahead - row_in_item % 16;  // the warp's first row
    const bool tail = static_cast<int64_t>(it + 1) * kBlockK > p.kv_len;
    mask.key_limit = tail ? static_cast<int>(p.kv_len - static_cast<int64_t>(it) * kBlockK) : kBlockK;
    mask.masked = tail || (kCausal && kBlockK - 1 > warp_rows_ahead);
    return mask;
  }

  // Everything of one KV tile between its QK product and its PV product: free the K stage, then
  // the softmax (masked as `mask` says when kMasked).
  template <bool kMasked>
  __device__ static void scores_to_p(Smem& s, int stage, float k_scale, const QInfo& q, const TileMask& mask, int lane, int t,
                                     int32_t (&sacc)[kSRegs], float (&x)[kSRegs], float (&m)[2], float (&alpha)[2]) {
    const float scale[2] = {q.scale[0] * k_scale, q.scale[1] * k_scale};
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&s.empty_k[stage]);
    softmax<kMasked>(x, sacc, scale, mask.key_limit, mask.rows_ahead, t, m, alpha);
  }

  // The consumer warpgroup's items in turn. Item i + 1's Q copy is issued as soon as item i's Q
  // is in registers, so it lands while item i's tiles compute.
  __device__ static void consume(const AttentionWgmmaParams& p, Smem& s, int consumer) {
    const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int slab_row = warp_in_group * 16 + g;  // the thread's rows in the item: q0 + consumer * 64 + slab_row (+8)
    uint2 (&stage)[kQChunks][32] = s.q_stage[consumer * 4 + warp_in_group];
    const Schedule sc = schedule(p.q_len, p.batch, p.q_heads);
    int64_t unit = blockIdx.x;
    int half = 0;
    Tile w;
    bool have = seek(p, sc, unit, half, w);
    if (have) stage_q(p, w, consumer * 64 + slab_row, t, stage, lane);
    // Up to here only the caller's Q is read (complete before smoothing_stats started); the means
    // and V's tile scales are written by the launches before (after_quantize_kv).
    ptx::griddepcontrol_wait();
    uint32_t seq = 0;  // tiles consumed so far: the ring position
    while (have) {
      int64_t next_unit = unit;
      int next_half = half + 1;
      Tile next;
      const bool have_next = seek(p, sc, next_unit, next_half, next);
      ptx::cp_async_wait<0>();
      // Item i's Q codes overwrite item i - 1's: this warp's wgmma, the only reader of its own
      // 16 rows, completed before its epilogue.
      const QInfo q = quantize_staged_q(p, w, slab_row, t, stage, lane, s.q[consumer]);
      if (have_next) stage_q(p, next, consumer * 64 + slab_row, t, stage, lane);
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

  // One item's KV loop and epilogue; its first tile sits at ring position seq.
  __device__ static void attend(const AttentionWgmmaParams& p, Smem& s, const Tile& w, const QInfo& q, uint32_t seq,
                                int consumer) {
    const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int row_in_item = consumer * 64 + warp_in_group * 16 + g;  // the thread's rows: this and + 8
    const uint64_t q_desc = ptx::kmajor_descriptor<kHeadDim>(s.q[consumer]);

    float o[kORegs];
#pragma unroll
    for (int i = 0; i < kORegs; ++i) o[i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float alpha[2], alpha_prev[2];
    int32_t sacc[kSRegs];
    float x[kSRegs];
    float racc[kRaccRegs];
    uint32_t pa[kPvSteps][4];
    // V's per-tile scales: R of tile j is in units of s_j, O in those of the last folded tile.
    // Read through L2 (.cg). Nothing writes them while this grid runs any more, so the read-only
    // path would do as well; .cg keeps the KV loop's code as it was measured.
    const float* v_tile_scale =
        p.v_tile_scale + (static_cast<int64_t>(w.b) * p.kv_heads + w.hk) * (p.k_padded / kBlockK);
    float o_scale = 1.0f;  // O is 0 until tile 0 is folded, so any finite start will do

    // Once PV(it - 1) is done: free its V stage, then O = alpha O s_O / s_tile + R and
    // l = alpha l + the ones columns' row sums (the two-level accumulation of paper 3.4; R, and
    // from now on O, in units of the tile's V scale).
    auto release_and_fold = [&](int v_stage, float tile_scale) {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&s.empty_v[v_stage]);
      const float units =  // s_O / s_tile, exact either way
          kInverseByExponent ? o_scale * inverse_of_power_of_two(tile_scale) : __fdividef(o_scale, tile_scale);
      const float factor[2] = {alpha_prev[0] * units, alpha_prev[1] * units};
      o_scale = tile_scale;
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] = fmaf(o[i], factor[(i / 2) & 1], racc[i]);
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] = fmaf(l[r], alpha_prev[r], racc[kORegs + 2 * r]);
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
    // Warpgroup 1 starts an item once warpgroup 0 has its tile 0's P (barrier 3, below): the two
    // then run the KV loop a fraction of a tile apart instead of in step. Left to itself, their
    // offset depended on the per-item code by accident, and the loop tile took 1,644 cycles at
    // 0.3-0.4 tiles apart, 1,960 in step (head_dim 64, N 1K; benchmarks/RESULTS.md, session 14).
    if (consumer == 1) ptx::named_barrier_sync<3, 256>();
    issue_qk(sacc, q_desc, ptx::kmajor_descriptor<kHeadDim>(s.k[stage0]));
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kSRegs; ++i) ptx::register_fence(sacc[i]);
    const TileMask mask0 = last == 0 ? tile_mask(p, w, 0, row_in_item) : unmasked;
    if (mask0.masked) scores_to_p<true>(s, stage0, s.k_scale[stage0][t], q, mask0, lane, t, sacc, x, m, alpha_prev);
    else scores_to_p<false>(s, stage0, s.k_scale[stage0][t], q, mask0, lane, t, sacc, x, m, alpha_prev);
    pack_p(x, pa);
    if (consumer == 0) ptx::named_barrier_arrive<3, 256>();  // one arrival per item, as warpgroup 1 syncs

    // Tile it: QK(it) and PV(it - 1) go to the tensor cores together; S(it)'s row maxima are
    // taken while PV(it - 1) computes (ptxas waits for the PV before the exponentials: session 16
    // of benchmarks/RESULTS.md); R(it - 1) is folded into O (paper 3.4) before or after the
    // softmax (kFoldBeforeSoftmax), and P(it) packed. A masked tile (the last) first waits for
    // PV(it - 1) and folds it: the masked softmax then has the PV accumulators' registers to
    // itself and spills nothing.
    // Where tile it's K and tile it - 1's V sit in the ring. With kSlotAhead the loop takes the
    // next tile's index (the warp-uniform shuffle) and slot while this tile runs: the per-tile
    // trace (benchmarks/RESULTS.md, session 18) puts ~330 cycles between a tile's start and its
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
      r.k_desc = ptx::kmajor_descriptor<kHeadDim>(s.k[r.stage]);
      r.v_desc = ptx::kmajor_descriptor<128>(s.v[r.prev]);
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
      issue_pv(racc, pa, r.v_desc);
      const float prev_scale = __ldcg(v_tile_scale + it - 1);  // lands while PV(it - 1) runs
      auto pv_done = [&] {
        if constexpr (!kMasked) ptx::wgmma_wait<0>();  // (masked: waited for both just below)
#pragma unroll
        for (int i = 0; i < kRaccRegs; ++i) ptx::register_fence(racc[i]);
#pragma unroll
        for (int c = 0; c < kPvSteps; ++c)
#pragma unroll
          for (int reg = 0; reg < 4; ++reg) ptx::register_fence(pa[c][reg]);  // read by PV until now
      };
      ptx::wgmma_wait<kMasked ? 0 : 1>();  // S(it) is ready; unmasked, PV(it - 1) may still run
#pragma unroll
      for (int i = 0; i < kSRegs; ++i) ptx::register_fence(sacc[i]);
      if constexpr (kMasked || kFoldBeforeSoftmax) {
        pv_done();  // (ptxas waits for PV(it - 1) before the exponentials anyway: session 16)
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
      const TileMask mask = tile_mask(p, w, last, row_in_item);
      if (mask.masked) step(last, slot(last), mask, std::true_type{});
      else step(last, slot(last), unmasked, std::false_type{});
    }
    // V's channel means for the epilogue (smooth V only; none are loaded without), all loads in
    // flight together. At head_dim 64 they load while the last PV computes; at 128 their 32
    // registers would push the item's own state out of registers, so they load after the last
    // fold (benchmarks/RESULTS.md, session 7).
    constexpr bool kEarlyVMeans = kHeadDim == 64;
    VChannelMeans<kHeadDim / 8> v_means;
    auto load_v_means = [&] {
      const int64_t bhk = static_cast<int64_t>(w.b) * p.kv_heads + w.hk;
      v_means.load(p.v_mean != nullptr ? p.v_mean + bhk * kHeadDim : nullptr, t);
    };
    if constexpr (kEarlyVMeans) load_v_means();
    {  // the last tile's PV
      const uint32_t last_pos = seq + last;
      const int stage = last_pos % kStages;
      ptx::mbarrier_wait(&s.full_v[stage], (last_pos / kStages) & 1);
      issue_pv(racc, pa, ptx::kmajor_descriptor<128>(s.v[stage]));
      const float last_scale = __ldcg(v_tile_scale + last);
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kRaccRegs; ++i) ptx::register_fence(racc[i]);
      release_and_fold(stage, last_scale);
    }

    // ---- epilogue: O * s / l (+ v_mean), the caller's layout; the natural-log LSE ----
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = l[r];  // the whole row's: every thread of the quad holds it
      inv[r] = sum > 0.0f ? o_scale / sum : 0.0f;
      const int64_t query = w.q0 + row_in_item + 8 * r;
      if (p.lse != nullptr && t == 0 && query < p.q_len) {
        constexpr float kLn2 = 0.6931471805599453f;
        // sum holds sum_j P~_j * 448 relative to the base-2 max m; K smoothing dropped the row
        // constant sm_scale * q . k_mean, which the LSE of the true scores includes.
        p.lse[(static_cast<int64_t>(w.b) * p.q_heads + w.h) * p.q_len + query] =
            sum > 0.0f ? (m[r] + __log2f(sum) - kLog2Fp8Max) * kLn2 + p.sm_scale * q.k_mean_dot[r] : -INFINITY;
      }
    }
    if constexpr (!kEarlyVMeans) load_v_means();
    store_output(p, w, o, inv, v_means, s.q[consumer] + warp_in_group * 16 * kHeadDim,
                 consumer * 64 + warp_in_group * 16, lane);
  }

  // Writes a warp's 16 rows of O through its own 16 rows of the Q code tile (free once the item's
  // last QK product completed; the next item's codes are written after this): the accumulator
  // layout gives each thread 4-byte pieces of 8 rows per store, which cost 8 memory transactions
  // per instruction (~1 tile's time per item, benchmarks/RESULTS.md, session 7), and the round
  // trip through shared memory turns them into 16-byte stores of whole row segments. The tile
  // holds half the columns at a time.
  __device__ static void store_output(const AttentionWgmmaParams& p, const Tile& w, const float (&o)[kORegs],
                                      const float (&inv)[2], const VChannelMeans<kHeadDim / 8>& v_means,
                                      uint8_t* staging, int warp_row0, int lane) {
    constexpr int kChunks = kHeadDim / 16;  // 16-byte chunks of a staged row (half the columns)
    const int g = lane / 4, t = lane % 4;
    // XOR swizzle of the chunks so that both the 4-byte writes (8 rows, one chunk) and the 16-byte
    // reads (whole rows) are free of bank conflicts.
    auto chunk_at = [](int row, int chunk) {
      return row * kChunks * 16 + (chunk ^ (kChunks == 8 ? row & 7 : (row >> 1) & 3)) * 16;
    };
    T* out = static_cast<T*>(p.out) + w.b * p.out_stride_b + w.h * p.out_stride_h;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (half == 1) __syncwarp();  // the first half has been read
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int n = half * kChunks + c;  // the accumulator's n8 tile: columns 8n .. 8n + 7
          const float2 x = v_means.apply(o[4 * n + 2 * r] * inv[r], o[4 * n + 2 * r + 1] * inv[r], n);
          *reinterpret_cast<uint32_t*>(staging + chunk_at(g + 8 * r, c) + 4 * t) = HalfPair<T>::pack(x.x, x.y);
        }
      __syncwarp();
#pragma unroll
      for (int k = 0; k < kChunks / 2; ++k) {  // 16 rows x kChunks chunks over 32 lanes
        const int idx = k * 32 + lane, row = idx / kChunks, chunk = idx % kChunks;
        const int64_t query = w.q0 + warp_row0 + row;
        const uint4 v = *reinterpret_cast<const uint4*>(staging + chunk_at(row, chunk));
        if (query < p.q_len)
          *reinterpret_cast<uint4*>(out + query * p.out_stride_n + (half * kChunks + chunk) * 8) = v;
      }
    }
    __syncwarp();  // every lane has read the staging rows before the next item's Q codes land there
  }
#endif  // sm_90a

  __device__ static void run(const AttentionWgmmaParams& p, const CUtensorMap* k_map, const CUtensorMap* v_map,
                             unsigned char* smem_raw) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
    Smem& s = *reinterpret_cast<Smem*>(base);
    // The 8 rows of E4M3 ones after every V stage (the copy engine writes only the tile before
    // them); the PV wgmma reads them through the async proxy.
    constexpr int kOnesWords = 8 * kBlockK / 4;
    for (int i = threadIdx.x; i < kStages * kOnesWords; i += kThreads)
      reinterpret_cast<uint32_t*>(s.v[i / kOnesWords] + kVBytes)[i % kOnesWords] = 0x38383838u;  // E4M3 1.0
    ptx::fence_proxy_async_shared();
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
      if (threadIdx.x == 0) produce(p, k_map, v_map, s);
    } else {
      ptx::setmaxnreg_inc<240>();
      consume(p, s, group - 1);
    }
#endif
  }
};

// One CTA per SM: 384 threads, registers rebalanced by setmaxnreg (24 for the producer, 240 for
// the consumers: 128 * 24 + 256 * 240 = 64,512 of 65,536).
template <typename T, int kHeadDim, bool kCausal>
__global__ void __launch_bounds__(384, 1)
    attention_wgmma_kernel(const __grid_constant__ AttentionWgmmaParams p, const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map) {
  extern __shared__ __align__(1024) unsigned char smem[];
  AttentionWgmmaKernel<T, kHeadDim, kCausal>::run(p, &k_map, &v_map, smem);
}

}  // namespace sageattention2
