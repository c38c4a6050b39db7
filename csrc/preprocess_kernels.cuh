// Preprocessing kernels (paper Fig. 3, steps 1-3): smoothing statistics, per-thread
// quantization of Q and K, the Delta-S vector, and FP8 V in the layout of the PV MMA.
// The data contract they implement is docs/DESIGN.md.
#pragma once

#include <cstdint>
#include <type_traits>

#include "geometry.h"
#include "preprocess_params.h"
#include "ptx.cuh"
#include "quant_math.cuh"

namespace sageattention2 {

template <typename T>
__device__ __forceinline__ const T* row_ptr(const BhndView& v, int b, int h, int64_t n) {
  return static_cast<const T*>(v.data) + b * v.stride_b + h * v.stride_h + n * v.stride_n;
}

// ---------------------------------------------------------------------------------------------
// Smoothing statistics: per-channel means over tokens (Q, K, V) and V's per-channel range.
// One launch covers up to three tensors; its CTAs each reduce a chunk of rows of one
// (tensor, batch, head) "job", and, when a job has several chunks, a second tiny launch folds
// them in a fixed order so the result is the same bit for bit on every run (a job of one chunk,
// up to kStatsSingleChunkRows rows, is written by its CTA).
// ---------------------------------------------------------------------------------------------


__device__ __forceinline__ int stats_source_of_job(const StatsParams& p, int job) {
  int s = 0;
  while (s + 1 < p.num_sources && job >= p.sources[s + 1].first_job) ++s;
  return s;
}

// Channel d of a job's results from its token sum and (V) channel max and min.
__device__ __forceinline__ void write_stats(const StatsSource& src, int job, int d, float sum, float hi, float lo) {
  const int64_t out_base = static_cast<int64_t>(job - src.first_job) * src.view.head_dim;
  const float mean = sum / static_cast<float>(src.view.tokens);
  if (src.mean_out != nullptr) src.mean_out[out_base + d] = mean;
  if (src.track_range) {
    // max_n |V[n] - m| == max(max_n V - m, m - min_n V) exactly: float subtraction of a
    // constant is monotonic and fl(m - v) == -fl(v - m) under round-to-nearest-even.
    const float shift = src.smooth ? mean : 0.0f;
    src.scale_out[out_base + d] = quant_scale(fmaxf(hi - shift, shift - lo), kFp8E4M3Max);
  }
}

template <typename T>
__global__ void __launch_bounds__(kPreprocessThreads)
    smoothing_stats_partial_kernel(const __grid_constant__ StatsParams p) {
  ptx::griddepcontrol_launch_dependents();  // quantize_kv may start (quantize_kv_kernel)
  __shared__ float red_sum[kPreprocessThreads * kElemsPerVector];
  __shared__ float red_max[kPreprocessThreads * kElemsPerVector];
  __shared__ float red_min[kPreprocessThreads * kElemsPerVector];

  // Sources of equal size interleave head by head (K of a head, then its V), so that the heads
  // read last are read last in both tensors (quantize_kv starts from them: L2 hits).
  const int job = p.jobs_per_source > 0
                      ? static_cast<int>(blockIdx.y) % p.num_sources * p.jobs_per_source +
                            static_cast<int>(blockIdx.y) / p.num_sources
                      : static_cast<int>(blockIdx.y);
  const StatsSource& src = p.sources[stats_source_of_job(p, job)];
  const int local = job - src.first_job;
  const int b = local / src.view.heads, h = local % src.view.heads;
  const int head_dim = src.view.head_dim;
  const RowTiling tiling = row_tiling(head_dim);
  const int row_lane = threadIdx.x / tiling.threads_per_row;
  const int vec = threadIdx.x % tiling.threads_per_row;
  const bool active = row_lane < tiling.rows_per_pass;

  const int64_t row_begin = blockIdx.x * p.rows_per_chunk;
  const int64_t row_end = row_begin + p.rows_per_chunk < src.view.tokens ? row_begin + p.rows_per_chunk : src.view.tokens;

  float sum[8], mx[8], mn[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) sum[i] = 0.0f, mx[i] = -INFINITY, mn[i] = INFINITY;

  if (active) {
    // kBatch rows per thread in flight before any is reduced (memory-level parallelism); the
    // reduction order stays row by row, so results do not depend on the batching.
    constexpr int kBatch = 4;
    const int64_t step = tiling.rows_per_pass;
    for (int64_t r0 = row_begin + row_lane; r0 < row_end; r0 += kBatch * step) {
      uint4 raw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t r = r0 + j * step;
        raw[j] = r < row_end ? ptx::ld_global_nc_v4(row_ptr<T>(src.view, b, h, r) + vec * kElemsPerVector)
                             : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (r0 + j * step >= row_end) break;
        float x[8];
        widen8<T>(raw[j], x);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          sum[i] += x[i];
          mx[i] = fmaxf(mx[i], x[i]);
          mn[i] = fminf(mn[i], x[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int slot = row_lane * head_dim + vec * kElemsPerVector + i;
      red_sum[slot] = sum[i];
      red_max[slot] = mx[i];
      red_min[slot] = mn[i];
    }
  }
  __syncthreads();

  const int64_t out_base = (static_cast<int64_t>(job) * p.chunks + blockIdx.x) * kMaxHeadDim;
  for (int d = threadIdx.x; d < head_dim; d += kPreprocessThreads) {
    float s = 0.0f, hi = -INFINITY, lo = INFINITY;
    for (int lane = 0; lane < tiling.rows_per_pass; ++lane) {  // fixed order: deterministic
      s += red_sum[lane * head_dim + d];
      hi = fmaxf(hi, red_max[lane * head_dim + d]);
      lo = fminf(lo, red_min[lane * head_dim + d]);
    }
    if (p.chunks == 1) {  // the whole job: no fold launch (the finalize kernel's 0 + s == s)
      write_stats(src, job, d, s, hi, lo);
      continue;
    }
    p.partial_sum[out_base + d] = s;
    if (src.track_range) {
      p.partial_max[out_base + d] = hi;
      p.partial_min[out_base + d] = lo;
    }
  }
}

__global__ void __launch_bounds__(kPreprocessThreads)
    smoothing_stats_finalize_kernel(const __grid_constant__ StatsParams p) {
  ptx::griddepcontrol_launch_dependents();  // quantize_kv may start (quantize_kv_kernel)
  const int job = blockIdx.x;
  const StatsSource& src = p.sources[stats_source_of_job(p, job)];
  const int head_dim = src.view.head_dim;
  const int64_t in_base = static_cast<int64_t>(job) * p.chunks * kMaxHeadDim;
  const int used_chunks = static_cast<int>(ceil_div(src.view.tokens, p.rows_per_chunk));

  for (int d = threadIdx.x; d < head_dim; d += kPreprocessThreads) {
    float s = 0.0f, hi = -INFINITY, lo = INFINITY;
    for (int c = 0; c < used_chunks; ++c) {
      s += p.partial_sum[in_base + c * kMaxHeadDim + d];
      if (src.track_range) {
        hi = fmaxf(hi, p.partial_max[in_base + c * kMaxHeadDim + d]);
        lo = fminf(lo, p.partial_min[in_base + c * kMaxHeadDim + d]);
      }
    }
    write_stats(src, job, d, s, hi, lo);
  }
}

// Non-negative floats order like their bit patterns, so a shared-memory atomicMax on the bits
// is an exact (and order-independent, hence deterministic) max of |x|.
__device__ __forceinline__ void atomic_max_abs(unsigned* slot, float abs_value) {
  atomicMax(slot, __float_as_uint(abs_value));
}

// max |x - mean| over the 16-byte vector c of row r of a tile staged in shared memory (`pitch`
// elements per row): the range every quantizer of this file takes, with its mean subtracted.
template <typename T>
__device__ __forceinline__ float vector_absmax(const T* tile, int pitch, int r, int c, const float* mean) {
  float x[8];
  widen8<T>(*reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector), x);
  float a = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) a = fmaxf(a, fabsf(x[e] - mean[c * kElemsPerVector + e]));
  return a;
}

// max |x| of such a vector of fp16 values without a mean, in packed fp16: no arithmetic but the
// sign, so the same value as vector_absmax with a zero mean (HMNMX2 passes over a NaN as fmaxf
// does).
__device__ __forceinline__ float vector_absmax_f16(const __half* tile, int pitch, int r, int c) {
  const uint4 raw = *reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector);
  const __half2* x = reinterpret_cast<const __half2*>(&raw);
  const __half2 m = __hmax2(__hmax2(__habs2(x[0]), __habs2(x[1])), __hmax2(__habs2(x[2]), __habs2(x[3])));
  return fmaxf(__low2float(m), __high2float(m));
}

