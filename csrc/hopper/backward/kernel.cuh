// The exact attention backward on wgmma (issue 51; opt-in, SAGEATTN_BACKWARD_KERNEL=wgmma): the
// 16-bit tier, head_dim 128, the base of the 8-bit tier (S^T and the dV/dK products in INT8,
// docs/notebook/session-42.md).
//
// FlashAttention-2's backward (Dao 2023, Algorithm 2) with FlashAttention-3's Hopper shape: a CTA
// owns 128 keys of one head (two warpgroups of 64 keys: the accumulators' rows) and walks the Q
// blocks of 64 queries. Per block, each warpgroup computes S^T = K Q^T and dP^T = V dO^T (both
// operands K-major in shared memory), P^T = exp2(S^T scale log2 e - LSE log2 e) and
// dS^T = P^T (dP^T - D) in registers, stores dS^T to shared memory and, once both warpgroups
// have, issues its half of dQ = dS K (A = dS^T read MN-major, i.e. transposed by the descriptor)
// and then dV += P^T dO and dK += dS^T Q with P^T and dS^T as register A operands (the
// accumulator layout is the A fragment's: no shuffle); dQ leaves by vector reductions into an FP32
// buffer while dV and dK are in the tensor cores. dK and dV leave once, at the end; dQ is scaled
// and cast by the finalize kernel.
//
// Warp-specialised as the forward: a producer thread (warpgroup 0, 24 registers) loads K and V
// once and streams each Q block's Q, dO (tensor maps, 128-byte swizzle) and padded LSE and D (bulk
// copies) into a two-stage ring on full/empty mbarriers; the two consumer warpgroups (240
// registers) share one named barrier per block (dS^T, double-buffered). Measured (H200, session
// 44): 5-7 % faster than session 43's version, where every thread issued cp.async copies behind
// two CTA barriers per block; splitting that barrier into an arrive and a sync per warpgroup (dV
// and dK issued before the wait for the other warpgroup's dS^T) gained nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/ptx.cuh"
#include "hopper/backward/params.h"

namespace sageattention2 {

template <typename T, bool kCausal>
struct AttentionBackwardKernel {
  static constexpr int kHeadDim = 128, kBlockK = 128, kBlockQ = 64, kThreads = 384;
  static constexpr int kChunk = 64;          // channels per 128-byte swizzle span
  static constexpr int kChunkBytes = 128;    // the copy engine's views count bytes (params.h)
  static constexpr int kConsumerWarps = 8;
  static constexpr uint32_t kKvBytes = 2 * kBlockK * kHeadDim * 2;
  static constexpr uint32_t kStageBytes = 2 * kBlockQ * kHeadDim * 2 + 2 * kBlockQ * 4;

  // Every tile in chunks of 64 channels, rows of 128 bytes, 128-byte swizzle (16-byte unit u of
  // row r at u ^ (r % 8), the copy engine's SWIZZLE_128B): the K-major operand of one product and
  // the MN-major one of another.
  struct alignas(1024) Smem {
    uint16_t k[kHeadDim / kChunk][kBlockK * kChunk];
    uint16_t v[kHeadDim / kChunk][kBlockK * kChunk];
    uint16_t q[2][kHeadDim / kChunk][kBlockQ * kChunk];
    uint16_t dout[2][kHeadDim / kChunk][kBlockQ * kChunk];
    // dS^T (128 key rows of 64 queries), two buffers: a warpgroup writes block i + 1's rows while
    // the other may still read block i's in its dQ product; one barrier per block orders them.
    uint16_t ds[2][kBlockK * kBlockQ];
    alignas(16) float lse[2][kBlockQ];
    alignas(16) float delta[2][kBlockQ];
    uint64_t kv_full;   // K and V of the CTA's key block
    uint64_t full[2];   // a Q-block stage: Q, dO, LSE, D (the producer's expect_tx)
    uint64_t empty[2];  // a stage read by both warpgroups (one arrival per consumer warp)
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;

  __device__ static int swizzled(int row, int unit) { return row * kChunk + ((unit ^ (row & 7)) * 8); }

