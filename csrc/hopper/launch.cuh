// The launch of the Hopper kernel's variants (no ATen here: see preprocess/params.h): its grid
// (persistent or one CTA per work unit) and the switch over head_dim x causal for one input
// dtype (hopper/variant.h). Included by the instantiation units only.
#pragma once

#include "common/launch.cuh"
#include "hopper/kernel.cuh"
#include "hopper/variant.h"

namespace sageattention2 {
namespace wgmma_launch {

template <typename T, int kHeadDim, bool kCausal, bool kFp8Pv, bool kPacked = false>
cudaError_t launch(const AttentionWgmmaParams& p, const CUtensorMap& k_map, const CUtensorMap& v_map,
                   cudaStream_t stream) {
  using Kernel = AttentionWgmmaKernel<T, kHeadDim, kCausal, kFp8Pv, kPacked>;
  constexpr auto kernel = attention_wgmma_kernel<T, kHeadDim, kCausal, kFp8Pv, kPacked>;
  int device = 0, sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = allow_dynamic_smem_once<kernel>(device, Kernel::kSmemBytes);
  if (status == cudaSuccess) status = device_attribute(cudaDevAttrMultiProcessorCount, device, &sms);
  if (status != cudaSuccess) return status;
  // Up to 8 units per SM the grid is persistent (one CTA per SM): there the items are short and
  // their start-up and drain, overlapped with the neighbouring items, weigh most (kernel +7-11 %
  // at 1K). Beyond, a CTA per unit: the hardware's dynamic block scheduling evens out per-item
  // time variation that a static round-robin accumulates (persistent 0.94-1.05x at 4K-16K; A/B
  // in one process, docs/DECISIONS.md#d9).
  // The decision counts units of two Q blocks; a persistent non-causal grid then takes units of
  // one (hopper/tile_scheduler.cuh: the busiest CTA at most one item above the average).
  AttentionWgmmaParams launched = p;
  launched.unit_items = 2;
  auto sc = Kernel::Scheduler::schedule(p.q_len, p.batch, p.q_heads, 2);
  const bool persistent = sc.units <= 8 * static_cast<int64_t>(sms);
  if (persistent && !kCausal) {
    launched.unit_items = 1;
    sc = Kernel::Scheduler::schedule(p.q_len, p.batch, p.q_heads, 1);
  }
  const int64_t units = sc.units, ctas = persistent && units > sms ? sms : units;
  // The scheduler divides unit indices below `units` (FastDivisor: below 2^31; 2^31 units of 128
  // queries would be 2^38 query rows).
  if (units >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  launched.units_per_head = FastDivisor::of(static_cast<uint32_t>(sc.units_per_head));
  launched.q_heads_divisor = FastDivisor::of(static_cast<uint32_t>(p.q_heads));
  launched.group_divisor = FastDivisor::of(static_cast<uint32_t>(p.q_heads / p.kv_heads));
  // After quantize_kv (after_quantize_kv): a programmatic dependent launch, which starts once that
  // grid's last CTAs have started, and waits for its end at griddepcontrol.wait
  // (hopper/kernel.cuh).
  return launch_kernel(kernel, dim3(static_cast<unsigned>(ctas)), dim3(Kernel::kThreads), Kernel::kSmemBytes, stream,
                       p.after_quantize_kv, launched, k_map, v_map);
}

template <typename T, int kHeadDim, bool kFp8Pv>
cudaError_t launch_causal(const AttentionWgmmaParams& p, const CUtensorMap& k_map, const CUtensorMap& v_map,
                          cudaStream_t stream) {
  if (p.packed_items != nullptr) {  // packed items: their own instantiations (validated by the op)
    return p.causal ? launch<T, kHeadDim, true, kFp8Pv, true>(p, k_map, v_map, stream)
                    : launch<T, kHeadDim, false, kFp8Pv, true>(p, k_map, v_map, stream);
  }
  return p.causal ? launch<T, kHeadDim, true, kFp8Pv>(p, k_map, v_map, stream)
                  : launch<T, kHeadDim, false, kFp8Pv>(p, k_map, v_map, stream);
}

template <typename T, bool kFp8Pv>
cudaError_t launch_head_dim(const AttentionWgmmaParams& p, const CUtensorMap& k_map, const CUtensorMap& v_map,
                            cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_causal<T, 64, kFp8Pv>(p, k_map, v_map, stream);
    case 128: return launch_causal<T, 128, kFp8Pv>(p, k_map, v_map, stream);
    case 256:  // FP8 PV only (hopper/geometry.cuh)
      if constexpr (kFp8Pv) return launch_causal<T, 256, kFp8Pv>(p, k_map, v_map, stream);
      return cudaErrorInvalidValue;
    default: return cudaErrorInvalidValue;  // validated by torch/attention_shapes.cpp
  }
}

}  // namespace wgmma_launch

template <typename T, bool kFp8Pv>
cudaError_t AttentionWgmmaVariant<T, kFp8Pv>::launch(const AttentionWgmmaParams& p, const CUtensorMap& k_map,
                                                     const CUtensorMap& v_map, cudaStream_t stream) {
  return wgmma_launch::launch_head_dim<T, kFp8Pv>(p, k_map, v_map, stream);
}

}  // namespace sageattention2