__device__ __forceinline__ float warp_max(float a) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
  return a;
}

// The two steps of per-thread quantization (paper Eq. 8) over a tile staged in shared memory
// (`pitch` elements per row, `valid` real rows), smoothed by `mean`; `group_of(row)` is the
// scale group of a row (Q: warp slab and row % 8).
template <typename T, typename GroupOf>
__device__ __forceinline__ void tile_group_absmax(const T* tile, int pitch, int valid, int vecs,
                                                  const float* mean, GroupOf group_of, unsigned* group_amax) {
  for (int i = threadIdx.x; i < valid * vecs; i += kPreprocessThreads)
    atomic_max_abs(&group_amax[group_of(i / vecs)], vector_absmax(tile, pitch, i / vecs, i % vecs, mean));
}

// Writes `rows` rows of codes to `dst` (row stride `code_dim` bytes); rows past `valid` are the
// zero padding of the tile.
template <typename T, bool kInt4, typename GroupOf>
__device__ __forceinline__ void store_tile_codes(const T* tile, int pitch, int rows, int valid, int vecs,
                                                 const float* mean, GroupOf group_of, const float* group_inv,
                                                 int8_t* dst, int code_dim) {
  using Codes = IntCodes<kInt4>;
  for (int i = threadIdx.x; i < rows * vecs; i += kPreprocessThreads) {
    const int r = i / vecs, c = i % vecs;
    int8_t* out = dst + static_cast<int64_t>(r) * code_dim + c * Codes::kBytesPer8;
    if (r >= valid) {
      Codes::store_zero(out);
      continue;
    }
    float x[8];
    widen8<T>(*reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] -= mean[c * kElemsPerVector + e];
    Codes::store(out, x, group_inv[group_of(r)]);
  }
}

