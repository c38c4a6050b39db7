// Key ranges read from a key-padding mask on the GPU, and the poisoning of the items whose mask
// is not one (no ATen here: see preprocess/params.h). The data contract is
// docs/DESIGN.md#key-ranges; why the GPU reads the mask: docs/DECISIONS.md#d43.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>

#include "preprocess/params.h"

namespace sageattention2 {
namespace {

constexpr int kKeyRangeThreads = 256;

__device__ __forceinline__ float mask_value(const bool* m, int64_t i) { return m[i] ? 0.0f : -INFINITY; }
__device__ __forceinline__ float mask_value(const __half* m, int64_t i) { return __half2float(m[i]); }
__device__ __forceinline__ float mask_value(const __nv_bfloat16* m, int64_t i) { return __bfloat162float(m[i]); }
__device__ __forceinline__ float mask_value(const float* m, int64_t i) { return m[i]; }

// Whether two 16-byte vectors of mask values hold the same values (as mask_value reads them:
// bools by truth, floats by value, so -0 equals 0).
template <typename M>
__device__ __forceinline__ bool same_values(const uint4& a, const uint4& b) {
  constexpr int kElems = 16 / sizeof(M);
  const M* x = reinterpret_cast<const M*>(&a);
  const M* y = reinterpret_cast<const M*>(&b);
  bool same = true;
#pragma unroll
  for (int e = 0; e < kElems; ++e) same &= mask_value(x, e) == mask_value(y, e);
  return same;
}

// rows_ok of the rows [row_begin, row_end) against the first, over the keys from `key_begin` on,
// one element per thread and key.
template <typename M>
__device__ __forceinline__ int rows_equal_scalar(const KeyMaskParams& p, const M* base, int key_begin, int row_begin,
                                                int row_end) {
  int ok = 1;
  for (int j = key_begin + threadIdx.x; j < p.keys; j += kKeyRangeThreads) {
    const float v = mask_value(base, static_cast<int64_t>(j) * p.stride_k);
    for (int r = row_begin; r < row_end; ++r)
      ok &= mask_value(base, r * p.stride_r + static_cast<int64_t>(j) * p.stride_k) == v;
  }
  return ok;
}

// CTA (b, chunk) reads batch item b's mask: chunk 0 its first row's keys, which are kept (a bool
// True, an additive 0), whether every value is a kept or a masked one (False; -inf or the
// dtype's lowest: `lowest`), and from them the item's first and end kept key and its smoothing
// sample's stride (ceil(count / sample_tokens) | 1, as sageattn's Python layer computes it);
// every chunk whether its rows (of a mask per query) equal the first. valid[b][0] is 1 where the
// first row keeps one non-empty contiguous range of keys, valid[b][1 + chunk] where the chunk's
// rows equal it: the item's mask is a key-padding mask where all are. An item whose first row is
// not one gets the whole key range (so every launch after reads only keys that exist). The rows
// are spread over CTAs: one CTA per item took 125 us on BERT's [16, 1, 512, 512] mask.
template <typename M>
__global__ void __launch_bounds__(kKeyRangeThreads) key_ranges_of_mask_kernel(const __grid_constant__ KeyMaskParams p) {
  __shared__ int red_first[kKeyRangeThreads], red_last[kKeyRangeThreads], red_count[kKeyRangeThreads];
  __shared__ int red_ok[kKeyRangeThreads], red_rows_ok[kKeyRangeThreads];
  const int b = blockIdx.x, chunk = blockIdx.y;
  const bool first_chunk = chunk == 0;
  const M* base = static_cast<const M*>(p.mask) + (p.mask_batch > 1 ? b * p.stride_b : 0);
  const int row_begin = max(1, chunk * p.rows_per_chunk), row_end = min(p.rows, (chunk + 1) * p.rows_per_chunk);
  int first = INT_MAX, last = -1, count = 0, ok = 1, rows_ok = 1;
  if (first_chunk) {
    for (int j = threadIdx.x; j < p.keys; j += kKeyRangeThreads) {
      const float v = mask_value(base, static_cast<int64_t>(j) * p.stride_k);
      const bool keep = v == 0.0f;
      ok &= keep || v == -INFINITY || v == p.lowest;
      if (keep) {
        first = min(first, j);
        last = j;
        ++count;
      }
    }
  }
  // The other rows against the first: 16-byte loads where the rows allow them (byte loads of a
  // bool [1, 1, 8K, 8K] mask made its call 1138 us against 1018 with the ranges given).
  int scalar_from = 0;
  if (p.vector_rows) {
    constexpr int kElems = 16 / sizeof(M);
    const int vectors = p.keys / kElems;
    for (int jv = threadIdx.x; jv < vectors; jv += kKeyRangeThreads) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(base) + jv);
      for (int r = row_begin; r < row_end; ++r)
        rows_ok &= same_values<M>(__ldg(reinterpret_cast<const uint4*>(base + r * p.stride_r) + jv), v);
    }
    scalar_from = vectors * kElems;
  }
  rows_ok &= rows_equal_scalar(p, base, scalar_from, row_begin, row_end);
  red_first[threadIdx.x] = first;
  red_last[threadIdx.x] = last;
  red_count[threadIdx.x] = count;
  red_ok[threadIdx.x] = ok;
  red_rows_ok[threadIdx.x] = rows_ok;
  __syncthreads();
  for (int half = kKeyRangeThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      red_first[threadIdx.x] = min(red_first[threadIdx.x], red_first[threadIdx.x + half]);
      red_last[threadIdx.x] = max(red_last[threadIdx.x], red_last[threadIdx.x + half]);
      red_count[threadIdx.x] += red_count[threadIdx.x + half];
      red_ok[threadIdx.x] &= red_ok[threadIdx.x + half];
      red_rows_ok[threadIdx.x] &= red_rows_ok[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  int* valid = p.valid + b * (1 + p.chunks);
  valid[1 + chunk] = red_rows_ok[0];
  if (!first_chunk) return;
  first = red_first[0];
  last = red_last[0];
  count = red_count[0];
  const bool one_range = red_ok[0] && count > 0 && last - first + 1 == count;
  const int begin = one_range ? first : 0, end = one_range ? last + 1 : p.keys;
  p.ranges[3 * b] = begin;
  p.ranges[3 * b + 1] = end;
  p.ranges[3 * b + 2] = ((end - begin + p.sample_tokens - 1) / p.sample_tokens) | 1;
  valid[0] = one_range ? 1 : 0;
}

__device__ __forceinline__ void store_nan(__half* x) { *x = __float2half(NAN); }
__device__ __forceinline__ void store_nan(__nv_bfloat16* x) { *x = __float2bfloat16(NAN); }

// NaN over every output row (and LSE) of an item whose mask was not a key-padding mask: one CTA
// per item, which returns at once where it was.
template <typename T>
__global__ void poison_invalid_items_kernel(const __grid_constant__ PoisonParams p) {
  const int b = blockIdx.x;
  bool valid = true;
  for (int i = 0; i < p.valid_per_item; ++i) valid = valid && p.valid[b * p.valid_per_item + i] != 0;
  if (valid) return;
  const int64_t rows = static_cast<int64_t>(p.heads) * p.tokens;
  for (int64_t i = threadIdx.x; i < rows * p.head_dim; i += blockDim.x) {
    const int64_t row = i / p.head_dim;
    const int h = static_cast<int>(row / p.tokens);
    const int64_t n = row % p.tokens;
    store_nan(static_cast<T*>(p.out) + b * p.stride_b + h * p.stride_h + n * p.stride_n + i % p.head_dim);
    if (p.lse != nullptr && i % p.head_dim == 0) p.lse[b * rows + row] = NAN;
  }
}

}  // namespace

cudaError_t launch_key_ranges_of_mask(const KeyMaskParams& p, KeyMaskDtype dtype, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.chunks));
  switch (dtype) {
    case KeyMaskDtype::kBool: key_ranges_of_mask_kernel<bool><<<grid, kKeyRangeThreads, 0, stream>>>(p); break;
    case KeyMaskDtype::kFloat16: key_ranges_of_mask_kernel<__half><<<grid, kKeyRangeThreads, 0, stream>>>(p); break;
    case KeyMaskDtype::kBFloat16:
      key_ranges_of_mask_kernel<__nv_bfloat16><<<grid, kKeyRangeThreads, 0, stream>>>(p);
      break;
    case KeyMaskDtype::kFloat32: key_ranges_of_mask_kernel<float><<<grid, kKeyRangeThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_poison_invalid_items(const PoisonParams& p, InputDtype dtype, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.batch));
  if (dtype == InputDtype::kFloat16) poison_invalid_items_kernel<__half><<<grid, 256, 0, stream>>>(p);
  else poison_invalid_items_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sageattention2
