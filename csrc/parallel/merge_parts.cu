// merge_attention_parts (parallel/merge_parts.h). Attention split over disjoint sets of keys
// (sageattn's bottom-right split, sageattn_varlen's, context parallelism's ring) merges its parts
// by their LSE. By PyTorch ops in float32 (a float32 copy, exp, weights, two products, a sum, the
// cast back) two parts of a Wan block's ring on 2 ranks (16K queries, 12 heads) took 0.52-0.60 ms
// on the H200; one pass, reading each part once and writing the result once, takes 0.094
// (session 47).
//
// The arithmetic is _execute.merge_by_lse's, folded over the parts in order: top = the largest
// LSE (0 where every part has -inf: the row sees no key), w_p = exp(lse_p - top), total = sum of
// w_p, out = sum of out_p * (w_p / total) (total 0: out 0), lse = top + log(total). Products and
// sums are rounded separately (no fused multiply-add), so two parts give merge_by_lse's bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/convert.cuh"
#include "common/launch.cuh"
#include "common/ptx.cuh"
#include "parallel/merge_parts.h"

namespace sageattention2 {
namespace {

template <typename T>
__global__ void __launch_bounds__(kVectorWalkThreads) merge_parts_kernel(const __grid_constant__ MergePartsParams p) {
  const uint32_t step = gridDim.x * kVectorWalkThreads;  // (i + step < 2^32: both are < 2^31)
  for (uint32_t i = blockIdx.x * kVectorWalkThreads + threadIdx.x; i < p.walk.vectors; i += step) {
    const VectorWalk::Place at = p.walk.place(i);
    float lse[kMergeMaxParts];
    float top = -INFINITY;
#pragma unroll
    for (int part = 0; part < kMergeMaxParts; ++part) {
      if (part < p.parts) {
        lse[part] = p.lses[part][at.row(p.lse_stride[part])];
        top = fmaxf(top, lse[part]);
      }
    }
    if (isinf(top) && top < 0.f) top = 0.f;
    float weight[kMergeMaxParts];
    float total = 0.f;
#pragma unroll
    for (int part = 0; part < kMergeMaxParts; ++part) {
      if (part < p.parts) {
        weight[part] = expf(__fsub_rn(lse[part], top));
        total = __fadd_rn(total, weight[part]);
      }
    }
    const float divisor = total > 0.f ? total : 1.f;
    float merged[8];
#pragma unroll
    for (int part = 0; part < kMergeMaxParts; ++part) {
      if (part < p.parts) {
        const T* row = static_cast<const T*>(p.outs[part]) + at.row(p.out_stride[part]);
        float values[8];
        widen8<T>(ptx::ld_global_nc_v4(row + at.vector * 8), values);
        const float w = __fdiv_rn(weight[part], divisor);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const float term = __fmul_rn(values[c], w);
          merged[c] = part == 0 ? term : __fadd_rn(merged[c], term);
        }
      }
    }
    uint4 packed;
    packed.x = HalfPair<T>::pack(merged[0], merged[1]);
    packed.y = HalfPair<T>::pack(merged[2], merged[3]);
    packed.z = HalfPair<T>::pack(merged[4], merged[5]);
    packed.w = HalfPair<T>::pack(merged[6], merged[7]);
    *reinterpret_cast<uint4*>(static_cast<T*>(p.merged) + at.row(p.merged_stride) + at.vector * 8) = packed;
    if (at.vector == 0) {
      p.merged_lse[at.row(p.merged_lse_stride)] = __fadd_rn(top, logf(total));
    }
  }
}

}  // namespace

cudaError_t launch_merge_parts(const MergePartsParams& p, InputDtype dtype, int device, cudaStream_t stream) {
  if (p.walk.vectors == 0) return cudaSuccess;
  int sms = 0;
  if (const cudaError_t status = device_attribute(cudaDevAttrMultiProcessorCount, device, &sms);
      status != cudaSuccess) {
    return status;
  }
  const dim3 grid(vector_walk_ctas(p.walk.vectors, sms, 1));
  return dtype == InputDtype::kFloat16
             ? launch_kernel(merge_parts_kernel<__half>, grid, dim3(kVectorWalkThreads), 0, stream, false, p)
             : launch_kernel(merge_parts_kernel<__nv_bfloat16>, grid, dim3(kVectorWalkThreads), 0, stream, false, p);
}

}  // namespace sageattention2