  // The CTA's work: 128 keys of one KV head, and the Q blocks of every query head of its group in
  // turn (GQA: dK and dV summed over the group in the accumulators). Causal (q_len == kv_len):
  // queries before the block's first key see none of its keys.
  struct Work {
    int k0, first_block, blocks, iterations;
    int64_t bkv, bh_first;
  };
  __device__ static Work work(const AttentionBackwardParams& p) {
    const int kb = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
    const int group = p.heads / p.kv_heads;
    Work w;
    w.k0 = kb * kBlockK;
    w.first_block = kCausal ? w.k0 / kBlockQ : 0;
    w.blocks = (p.q_len + kBlockQ - 1) / kBlockQ;
    w.iterations = group * (w.blocks > w.first_block ? w.blocks - w.first_block : 0);
    w.bkv = static_cast<int64_t>(b) * p.kv_heads + kv_head;
    w.bh_first = static_cast<int64_t>(b) * p.heads + static_cast<int64_t>(kv_head) * group;
    return w;
  }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // The producer (one thread of warpgroup 0): K and V once, then each Q block's Q and dO (two
  // 64-channel boxes each; rows past q_len land as zeros) and its padded LSE and D (bulk copies)
  // into the two-stage ring.
  __device__ static void produce(const AttentionBackwardParams& p, const AttentionBackwardMaps& maps, Smem& s) {
    const Work w = work(p);
    ptx::prefetch_tensor_map(&maps.q);
    ptx::prefetch_tensor_map(&maps.dout);
    ptx::mbarrier_arrive_expect_tx(&s.kv_full, kKvBytes);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      ptx::tma_load_3d(s.k[c], &maps.k, c * kChunkBytes, w.k0, static_cast<int>(w.bkv), &s.kv_full);
      ptx::tma_load_3d(s.v[c], &maps.v, c * kChunkBytes, w.k0, static_cast<int>(w.bkv), &s.kv_full);
    }
    int qb = w.first_block;
    int64_t bh = w.bh_first;
    for (int it = 0; it < w.iterations; ++it) {
      const int stage = it & 1;
      ptx::mbarrier_wait_sleeping(&s.empty[stage], ((it >> 1) & 1) ^ 1);
      ptx::mbarrier_arrive_expect_tx(&s.full[stage], kStageBytes);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        ptx::tma_load_3d(s.q[stage][c], &maps.q, c * kChunkBytes, qb * kBlockQ, static_cast<int>(bh), &s.full[stage]);
        ptx::tma_load_3d(s.dout[stage][c], &maps.dout, c * kChunkBytes, qb * kBlockQ, static_cast<int>(bh),
                         &s.full[stage]);
      }
      ptx::bulk_load(s.lse[stage], p.lse_log2 + bh * p.q_padded + qb * kBlockQ, kBlockQ * 4, &s.full[stage]);
      ptx::bulk_load(s.delta[stage], p.delta + bh * p.q_padded + qb * kBlockQ, kBlockQ * 4, &s.full[stage]);
      if (++qb == w.blocks) {
        qb = w.first_block;
        ++bh;
      }
    }
  }

  // The descriptors (PTX ISA "Matrix Descriptor Format") are computed once; a step is a constant
  // added to the start address field (bytes >> 4; shared memory is below 256 KB, no carry out):
  // K-major tiles step 32 bytes per k16 inside a chunk and move a chunk for channels 64-127;
  // MN-major tiles step 16 rows of 128 bytes per k16; the Q-block stages are 16 KB apart.
  static constexpr uint64_t kKmajorStep = 32 >> 4, kMnmajorStep = (16 * 128) >> 4;
  static constexpr uint64_t kKChunkStep = (kBlockK * kChunk * 2) >> 4, kQChunkStep = (kBlockQ * kChunk * 2) >> 4;
  static constexpr uint64_t kStageStep = (kHeadDim * kBlockQ * 2) >> 4, kDsStep = (kBlockK * kBlockQ * 2) >> 4;
  __device__ static constexpr uint64_t kmajor_step(int step, uint64_t chunk_step) {
    return (step / 4) * chunk_step + (step % 4) * kKmajorStep;
  }