// ---------------------------------------------------------------------------------------------
// K and V: two CTAs per (KV block, kv head, batch), one per tensor (one tile of shared memory
// each, so an SM holds twice as many CTAs as with both tiles in one: more loads in flight while
// other CTAs quantize). The K CTA smooths K by its token mean, quantizes per thread (4 groups per
// block) and takes the key's exact Delta-S = q_mean . (K_j - k_mean) from the same tile; the V
// CTA smooths V (optional), quantizes it to FP8 per channel (smoothing_stats' scales: the
// warp-level kernels) or with one scale per tile (its own: the Hopper kernel) and writes it
// transposed in the key order of the PV MMA (DESIGN.md).
// ---------------------------------------------------------------------------------------------

// The head_dim of a view: kHeadDim where the launch compiled it in (64, 128: the loops below then
// index with shifts, not divisions), else the view's.
template <int kHeadDim>
__device__ __forceinline__ int head_dim_of(const BhndView& view) {
  return kHeadDim != 0 ? kHeadDim : view.head_dim;
}

// The valid rows of a K or V tile go to shared memory by cp.async, all in flight from the CTA's
// first instructions on (loaded one 16-byte vector at a time, then processed, the launch reached
// 40-50 % of DRAM bandwidth: ncu, B4 H32 N1024-4096).
template <typename T, int kHeadDim>
__device__ __forceinline__ void start_kv_tile_copy(T* tile, const BhndView& view, int b, int h, int64_t row0,
                                                   int valid) {
  const int head_dim = head_dim_of<kHeadDim>(view), vecs = head_dim / kElemsPerVector, pitch = kv_tile_pitch(head_dim);
  for (int i = threadIdx.x; i < valid * vecs; i += kPreprocessThreads) {
    const int r = i / vecs, c = i % vecs;
    ptx::cp_async_16(tile + r * pitch + c * kElemsPerVector, row_ptr<T>(view, b, h, row0 + r) + c * kElemsPerVector,
                     true);
  }
  ptx::cp_async_commit();
}

