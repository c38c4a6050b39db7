// The warp-level SageAttention2 kernel (paper Algorithm 1) in FlashAttention-2 form: a CTA of
// 8 warps owns 128 queries (16 per warp), streams 128-key tiles of K and V through a three-stage
// cp.async pipeline, computes S = Q K^T with INT8 mma.sync from per-thread quantized codes,
// dequantizes with one Q scale and one K scale per thread (Fig. 4), adds the exact Delta-S of Q
// smoothing, runs the online softmax in base 2 (sm_scale * log2(e) is folded into the Q scales)
// and accumulates P V in FP32.
//
// This instantiation family is the PV-in-fp16/bf16 variant (for GPUs without FP8); the FP8 PV
// and INT4 QK variants of the issue extend the same template.
#pragma once

#include <cstdint>

#include "attention_params.h"
#include "ptx.cuh"

namespace sageattention2 {

// Shared-memory tiles are rows of 16-byte chunks; ldmatrix reads 8 rows of one chunk column at
// once, so the chunk index is XOR-ed with the row to put those 8 rows in 8 different bank
// groups (rows of 4 chunks share a 128-byte line two by two, hence the shift).
template <int kChunksPerRow>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  static_assert(kChunksPerRow == 4 || kChunksPerRow % 8 == 0, "rows of 64 bytes or multiples of 128");
  const int mixed = kChunksPerRow >= 8 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3);
  return row * kChunksPerRow * 16 + mixed * 16;
}

// int32 -> float32 for |x| < 2^22, exactly, without I2F: 2^23 + 2^22 + x has x in its low
// mantissa bits. An INT8 dot product over at most 256 channels is below 127^2 * 256 < 2^22.
// I2F issues at a quarter of the FMA rate on the unit that also runs ex2 (ncu: the kernel was
// issue-bound), so this moves 32 conversions per thread and tile to the integer and FMA pipes.
__device__ __forceinline__ float small_int_to_float(int32_t x) {
  constexpr int32_t kMagic = 0x4B400000;  // 1.5 * 2^23
  return __int_as_float(x + kMagic) - 12582912.0f;
}

template <typename T, int kHeadDim, bool kCausal>
struct AttentionMmaKernel {
  static constexpr int kBlockQ = kMmaBlockQ, kWarps = kMmaWarps, kBlockK = kMmaBlockK;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockQ / kWarps;  // 16: one MMA slab
  static constexpr int kSlabs = kRowsPerWarp / 16;
  static constexpr int kKeyTiles = kBlockK / 8;          // n8 tiles of S per KV tile
  static constexpr int kDimTiles = kHeadDim / 8;         // n8 tiles of O
  static constexpr int kQkChunks = kHeadDim / 16;        // 16-byte chunks of an INT8 row
  static constexpr int kVChunks = kHeadDim * 2 / 16;     // 16-byte chunks of a V row
  static constexpr int kQBytes = kBlockQ * kHeadDim;
  static constexpr int kKBytes = kBlockK * kHeadDim;
  static constexpr int kVBytes = kBlockK * kHeadDim * 2;
  static constexpr int kDeltaBytes = kBlockK * 4;
  static constexpr int kKScaleBytes = 16;  // the 4 K group scales of the tile
  static constexpr int kStageBytes = kKBytes + kVBytes + kDeltaBytes + kKScaleBytes;
  // Three stages: a K/V tile is requested two tiles ahead of its use (measured: no faster than
  // two stages at 64-key tiles, kept as headroom; 160 KB of shared memory at head_dim 128).
  static constexpr int kStages = 3;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(127 * 127 * kHeadDim < (1 << 22), "small_int_to_float needs |QK int32| < 2^22");

  // Shared memory: the Q tile, then kStages pipeline stages of {K codes, V, Delta-S}. Stage
  // addresses are computed, not indexed from an array, so nothing lands in local memory.
  struct Smem {
    unsigned char* base;
    __device__ unsigned char* q() const { return base; }
    __device__ unsigned char* stage(int i) const { return base + kQBytes + i * kStageBytes; }
    __device__ unsigned char* k(int i) const { return stage(i); }
    __device__ unsigned char* v(int i) const { return stage(i) + kKBytes; }
    __device__ float* delta(int i) const { return reinterpret_cast<float*>(stage(i) + kKBytes + kVBytes); }
    __device__ float* k_scale(int i) const { return delta(i) + kBlockK; }
  };

