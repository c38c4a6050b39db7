// The launch of quantize_kv's variants for one input dtype (no ATen here: see
// preprocess/params.h): its grid, shared memory and the switch over INT8/INT4 x head_dim
// (preprocess/quantize_kv_variant.h). Included by the instantiation units only.
#pragma once

#include <type_traits>

#include "common/launch.cuh"
#include "preprocess/quantize_kv_kernel.cuh"
#include "preprocess/quantize_kv_variant.h"

namespace sageattention2 {
namespace quantize_kv_launch {

template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace quantize_kv_launch

template <typename T>
cudaError_t QuantizeKvVariant<T>::launch(const QuantizeKVParams& p, bool int4, cudaStream_t stream,
                                         bool after_smoothing_stats) {
  const int64_t grid_tokens = p.packed_items != nullptr ? p.item_padded_tokens : p.padded_tokens;
  const dim3 grid(static_cast<unsigned>(grid_tokens / p.block_k * (p.has_v ? 2 : 1)), p.k.heads, p.k.batch);
  // K from registers needs no staging tile: only V (if any) does then.
  const size_t smem =
      k_block_in_registers(p) && !p.has_v ? 0 : static_cast<size_t>(p.block_k) * kv_tile_pitch(p.k.head_dim) * 2;
  const auto pick = [&](auto int4_tag) {
    constexpr bool kInt4 = decltype(int4_tag)::value;
    switch (p.k.head_dim) {
      case 64: return quantize_kv_kernel<T, kInt4, 64>;
      case 128: return quantize_kv_kernel<T, kInt4, 128>;
      case 256: return quantize_kv_kernel<T, kInt4, 256>;  // the Hopper kernel's largest
      default: return quantize_kv_kernel<T, kInt4, 0>;
    }
  };
  auto kernel = int4 ? pick(std::true_type{}) : pick(std::false_type{});
  cudaError_t status = quantize_kv_launch::allow_dynamic_smem(kernel, smem);
  if (status == cudaSuccess)
    status = launch_kernel(kernel, grid, dim3(kPreprocessThreads), smem, stream, after_smoothing_stats, p);
  return status;
}

}  // namespace sageattention2
