// Smoothing statistics (paper Fig. 3, step 1): per-channel means over tokens (Q, K, V) and V's
// per-channel range. The data contract they implement is docs/DESIGN.md#smoothing_stats.
//
// One launch covers up to three tensors; its CTAs each reduce a chunk of rows of one
// (tensor, batch, head) "job", and, when a job has several chunks, a second tiny launch folds
// them in a fixed order so the result is the same bit for bit on every run (a job of one chunk,
// up to kStatsSingleChunkRows rows, is written by its CTA).
#pragma once

#include <cstdint>

#include "common/geometry.h"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "preprocess/params.h"
#include "preprocess/rows.cuh"

namespace sageattention2 {

__device__ __forceinline__ int stats_source_of_job(const StatsParams& p, int job) {
  int s = 0;
  while (s + 1 < p.num_sources && job >= p.sources[s + 1].first_job) ++s;
  return s;
}

// Channel d of a job's results from its token sum over `tokens` rows and (V) channel max and min.
__device__ __forceinline__ void write_stats(const StatsSource& src, int job, int d, float sum, float hi, float lo,
                                            int64_t tokens) {
  const int64_t out_base = static_cast<int64_t>(job - src.first_job) * src.view.head_dim;
  const float mean = sum / static_cast<float>(tokens);
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
  const BhndView view = item_view<T>(src.view, b);
  const int head_dim = view.head_dim;
  const RowTiling tiling = row_tiling(head_dim);
  const int row_lane = threadIdx.x / tiling.threads_per_row;
  const int vec = threadIdx.x % tiling.threads_per_row;
  const bool active = row_lane < tiling.rows_per_pass;

  const int64_t row_begin = blockIdx.x * p.rows_per_chunk;
  const int64_t row_end = row_begin + p.rows_per_chunk < view.tokens ? row_begin + p.rows_per_chunk : view.tokens;

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
        raw[j] = r < row_end ? ptx::ld_global_nc_v4(row_ptr<T>(view, b, h, r) + vec * kElemsPerVector)
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
      write_stats(src, job, d, s, hi, lo, view.tokens);
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
  const int64_t tokens = item_tokens(src.view, (job - src.first_job) / src.view.heads);
  const int64_t in_base = static_cast<int64_t>(job) * p.chunks * kMaxHeadDim;
  const int used_chunks = static_cast<int>(ceil_div(tokens, p.rows_per_chunk));

  for (int d = threadIdx.x; d < head_dim; d += kPreprocessThreads) {
    float s = 0.0f, hi = -INFINITY, lo = INFINITY;
    for (int c = 0; c < used_chunks; ++c) {
      s += p.partial_sum[in_base + c * kMaxHeadDim + d];
      if (src.track_range) {
        hi = fmaxf(hi, p.partial_max[in_base + c * kMaxHeadDim + d]);
        lo = fminf(lo, p.partial_min[in_base + c * kMaxHeadDim + d]);
      }
    }
    write_stats(src, job, d, s, hi, lo, tokens);
  }
}

}  // namespace sageattention2