  // One KV tile into one pipeline stage. Keys past kv_len read nothing and land as zeros (the
  // K codes and Delta-S are padded by quantize_kv; V is the caller's unpadded tensor).
  //
  // With kThreads a multiple of a row's chunk count, a thread copies one fixed chunk column of
  // rows r, r + step, r + 2*step, ... with step a multiple of 8 (so the swizzle, which only sees
  // row & 7 or (row >> 1) & 3, is the same for all of them): its addresses are affine in the
  // unrolled index. Written as a generic strided loop, the address arithmetic of these copies was
  // most of the kernel's integer work (SASS: ~400 instructions per tile, ncu: ALU the top pipe).
  template <int kChunks>
  struct TileCopy {
    static constexpr int kRowStep = kThreads / kChunks;
    static constexpr int kPasses = kBlockK / kRowStep;
    static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && kBlockK % kRowStep == 0, "copy geometry");
    __device__ static int row() { return threadIdx.x / kChunks; }
    __device__ static int chunk() { return threadIdx.x % kChunks; }
    __device__ static int smem_offset() { return swizzled_offset<kChunks>(row(), chunk()); }
  };
  using KCopy = TileCopy<kQkChunks>;
  using VCopy = TileCopy<kVChunks>;

  // Per-(batch, head) base pointers of everything a KV tile reads.
  struct KvHead {
    const int8_t* k;
    const float* k_scale;
    const T* v;
    const float* delta;  // null without Q smoothing
  };

  __device__ static void load_kv_tile(const AttentionMmaParams& p, const Smem& s, int stage, const KvHead& head,
                                      int64_t k0) {
    const int8_t* k_head = head.k;
    const T* v_head = head.v;
    const int8_t* kg = k_head + (k0 + KCopy::row()) * kHeadDim + KCopy::chunk() * 16;
    unsigned char* ks = s.k(stage) + KCopy::smem_offset();
#pragma unroll
    for (int j = 0; j < KCopy::kPasses; ++j)
      ptx::cp_async_16(ks + j * KCopy::kRowStep * kHeadDim, kg + j * KCopy::kRowStep * kHeadDim, true);

    const int64_t v_row = k0 + VCopy::row();
    const T* vg = v_head + v_row * p.v_stride_n + VCopy::chunk() * 8;
    unsigned char* vs = s.v(stage) + VCopy::smem_offset();
#pragma unroll
    for (int j = 0; j < VCopy::kPasses; ++j) {
      const bool valid = v_row + j * VCopy::kRowStep < p.kv_len;
      ptx::cp_async_16(vs + j * VCopy::kRowStep * kHeadDim * 2,
                       valid ? vg + j * VCopy::kRowStep * p.v_stride_n : v_head, valid);
    }
    // The tile's K scales travel with it: read from global memory between the QK MMAs and the
    // softmax, their latency stalled every warp once per tile.
    if (threadIdx.x == kThreads - 1) ptx::cp_async_16(s.k_scale(stage), head.k_scale + k0 / kBlockK * 4, true);
    if (head.delta != nullptr && threadIdx.x < kBlockK / 4)
      ptx::cp_async_16(s.delta(stage) + threadIdx.x * 4, head.delta + k0 + threadIdx.x * 4, true);
  }

  __device__ static void run(const AttentionMmaParams& p, unsigned char* smem_base) {
    const Smem s{smem_base};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // accumulator fragment: rows g, g+8; columns 2t, 2t+1
    const int q_blocks = static_cast<int>(p.q_padded / kBlockQ);
    // Causal: the heaviest query blocks (most keys) are scheduled first.
    const int qb = kCausal ? q_blocks - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.q_heads / p.kv_heads);
    const int64_t q0 = static_cast<int64_t>(qb) * kBlockQ;

    // ---- Q tile (once) and the first KV tile ----
    const int8_t* qg = p.q_codes + ((static_cast<int64_t>(b) * p.q_heads + h) * p.q_padded + q0) * kHeadDim;
    for (int i = threadIdx.x; i < kBlockQ * kQkChunks; i += kThreads) {
      const int row = i / kQkChunks, chunk = i % kQkChunks;
      ptx::cp_async_16(s.q() + swizzled_offset<kQkChunks>(row, chunk), qg + row * kHeadDim + chunk * 16, true);
    }
    int64_t kv_tiles = (p.kv_len + kBlockK - 1) / kBlockK;
    if constexpr (kCausal) {
      const int64_t last_query = (q0 + kBlockQ < p.q_len ? q0 + kBlockQ : p.q_len) - 1;
      const int64_t needed = last_query / kBlockK + 1;
      kv_tiles = needed < kv_tiles ? needed : kv_tiles;
    }
    const int64_t bhk = static_cast<int64_t>(b) * p.kv_heads + hk;
    const KvHead head{p.k_codes + bhk * p.k_padded * kHeadDim, p.k_scale + bhk * (p.k_padded / kBlockK) * 4,
                      static_cast<const T*>(p.v) + b * p.v_stride_b + hk * p.v_stride_h,
                      p.delta_s != nullptr ? p.delta_s + (static_cast<int64_t>(b) * p.q_heads + h) * p.k_padded
                                           : nullptr};
    // Prologue: Q and tile 0 form the first group, tiles 1 .. kStages-2 one group each.
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < kv_tiles) load_kv_tile(p, s, i, head, static_cast<int64_t>(i) * kBlockK);
      ptx::cp_async_commit();
    }

    // One Q scale per thread: its rows g and g+8 are both in group warp*8 + g (Eq. 8).
    const float q_scale =
        p.q_scale[((static_cast<int64_t>(b) * p.q_heads + h) * q_blocks + qb) * (kWarps * 8) + warp * 8 + g];

    float o[kSlabs][kDimTiles][4];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[sl][n][e] = 0.0f;
    float row_max[kSlabs][2], row_sum[kSlabs][2];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) row_max[sl][r] = -INFINITY, row_sum[sl][r] = 0.0f;

    const int warp_row0 = warp * kRowsPerWarp;
    // The warp's Q fragments (A operands of m16n8k32, one per 32 channels) stay in registers.
    uint32_t qa[kSlabs][kHeadDim / 32][4];
    for (int64_t it = 0; it < kv_tiles; ++it) {
      const int stage = static_cast<int>(it % kStages);
      const int64_t k0 = it * kBlockK;
      ptx::cp_async_wait<kStages - 2>();  // tile `it` (and, first time round, Q) has landed
      __syncthreads();                    // ... for every thread; and stage it-1 is free again
      const int64_t ahead = it + kStages - 1;
      if (ahead < kv_tiles) load_kv_tile(p, s, static_cast<int>(ahead % kStages), head, ahead * kBlockK);
      ptx::cp_async_commit();
      if (it == 0) {
#pragma unroll
        for (int kc = 0; kc < kHeadDim / 32; ++kc)
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl) {
            const int row = warp_row0 + sl * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
            ptx::ldmatrix_x4(qa[sl][kc], s.q() + swizzled_offset<kQkChunks>(row, kc * 2 + lane / 16));
          }
      }

      // ---- S = Q K^T (INT8, exact int32 accumulation) ----
      int32_t acc[kSlabs][kKeyTiles][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[sl][n][e] = 0;
#pragma unroll
      for (int kc = 0; kc < kHeadDim / 32; ++kc) {
#pragma unroll
        for (int np = 0; np < kKeyTiles / 2; ++np) {
          uint32_t bk[4];
          const int key = np * 16 + (lane % 8) + 8 * (lane / 16);
          ptx::ldmatrix_x4(bk, s.k(stage) + swizzled_offset<kQkChunks>(key, kc * 2 + (lane / 8) % 2));
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl) {
            ptx::mma_m16n8k32_s8(acc[sl][2 * np], qa[sl][kc], bk[0], bk[1]);
            ptx::mma_m16n8k32_s8(acc[sl][2 * np + 1], qa[sl][kc], bk[2], bk[3]);
          }
        }
      }

      // ---- dequantize (one scale per thread), Delta-S, masks ----
      // Keys 2t and 2t+1 of every 8 are K group t (Eq. 8), so one K scale per thread too.
      const float scale = q_scale * s.k_scale(stage)[t];
      const bool has_delta = p.delta_s != nullptr;
      const bool needs_mask = k0 + kBlockK > p.kv_len || (kCausal && k0 + kBlockK - 1 > q0 + warp_row0);
      float sc[kSlabs][kKeyTiles][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        const float2 ds = has_delta ? *reinterpret_cast<const float2*>(s.delta(stage) + n * 8 + 2 * t)
                                    : make_float2(0.0f, 0.0f);
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = small_int_to_float(acc[sl][n][e]) * scale + ((e & 1) ? ds.y : ds.x);
            if (needs_mask) {
              const int64_t key = k0 + n * 8 + 2 * t + (e & 1);
              const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * (e >> 1);
              if (key >= p.kv_len || (kCausal && key > query)) x = -INFINITY;
            }
            sc[sl][n][e] = x;
          }
      }

      // ---- online softmax (base 2) ----
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = row_max[sl][r];
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) mx = fmaxf(mx, fmaxf(sc[sl][n][2 * r], sc[sl][n][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          // A row that has seen only masked keys keeps max -inf; exp2 against 0 keeps it at 0.
          const float ref = mx == -INFINITY ? 0.0f : mx;
          const float alpha = ptx::exp2_approx(row_max[sl][r] - ref);
          row_max[sl][r] = mx;
          float sum = 0.0f;
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) {
            sc[sl][n][2 * r] = ptx::exp2_approx(sc[sl][n][2 * r] - ref);
            sc[sl][n][2 * r + 1] = ptx::exp2_approx(sc[sl][n][2 * r + 1] - ref);
            sum += sc[sl][n][2 * r] + sc[sl][n][2 * r + 1];
          }
          row_sum[sl][r] = row_sum[sl][r] * alpha + sum;  // lane-partial; reduced at the end
#pragma unroll
          for (int n = 0; n < kDimTiles; ++n) {
            o[sl][n][2 * r] *= alpha;
            o[sl][n][2 * r + 1] *= alpha;
          }
        }

      // ---- O += P V (fp16/bf16 in, FP32 accumulate). The S fragment of two n8 tiles is the
      // A fragment of m16n8k16, so P goes from registers straight into the MMA. ----
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        uint32_t pa[kSlabs][4];
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          pa[sl][0] = HalfPair<T>::pack(sc[sl][2 * kk][0], sc[sl][2 * kk][1]);
          pa[sl][1] = HalfPair<T>::pack(sc[sl][2 * kk][2], sc[sl][2 * kk][3]);
          pa[sl][2] = HalfPair<T>::pack(sc[sl][2 * kk + 1][0], sc[sl][2 * kk + 1][1]);
          pa[sl][3] = HalfPair<T>::pack(sc[sl][2 * kk + 1][2], sc[sl][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kDimTiles / 2; ++dp) {
          uint32_t bv[4];
          const int key = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
          ptx::ldmatrix_x4_trans(bv, s.v(stage) + swizzled_offset<kVChunks>(key, dp * 2 + lane / 16));
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl) {
            ptx::mma_m16n8k16_f32<HalfPair<T>::kBf16>(o[sl][2 * dp], pa[sl], bv[0], bv[1]);
            ptx::mma_m16n8k16_f32<HalfPair<T>::kBf16>(o[sl][2 * dp + 1], pa[sl], bv[2], bv[3]);
          }
        }
      }
    }

    // ---- epilogue: normalise, write O (and the natural-log LSE) ----
    T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[sl][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * r;
        if (query >= p.q_len) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* row = out + query * p.out_stride_n;
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n)
          *reinterpret_cast<uint32_t*>(row + n * 8 + 2 * t) =
              HalfPair<T>::pack(o[sl][n][2 * r] * inv, o[sl][n][2 * r + 1] * inv);
        if (p.lse != nullptr && t == 0) {
          constexpr float kLn2 = 0.6931471805599453f;
          p.lse[(static_cast<int64_t>(b) * p.q_heads + h) * p.q_len + query] =
              l > 0.0f ? (row_max[sl][r] + __log2f(l)) * kLn2 : -INFINITY;
        }
      }
  }
};

// Two CTAs per SM (a 128-register cap) pay at head_dim 64 (H100, 4K, 64-key tiles: 211 vs 158
// TOPS; with 128-key tiles ptxas spills 40-60 bytes there) and lose at head_dim 128 (235 vs 248
// TOPS; 330-490 bytes spilled).
template <typename T, int kHeadDim, bool kCausal>
__global__ void __launch_bounds__(kMmaWarps * 32, kHeadDim == 64 ? 2 : 1) attention_mma_kernel(const __grid_constant__ AttentionMmaParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  AttentionMmaKernel<T, kHeadDim, kCausal>::run(p, smem);
}

}  // namespace sageattention2