// Per-CTA channel vectors in shared memory, shared by the K and the V path (a CTA runs one), so
// that six CTAs fit an SM at head_dim 128.
struct KVTileSmem {
  float mean[kMaxHeadDim];
  float aux[kMaxHeadDim];  // K: the group maxima (per warp, or as bits) and inverses; V: the channel inverses
  unsigned tile_amax;      // V with one scale per tile: max |V - mean| (as bits)
};

template <typename T, bool kInt4, int kHeadDim>
__device__ __forceinline__ void quantize_k_tile(const QuantizeKVParams& p, T* tile, KVTileSmem& sm, int kb, int h,
                                                int b) {
  using Codes = IntCodes<kInt4>;
  float* mean = sm.mean;
  unsigned* group_amax = reinterpret_cast<unsigned*>(sm.aux);
  float* group_inv = sm.aux + kKGroupsPerBlock;
  const int head_dim = head_dim_of<kHeadDim>(p.k), vecs = head_dim / kElemsPerVector, pitch = kv_tile_pitch(head_dim);
  const int block_k = p.block_k;
  const int64_t row0 = static_cast<int64_t>(kb) * block_k;
  const int valid = static_cast<int>(p.k.tokens - row0 < block_k ? p.k.tokens - row0 : block_k);
  const int64_t bh = static_cast<int64_t>(b) * p.k.heads + h;
  const int64_t blocks = p.padded_tokens / block_k;

  start_kv_tile_copy<T, kHeadDim>(tile, p.k, b, h, row0, valid);
  ptx::griddepcontrol_wait();  // the means, and every write, after the kernel before (quantize_kv_kernel)
  for (int d = threadIdx.x; d < head_dim; d += kPreprocessThreads)
    mean[d] = p.k_mean != nullptr ? p.k_mean[bh * head_dim + d] : 0.0f;
  if (threadIdx.x < kKGroupsPerBlock) group_amax[threadIdx.x] = 0u;
  ptx::cp_async_wait<0>();
  __syncthreads();

  // The group maxima: a thread keeps its 4 in registers and each warp reduces them before one
  // shared atomic per group (an atomic per 16-byte vector put 16-32 lanes on one address).
  float amax[kKGroupsPerBlock] = {};
  for (int i = threadIdx.x; i < valid * vecs; i += kPreprocessThreads) {
    const float a = vector_absmax(tile, pitch, i / vecs, i % vecs, mean);
    const int group = k_group_of_key(i / vecs);
#pragma unroll
    for (int g = 0; g < kKGroupsPerBlock; ++g) amax[g] = g == group ? fmaxf(amax[g], a) : amax[g];
  }
#pragma unroll
  for (int g = 0; g < kKGroupsPerBlock; ++g) {
    const float group_max = warp_max(amax[g]);
    if (threadIdx.x % 32 == 0) atomic_max_abs(&group_amax[g], group_max);
  }
  __syncthreads();
  const auto k_group = [](int r) { return k_group_of_key(r); };

  if (threadIdx.x < kKGroupsPerBlock) {
    const float scale = quant_scale(__uint_as_float(group_amax[threadIdx.x]), static_cast<float>(Codes::kQmax));
    group_inv[threadIdx.x] = quant_inverse(scale);
    p.k_scales[(bh * blocks + kb) * kKGroupsPerBlock + threadIdx.x] = scale;
  }
  __syncthreads();

  const int code_dim = kInt4 ? head_dim / 2 : head_dim;
  store_tile_codes<T, kInt4>(tile, pitch, block_k, valid, vecs, mean, k_group, group_inv,
                             p.k_codes + (bh * p.padded_tokens + row0) * code_dim, code_dim);

  if (p.q_mean != nullptr) {
    // Delta-S_j = q_mean . gamma(K_j) from the unquantized smoothed key: exact in float32.
    const int group_size = p.q_heads / p.k.heads;
    for (int i = threadIdx.x; i < group_size * block_k; i += kPreprocessThreads) {
      const int hq = h * group_size + i / block_k, r = i % block_k;
      float s = 0.0f;
      if (r < valid) {
        const float* qm = p.q_mean + (static_cast<int64_t>(b) * p.q_heads + hq) * head_dim;
        for (int c = 0; c < vecs; ++c) {
          float x[8];
          widen8<T>(*reinterpret_cast<const uint4*>(tile + r * pitch + c * kElemsPerVector), x);
#pragma unroll
          for (int e = 0; e < 8; ++e) s = fmaf(__ldg(qm + c * kElemsPerVector + e), x[e] - mean[c * kElemsPerVector + e], s);
        }
        s *= p.delta_s_multiplier;
      }
      p.delta_s[(static_cast<int64_t>(b) * p.q_heads + hq) * p.padded_tokens + row0 + r] = s;
    }
  }
}