  // K - k_mean in place, by the 256 consumer threads (16 bytes at a time; element e of 16-byte
  // unit u of row r of chunk c is channel 64 c + 8 (u ^ (r % 8)) + e): the paper's K smoothing
  // (Sec. 3.2) in the backward. dQ = scale dS K loses scale rowsum(dS) k_mean, zero in exact
  // arithmetic but not with the forward's quantized O and LSE (session 40: dQ's CosSim 0.78 on K
  // with channel offsets); S^T on the centered K pairs with the prepare kernel's shifted LSE.
  // Each difference (K in float32 minus the float32 mean) is rounded once to K's dtype, as the
  // center_keys op does it for PyTorch's kernels (_backward._center_keys): one convention.
  __device__ static void center_keys(const AttentionBackwardParams& p, Smem& s, int64_t bkv) {
    const int thread = threadIdx.x - 128;
    // A thread's unit and row % 8 are the same for its 8 vectors: one mean vector per chunk.
    const int channel = ((thread % 8) ^ ((thread / 8) % 8)) * 8;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mean[8];
      load8(p.k_mean + bkv * kHeadDim + c * kChunk + channel, mean);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4* unit = reinterpret_cast<uint4*>(s.k[c]) + thread + 256 * i;
        float key[8];
        widen8<T>(*unit, key);
        *unit = make_uint4(HalfPair<T>::pack(key[0] - mean[0], key[1] - mean[1]),
                           HalfPair<T>::pack(key[2] - mean[2], key[3] - mean[3]),
                           HalfPair<T>::pack(key[4] - mean[4], key[5] - mean[5]),
                           HalfPair<T>::pack(key[6] - mean[6], key[7] - mean[7]));
      }
    }
  }

  // acc = A B^T over the 128 channels, both K-major: 64 key rows (K or V) x 64 query rows (Q or
  // dO), eight k-steps of 16 channels, committed as one group (S^T and dP^T).
  __device__ static void issue_keys_by_queries(float (&acc)[32], uint64_t keys_kmajor, uint64_t queries_kmajor) {
#pragma unroll
    for (int step = 0; step < kHeadDim / 16; ++step)
      ptx::wgmma_m64n64k16_ss<HalfPair<T>::kBf16, 0, 0>(acc, keys_kmajor + kmajor_step(step, kKChunkStep),
                                                        queries_kmajor + kmajor_step(step, kQChunkStep), step > 0);
    ptx::wgmma_commit();
  }

  // A consumer warpgroup (wg 0 or 1): 64 of the block's keys.
  __device__ static void consume(const AttentionBackwardParams& p, Smem& s, int wg) {
    const Work w = work(p);
    const int k0 = w.k0, first_block = w.first_block, blocks = w.blocks, iterations = w.iterations;
    const int64_t bkv = w.bkv;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int key_row = 64 * wg + 16 * warp + g;  // the thread's first key row in the CTA's block (+8)

    const uint64_t k_kmajor = ptx::kmajor_descriptor<128>(s.k[0] + 64 * wg * kChunk);
    const uint64_t v_kmajor = ptx::kmajor_descriptor<128>(s.v[0] + 64 * wg * kChunk);
    const uint64_t q_kmajor = ptx::kmajor_descriptor<128>(s.q[0][0]);
    const uint64_t dout_kmajor = ptx::kmajor_descriptor<128>(s.dout[0][0]);
    const uint64_t q_mnmajor = ptx::mnmajor_descriptor_128b(s.q[0][0], kBlockQ * kChunk * 2);
    const uint64_t dout_mnmajor = ptx::mnmajor_descriptor_128b(s.dout[0][0], kBlockQ * kChunk * 2);
    const uint64_t ds_mnmajor = ptx::mnmajor_descriptor_128b(s.ds[0], kBlockK * kChunk * 2);
    const uint64_t k_mnmajor = ptx::mnmajor_descriptor_128b(s.k[wg], kBlockK * kChunk * 2);
    // Keys past kv_len (the last key block) and, causal, keys after a query (the blocks that
    // straddle the diagonal) get P = 0; the other blocks skip the mask.
    const int key_first = k0 + key_row;
    const bool keys_partial = k0 + kBlockK > p.kv_len;

    float dv[64], dk[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) dv[i] = dk[i] = 0.0f;

    ptx::mbarrier_wait(&s.kv_full, 0);
    center_keys(p, s, bkv);
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync<2 * 128>(1);
    int qb = first_block;
    int64_t bh = w.bh_first;
    for (int it = 0; it < iterations; ++it) {
      const int stage = it & 1, q0 = qb * kBlockQ;
      ptx::mbarrier_wait(&s.full[stage], (it >> 1) & 1);

      // S^T = K Q^T and dP^T = V dO^T: this warpgroup's 64 keys x the block's 64 queries.
      float sacc[32], dpacc[32];
      const uint64_t stage_step = stage * kStageStep;
      ptx::wgmma_fence();
      issue_keys_by_queries(sacc, k_kmajor, q_kmajor + stage_step);
      issue_keys_by_queries(dpacc, v_kmajor, dout_kmajor + stage_step);

      // P^T while dP^T is still in the tensor cores, then dS^T = P^T (dP^T - D) (accumulator
      // element 4j + 2 half + e: key row key_row + 8 half, query column 8j + 2t + e).
      ptx::wgmma_wait<1>();
#pragma unroll
      for (int i = 0; i < 32; ++i) ptx::register_fence(sacc[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 lse = *reinterpret_cast<const float2*>(&s.lse[stage][8 * j + 2 * t]);
#pragma unroll
        for (int k = 0; k < 4; ++k)
          sacc[4 * j + k] = ptx::exp2_approx(sacc[4 * j + k] * p.scale_log2 - (k % 2 ? lse.y : lse.x));
      }
      if (keys_partial || (kCausal && q0 < k0 + kBlockK - 1)) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int key = key_first + 8 * (k / 2), query = q0 + 8 * j + 2 * t + k % 2;
            if (key >= p.kv_len || (kCausal && key > query)) sacc[4 * j + k] = 0.0f;
          }
      }
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 32; ++i) ptx::register_fence(dpacc[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 delta = *reinterpret_cast<const float2*>(&s.delta[stage][8 * j + 2 * t]);
#pragma unroll
        for (int k = 0; k < 4; ++k) dpacc[4 * j + k] = sacc[4 * j + k] * (dpacc[4 * j + k] - (k % 2 ? delta.y : delta.x));
      }

      // dS^T to shared memory (rows: keys; 128 bytes of queries), for dQ's A operand.
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = key_row + 8 * half, col = 8 * j + 2 * t;
          *reinterpret_cast<uint32_t*>(&s.ds[stage][swizzled(row, col / 8) + col % 8]) =
              HalfPair<T>::pack(dpacc[4 * j + 2 * half], dpacc[4 * j + 2 * half + 1]);
        }
      ptx::fence_proxy_async_shared();

      // dV += P^T dO, dK += dS^T Q: A from registers (k-step c: queries 16c .. 16c + 15, the
      // accumulator's n8 tiles 2c and 2c + 1), B = dO / Q MN-major (two chunks of 64 channels).
      uint32_t pa[4][4], da[4][4];
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
          pa[c][reg] = HalfPair<T>::pack(sacc[8 * c + 2 * reg], sacc[8 * c + 2 * reg + 1]);
          da[c][reg] = HalfPair<T>::pack(dpacc[8 * c + 2 * reg], dpacc[8 * c + 2 * reg + 1]);
        }
      ptx::named_barrier_sync<2 * 128>(1);  // both warpgroups' dS^T rows are in shared memory

      // dQ[:, 64 wg .. 64 wg + 63] += dS K over the 128 keys (A = dS, 64 queries x 128 keys, read
      // from dS^T MN-major; B = K's channel chunk wg MN-major, rows: keys) first, then dV and dK:
      // dQ's trip through shared memory to the L2 overlaps their products.
      float qacc[32];
      ptx::wgmma_fence();
