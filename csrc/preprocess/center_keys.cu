// center_keys (preprocess/params.h): the inputs PyTorch's cuDNN and FlashAttention-2 backward
// kernels take from a forward that smoothed K (_backward). Softmax is invariant to a shift of a
// score row, so the backward runs on K - mean with each row's LSE lowered by scale q . mean: the
// same P and dS, while dQ = scale dS (K - mean) keeps the forward's rowsum(dS) != 0 (its O and
// LSE are quantized) away from K's channel offsets (docs/DECISIONS.md#d51). In PyTorch these were
// a broadcast subtraction, a float32 copy of Q and a GEMV: 1.9 ms of a 16K training step (B4
// H32 hd128, H200, session 45); here one read of K and Q and one write of K.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "common/convert.cuh"
#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "preprocess/rows.cuh"

namespace sageattention2 {
namespace {

inline constexpr int kCenterKeysThreads = 256;
// Rows per lane group and step, loaded before any is used.
inline constexpr int kCenterKeysRowsInFlight = 4;

// A CTA per (slab, chunk of tokens): grid.y walks the slabs (K's heads of each batch item, then
// Q's), grid.x the tokens, so that a row's place needs no division (three 64-bit divisions per
// row kept the first version at 1.8 TB/s, issue-bound: 0.92 ms at B4 H32 N16K hd128, H200).
// One row per lanes_per_row lanes, lane c holding channels 8c .. 8c + 7.
template <typename T>
__global__ void __launch_bounds__(kCenterKeysThreads) center_keys_kernel(const __grid_constant__ CenterKeysParams p) {
  const int lanes = p.lanes_per_row, lane = threadIdx.x % lanes, vecs = p.k.head_dim / kElemsPerVector;
  const int head_dim = p.k.head_dim, rows_per_pass = kCenterKeysThreads / lanes;
  const unsigned row_lanes = (lanes == 32 ? ~0u : (1u << lanes) - 1u) << (threadIdx.x % 32 / lanes * lanes);
  const int k_slabs = p.k.batch * p.k.heads, slabs = k_slabs + p.q.batch * p.q.heads;
  for (int slab = blockIdx.y; slab < slabs; slab += gridDim.y) {
    const bool is_key = slab < k_slabs;
    const BhndView& view = is_key ? p.k : p.q;
    const int bh = is_key ? slab : slab - k_slabs, h = bh % view.heads, b = bh / view.heads;
    const int hk = is_key ? h : h / (p.q.heads / p.k.heads);
    float mean[kElemsPerVector] = {};
    if (lane < vecs) load8(p.k_mean + (static_cast<int64_t>(b) * p.k.heads + hk) * head_dim + lane * kElemsPerVector, mean);
    const T* src = row_ptr<T>(view, b, h, 0) + lane * kElemsPerVector;
    const int64_t out_row0 = static_cast<int64_t>(bh) * view.tokens;  // K's out rows, Q's LSE rows
    for (int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_pass * kCenterKeysRowsInFlight +
                         threadIdx.x / lanes;
         first < view.tokens; first += static_cast<int64_t>(gridDim.x) * rows_per_pass * kCenterKeysRowsInFlight) {
      uint4 raw[kCenterKeysRowsInFlight];
#pragma unroll
      for (int i = 0; i < kCenterKeysRowsInFlight; ++i) {
        const int64_t n = first + i * rows_per_pass;
        raw[i] = n < view.tokens && lane < vecs ? ptx::ld_global_nc_v4(src + n * view.stride_n)
                                                 : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int i = 0; i < kCenterKeysRowsInFlight; ++i) {
        const int64_t n = first + i * rows_per_pass;
        if (n >= view.tokens) break;  // (uniform over the row's lanes)
        float x[kElemsPerVector];
        widen8<T>(raw[i], x);
        if (is_key) {
          if (lane < vecs) {
            uint32_t words[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) words[e] = HalfPair<T>::pack(x[2 * e] - mean[2 * e], x[2 * e + 1] - mean[2 * e + 1]);
            *reinterpret_cast<uint4*>(static_cast<T*>(p.k_centered) + (out_row0 + n) * head_dim +
                                      lane * kElemsPerVector) = make_uint4(words[0], words[1], words[2], words[3]);
          }
        } else {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < kElemsPerVector; ++e) dot = fmaf(x[e], mean[e], dot);
          for (int offset = lanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(row_lanes, dot, offset, lanes);
          if (lane == 0) {
            // A row that sees no key has LSE -inf and P = 0: +inf keeps exp(s - lse) at 0, not NaN.
            const float lse = p.lse[out_row0 + n];
            p.lse_centered[out_row0 + n] = lse == -INFINITY ? INFINITY : lse - p.scale * dot;
          }
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_center_keys(const CenterKeysParams& p, InputDtype dtype, cudaStream_t stream) {
  const int64_t slabs = static_cast<int64_t>(p.k.batch) * p.k.heads + static_cast<int64_t>(p.q.batch) * p.q.heads;
  const int64_t tokens = p.k.tokens > p.q.tokens ? p.k.tokens : p.q.tokens;
  const int64_t rows_per_block = kCenterKeysThreads / p.lanes_per_row * kCenterKeysRowsInFlight;
  const int64_t chunks = (tokens + rows_per_block - 1) / rows_per_block;
  const dim3 grid(static_cast<unsigned>(chunks < (int64_t{1} << 20) ? chunks : (int64_t{1} << 20)),
                  static_cast<unsigned>(slabs < 65535 ? slabs : 65535));
  if (grid.x == 0 || grid.y == 0) return cudaSuccess;
  dispatch_input_dtype(dtype, [&](auto tag) {
    center_keys_kernel<decltype(tag)><<<grid, kCenterKeysThreads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

}  // namespace sageattention2