// K of one 128-key block from registers, for a head_dim known at compile time and no Delta-S
// (sageattn's INT8 paths). Warp w holds rows 16w .. 16w + 15; lane l the 16-byte vector l % kVecs
// of rows 16w + j * kRowsPerPass + l / kVecs. Its values are loaded once and stay in registers,
// each group max is reduced by shuffles and one shared slot per warp, and the codes are written
// from the same registers. Same groups and arithmetic as quantize_k_tile, so the same codes and
// scales bit for bit, without its divisions, second pass over shared memory and shared atomics:
// at B4 H32 N4096 hd128 the K + V launch went from 68 % of the issue slots and 62 % of DRAM
// bandwidth to 57 % and 83 % (ncu; benchmarks/RESULTS.md, session 12).
template <typename T, bool kInt4, int kHeadDim>
__device__ __forceinline__ void quantize_k_block_in_registers(const QuantizeKVParams& p, KVTileSmem& sm, int kb, int h,
                                                              int b) {
  using Codes = IntCodes<kInt4>;
  constexpr int kBlockK = kRegisterKBlock, kWarps = kPreprocessThreads / 32, kWarpRows = kBlockK / kWarps;
  constexpr int kVecs = kHeadDim / kElemsPerVector, kRowsPerPass = 32 / kVecs, kPasses = kWarpRows / kRowsPerPass;
  static_assert(32 % kVecs == 0 && kWarpRows % kRowsPerPass == 0 && kWarpRows % 8 == 0, "lane geometry");
  constexpr int kCodeDim = kInt4 ? kHeadDim / 2 : kHeadDim;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, c = lane % kVecs, sub = lane / kVecs;
  const int64_t row0 = static_cast<int64_t>(kb) * kBlockK;
  const int valid = static_cast<int>(p.k.tokens - row0 < kBlockK ? p.k.tokens - row0 : kBlockK);
  const int64_t bh = static_cast<int64_t>(b) * p.k.heads + h;
  const int first_row = warp * kWarpRows + sub;  // the lane's row of pass 0; pass j adds j * kRowsPerPass

  uint4 raw[kPasses];
  const T* src = row_ptr<T>(p.k, b, h, row0 + first_row) + c * kElemsPerVector;
#pragma unroll
  for (int j = 0; j < kPasses; ++j)
    raw[j] = first_row + j * kRowsPerPass < valid ? ptx::ld_global_nc_v4(src + j * kRowsPerPass * p.k.stride_n)
                                                  : make_uint4(0u, 0u, 0u, 0u);
  ptx::griddepcontrol_wait();  // the means, and every write, after the kernel before (quantize_kv_kernel)
  float mean[kElemsPerVector];
#pragma unroll
  for (int e = 0; e < kElemsPerVector; ++e)
    mean[e] = p.k_mean != nullptr ? __ldg(p.k_mean + bh * kHeadDim + c * kElemsPerVector + e) : 0.0f;

  // Rows of a warp's pass j are keys with (j * kRowsPerPass + sub) % 8 fixed: their K group.
  const auto group_of_pass = [&](int j) { return k_group_of_key(j * kRowsPerPass + sub); };
  float amax[kKGroupsPerBlock] = {};
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    if (first_row + j * kRowsPerPass >= valid) continue;
    float x[kElemsPerVector];
    widen8<T>(raw[j], x);
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) a = fmaxf(a, fabsf(x[e] - mean[e]));
    const int group = group_of_pass(j);