#pragma unroll
      for (int step = 0; step < kBlockK / 16; ++step)
        ptx::wgmma_m64n64k16_ss<HalfPair<T>::kBf16, 1, 1>(
            qacc, ds_mnmajor + stage * kDsStep + kMnmajorStep * step, k_mnmajor + kMnmajorStep * step, step > 0);
      ptx::wgmma_commit();
#pragma unroll
      for (int c = 0; c < 4; ++c)
        ptx::wgmma_m64n128k16_input<HalfPair<T>::kBf16>(dv, pa[c], dout_mnmajor + stage_step + kMnmajorStep * c);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        ptx::wgmma_m64n128k16_input<HalfPair<T>::kBf16>(dk, da[c], q_mnmajor + stage_step + kMnmajorStep * c);
      ptx::wgmma_commit();
      ptx::wgmma_wait<1>();
#pragma unroll
      for (int i = 0; i < 32; ++i) ptx::register_fence(qacc[i]);
      // dQ leaves from registers by vector reductions in the L2 (red.v4: 16 bytes, a warp's
      // instruction 512 contiguous bytes) into dq_accum [B, H, Q blocks, 2, 4, 8, 32, 4]: each
      // warp's quarter of the warpgroup's tile in fragment order (float4 j of lane l at 32 j + l),
      // which the finalize kernel puts back in row order. Measured (H200, 16K): 10 % faster than
      // staging the tile in shared memory for one bulk reduction (cp.reduce.async.bulk), whose
      // stores and proxy fence sit between the products.
      float* slice = p.dq_accum + (((bh * blocks + qb) * 2 + wg) * 4 + warp) * 1024 + lane * 4;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        ptx::red_add_v4_f32(slice + 128 * j, qacc[4 * j], qacc[4 * j + 1], qacc[4 * j + 2], qacc[4 * j + 3]);
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        ptx::register_fence(dv[i]);
        ptx::register_fence(dk[i]);
      }
      if (lane == 0) ptx::mbarrier_arrive(&s.empty[stage]);  // the warp is done with the stage
      if (++qb == blocks) {
        qb = first_block;
        ++bh;
      }
    }

    // dK (times the softmax scale) and dV, this warpgroup's 64 keys (accumulator element
    // 4j + 2 half + e: key row key_row + 8 half, channel 8j + 2t + e).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = k0 + key_row + 8 * half;
      if (key >= p.kv_len) continue;
      const int64_t offset = (bkv * p.kv_len + key) * kHeadDim + 2 * t;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dk) + offset + 8 * j) =
            HalfPair<T>::pack(dk[4 * j + 2 * half] * p.scale, dk[4 * j + 2 * half + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dv) + offset + 8 * j) =
            HalfPair<T>::pack(dv[4 * j + 2 * half], dv[4 * j + 2 * half + 1]);
      }
    }
  }

  __device__ static void run(const AttentionBackwardParams& p, const AttentionBackwardMaps& maps,
                             unsigned char* smem_raw) {
    const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
    Smem& s = *reinterpret_cast<Smem*>(base);
    if (threadIdx.x == 0) {
      ptx::mbarrier_init(&s.kv_full, 1);
      for (int i = 0; i < 2; ++i) {
        ptx::mbarrier_init(&s.full[i], 1);  // the producer's arrive.expect_tx
        ptx::mbarrier_init(&s.empty[i], kConsumerWarps);
      }
      ptx::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x < 128) {
      ptx::setmaxnreg_dec<24>();
      if (threadIdx.x == 0) produce(p, maps, s);
    } else {
      ptx::setmaxnreg_inc<240>();
      consume(p, s, threadIdx.x / 128 - 1);
    }
  }