#pragma unroll
    for (int g = 0; g < kKGroupsPerBlock; ++g) amax[g] = g == group ? fmaxf(amax[g], a) : amax[g];
  }
  float* warp_amax = sm.aux;  // [kWarps][kKGroupsPerBlock]
#pragma unroll
  for (int g = 0; g < kKGroupsPerBlock; ++g) {
    const float group_max = warp_max(amax[g]);
    if (lane == 0) warp_amax[warp * kKGroupsPerBlock + g] = group_max;
  }
  __syncthreads();
  float* group_inv = sm.aux + kWarps * kKGroupsPerBlock;
  if (tid < kKGroupsPerBlock) {
    float group_max = 0.0f;
    for (int w = 0; w < kWarps; ++w) group_max = fmaxf(group_max, warp_amax[w * kKGroupsPerBlock + tid]);
    const float scale = quant_scale(group_max, static_cast<float>(Codes::kQmax));
    group_inv[tid] = quant_inverse(scale);
    p.k_scales[(bh * (p.padded_tokens / kBlockK) + kb) * kKGroupsPerBlock + tid] = scale;
  }
  __syncthreads();

  int8_t* dst = p.k_codes + (bh * p.padded_tokens + row0 + first_row) * kCodeDim + c * Codes::kBytesPer8;
#pragma unroll
  for (int j = 0; j < kPasses; ++j) {
    int8_t* out = dst + j * kRowsPerPass * kCodeDim;
    if (first_row + j * kRowsPerPass >= valid) {
      Codes::store_zero(out);  // the block's padding rows
      continue;
    }
    float x[kElemsPerVector];
    widen8<T>(raw[j], x);
#pragma unroll
    for (int e = 0; e < kElemsPerVector; ++e) x[e] -= mean[e];
    Codes::store(out, x, group_inv[group_of_pass(j)]);
  }
}

template <typename T, int kHeadDim>
__device__ __forceinline__ void quantize_v_tile(const QuantizeKVParams& p, T* v_tile, KVTileSmem& sm, int kb, int h,
                                                int b) {
  const int tid = threadIdx.x;
  float* mean = sm.mean;
  float* channel_inv = sm.aux;
  const int head_dim = head_dim_of<kHeadDim>(p.v), pitch = kv_tile_pitch(head_dim);
  const int block_k = p.block_k;
  const int64_t row0 = static_cast<int64_t>(kb) * block_k;
  const int valid = static_cast<int>(p.v.tokens - row0 < block_k ? p.v.tokens - row0 : block_k);
  const int64_t bh = static_cast<int64_t>(b) * p.v.heads + h;

  start_kv_tile_copy<T, kHeadDim>(v_tile, p.v, b, h, row0, valid);
  // The means, and every write, after the kernel before (quantize_kv_kernel); a V tile that
  // needs nothing of it and writes only memory it never touches need not wait.
  if (!(p.v_overlaps_prior_grid && p.v_mean == nullptr && p.v_scale == nullptr)) ptx::griddepcontrol_wait();
  const bool per_tile = p.v_scale == nullptr;
  for (int d = tid; d < head_dim; d += kPreprocessThreads) {
    mean[d] = p.v_mean != nullptr ? p.v_mean[bh * head_dim + d] : 0.0f;
    channel_inv[d] = per_tile ? 0.0f : quant_inverse(p.v_scale[bh * head_dim + d]);
  }
  if (tid == 0) sm.tile_amax = 0u;
  ptx::cp_async_wait<0>();
  __syncthreads();

  // fp16 V without a mean under one scale per tile (sageattn's Hopper path by default) is
  // quantized in packed fp16, with the float path's codes bit for bit: its range is exact in
  // fp16, and so is v * (1 / s), 1 / s being a power of two (v_tile_scale), while the product
  // is a normal fp16 (products below 2^-14 keep their sign and are far under 2^-10, where E4M3
  // rounds to zero, in both paths). 2-3 instructions per element fewer.
  constexpr bool kHalf = std::is_same_v<T, __half>;
  const bool packed = kHalf && per_tile && p.v_mean == nullptr;

  // One scale for the whole tile (the Hopper kernel's V): its range is known once the tile is
  // in shared memory, so V needs no pass over all tokens before this one (issue 4).
  float tile_inv = 0.0f;
  if (per_tile) {
    const int vecs = head_dim / kElemsPerVector;
    float a = 0.0f;
    for (int i = tid; i < valid * vecs; i += kPreprocessThreads) {
      if constexpr (kHalf) {
        if (packed) {
          a = fmaxf(a, vector_absmax_f16(v_tile, pitch, i / vecs, i % vecs));
          continue;
        }
      }
      a = fmaxf(a, vector_absmax(v_tile, pitch, i / vecs, i % vecs, mean));
    }
    a = warp_max(a);
    if (tid % 32 == 0) atomic_max_abs(&sm.tile_amax, a);
    __syncthreads();
    const float scale = v_tile_scale(__uint_as_float(sm.tile_amax));
    tile_inv = quant_inverse(scale);
    if (tid == 0) p.v_tile_scale[bh * (p.padded_tokens / block_k) + kb] = scale;
  }

  // A thread transposes a channel pair (one 32-bit word of each tile row) over a 32-key slab:
  // consecutive lanes take consecutive words, so a warp's reads of one key hit 32 banks. (One
  // channel per thread with the slabs on consecutive lanes read 8 rows 16 keys apart, all in one
  // bank: the launch was shared-memory bound at 91 % of L1 throughput, ncu.) 32 keys make each
  // thread's stores whole 32-byte sectors of its two output rows.
  constexpr int kSlabKeys = 32;
  const int words = head_dim / 2, slabs = block_k / kSlabKeys;
  const bool packed_codes = packed && tile_inv <= 32768.0f;  // 1 / s a normal fp16 (or 0)
  const __half2 packed_inv = __float2half2_rn(tile_inv);
  for (int i = tid; i < words * slabs; i += kPreprocessThreads) {
    const int d = 2 * (i % words), slab = i / words;
    const float mean0 = mean[d], mean1 = mean[d + 1];
    const float inv0 = per_tile ? tile_inv : channel_inv[d], inv1 = per_tile ? tile_inv : channel_inv[d + 1];
    uint32_t codes[2][kSlabKeys / 4];
#pragma unroll
    for (int w = 0; w < kSlabKeys / 4; ++w) {
      if constexpr (kHalf) {
        if (packed_codes) {
          uint32_t key_codes[4];  // per key: channel d's code in the low byte, d + 1's above
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = v_key_of_slot(slab * kSlabKeys + w * 4 + e);
            uint32_t word = key < valid ? *reinterpret_cast<const uint32_t*>(v_tile + key * pitch + d) : 0u;
            const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&word), packed_inv);
            key_codes[e] = ptx::cvt_e4m3x2_rn_satfinite(*reinterpret_cast<const uint32_t*>(&scaled));
          }
          const uint32_t keys01 = key_codes[0] | key_codes[1] << 16, keys23 = key_codes[2] | key_codes[3] << 16;
          codes[0][w] = __byte_perm(keys01, keys23, 0x6420);  // the low bytes: channel d of the 4 keys
          codes[1][w] = __byte_perm(keys01, keys23, 0x7531);
          continue;
        }
      }
      float x[2][4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = v_key_of_slot(slab * kSlabKeys + w * 4 + e);
        x[0][e] = x[1][e] = 0.0f;
        if (key < valid) {
          const uint32_t word = *reinterpret_cast<const uint32_t*>(v_tile + key * pitch + d);
          const T* pair = reinterpret_cast<const T*>(&word);
          x[0][e] = (widen1<T>(pair[0]) - mean0) * inv0;
          x[1][e] = (widen1<T>(pair[1]) - mean1) * inv1;
        }
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) codes[c][w] = pack_e4m3x4(x[c][0], x[c][1], x[c][2], x[c][3]);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint4* out = reinterpret_cast<uint4*>(p.v_codes + (bh * head_dim + d + c) * p.padded_tokens + row0 +
                                            slab * kSlabKeys);
      out[0] = make_uint4(codes[c][0], codes[c][1], codes[c][2], codes[c][3]);
      out[1] = make_uint4(codes[c][4], codes[c][5], codes[c][6], codes[c][7]);
    }
  }
}