#endif
};

// One CTA per SM: 384 threads, registers rebalanced by setmaxnreg (24 for the producer, 240 for
// the consumers: 128 * 24 + 256 * 240 = 64,512 of 65,536).
template <typename T, bool kCausal>
__global__ void __launch_bounds__(384, 1)
    attention_backward_wgmma_kernel(const __grid_constant__ AttentionBackwardParams p,
                                    const __grid_constant__ AttentionBackwardMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem[];
  AttentionBackwardKernel<T, kCausal>::run(p, maps, smem);
#endif
}


// The backward's per-query inputs, padded to whole Q blocks for its 16-byte copies:
// D = rowsum(dO * O) in float32 and the LSE of the scores on K - k_mean in base 2 (softmax is
// invariant to the shift of a score row by scale q . k_mean: P is unchanged; a row with no key,
// LSE -inf, and the padding get +inf: P = 0). 16 threads per row of 128 channels, 8 each, summed
// by shuffles.
template <typename T>
__global__ void attention_backward_prepare_kernel(const __grid_constant__ AttentionBackwardParams p, int64_t rows) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = thread / 16;
  if (row >= rows) return;  // (a row's 16 threads share a half warp: all leave or none)
  const int64_t bh = row / p.q_padded;
  const int n = static_cast<int>(row % p.q_padded);
  const int64_t bkv = bh / p.heads * p.kv_heads + bh % p.heads / (p.heads / p.kv_heads);
  const int channel = static_cast<int>(thread % 16) * 8;
  float delta = 0.0f, shift = 0.0f;
  if (n < p.q_len) {
    const int64_t offset = (bh * p.q_len + n) * 128 + channel;
    float o[8], d[8], q[8], mean[8];
    widen8<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) + offset), o);
    widen8<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + offset), d);
    widen8<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + offset), q);
    load8(p.k_mean + bkv * 128 + channel, mean);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      delta = fmaf(o[i], d[i], delta);
      shift = fmaf(q[i], mean[i], shift);
    }
  }
  const unsigned half_warp = 0xFFFFu << (threadIdx.x & 16);
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) {
    delta += __shfl_xor_sync(half_warp, delta, offset);
    shift += __shfl_xor_sync(half_warp, shift, offset);
  }
  if (thread % 16 == 0) {
    const float lse = n < p.q_len ? p.lse[bh * p.q_len + n] : -INFINITY;
    p.delta[row] = delta;
    p.lse_log2[row] = lse == -INFINITY ? INFINITY : (lse - p.scale * shift) * 1.4426950408889634f;
  }
}