// Grid: x = KV blocks (times 2 with V: K and V CTAs of a block adjacent), y = kv heads, z = batch.
// kHeadDim: the head_dim at compile time (64, 128) or 0 (any other, read from the views).
// sageattn's Hopper path launches it as a programmatic dependent of smoothing_stats, and the
// attention kernel as one of it, so that each launch's start and first loads overlap the tail
// of the one before (launch_quantize_kv). Before griddepcontrol.wait a tile function only
// starts loading the caller's K or V, which were complete before smoothing_stats started; the
// means that launch writes, and every write of this one (into memory that may have been freed
// while that launch ran), come after it. Except (v_overlaps_prior_grid) a V tile that needs no
// mean or scale from it, in a call that keeps that launch's tensors alive: it runs whole beside
// smoothing_stats.
template <typename T, bool kInt4, int kHeadDim>
__global__ void __launch_bounds__(kPreprocessThreads)
    quantize_kv_kernel(const __grid_constant__ QuantizeKVParams p) {
  ptx::griddepcontrol_launch_dependents();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);  // [block_k][pitch]
  __shared__ KVTileSmem sm;
  // Blocks run in the reverse order of smoothing_stats' reads, so the first K/V tiles read here
  // are the ones that launch read last, still in L2 (50 MB on the H100: most of K and V at 1K).
  const int per_block = p.has_v ? 2 : 1;
  const int x = gridDim.x - 1 - blockIdx.x;
  const int kb = x / per_block, h = gridDim.y - 1 - blockIdx.y, b = gridDim.z - 1 - blockIdx.z;
  if (x % per_block != 0) {
    quantize_v_tile<T, kHeadDim>(p, tile, sm, kb, h, b);
  } else if constexpr (kHeadDim != 0) {
    if (k_block_in_registers(p)) quantize_k_block_in_registers<T, kInt4, kHeadDim>(p, sm, kb, h, b);
    else quantize_k_tile<T, kInt4, kHeadDim>(p, tile, sm, kb, h, b);
  } else {
    quantize_k_tile<T, kInt4, 0>(p, tile, sm, kb, h, b);
  }
}

}  // namespace sageattention2