// dQ = scale x dq_accum, from the backward kernel's fragment order back to rows [B, H, q_len,
// 128] in the input dtype: one thread per float4 (lane l of warp w of warpgroup wg, float4 j of
// a Q block's tile: query row 16 w + l / 4 (+8 for the float4's last two), channel
// 64 wg + 8 j + 2 (l % 4)).
template <typename T>
__global__ void attention_backward_dq_finalize_kernel(const float* __restrict__ dq_accum, T* __restrict__ dq,
                                                      int q_len, int blocks, float scale, int64_t total_float4) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total_float4) return;
  const float4 value = reinterpret_cast<const float4*>(dq_accum)[index];
  const int lane = static_cast<int>(index % 32), j = static_cast<int>((index / 32) % 8);
  const int warp = static_cast<int>((index / 256) % 4), wg = static_cast<int>((index / 1024) % 2);
  const int64_t tile = index / 2048;  // (bh, Q block)
  const int qb = static_cast<int>(tile % blocks);
  const int64_t bh = tile / blocks;
  const int row = qb * 64 + 16 * warp + lane / 4;
  const int64_t column = 64 * wg + 8 * j + 2 * (lane % 4);
  if (row < q_len)
    *reinterpret_cast<uint32_t*>(dq + (bh * q_len + row) * 128 + column) = HalfPair<T>::pack(value.x * scale, value.y * scale);
  if (row + 8 < q_len)
    *reinterpret_cast<uint32_t*>(dq + (bh * q_len + row + 8) * 128 + column) =
        HalfPair<T>::pack(value.z * scale, value.w * scale);
}

}  // namespace sageattention2
