// Launch of quantize_kv (no ATen here: see preprocess/params.h): its dtype x QK-type x head_dim
// switch.
#include <type_traits>

#include "common/launch.cuh"
#include "preprocess/quantize_kv_kernel.cuh"

namespace sageattention2 {
namespace {

template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace

cudaError_t launch_quantize_kv(const QuantizeKVParams& p, InputDtype dtype, bool int4, cudaStream_t stream,
                               bool after_smoothing_stats) {
  const dim3 grid(static_cast<unsigned>(p.padded_tokens / p.block_k * (p.has_v ? 2 : 1)), p.k.heads, p.k.batch);
  // K from registers needs no staging tile: only V (if any) does then.
  const size_t smem =
      k_block_in_registers(p) && !p.has_v ? 0 : static_cast<size_t>(p.block_k) * kv_tile_pitch(p.k.head_dim) * 2;
  cudaError_t status = cudaSuccess;
  dispatch_input_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto pick = [&](auto int4_tag) {
      constexpr bool kInt4 = decltype(int4_tag)::value;
      switch (p.k.head_dim) {
        case 64: return quantize_kv_kernel<T, kInt4, 64>;
        case 128: return quantize_kv_kernel<T, kInt4, 128>;
        default: return quantize_kv_kernel<T, kInt4, 0>;
      }
    };
    auto kernel = int4 ? pick(std::true_type{}) : pick(std::false_type{});
    status = allow_dynamic_smem(kernel, smem);
    if (status == cudaSuccess)
      status = launch_kernel(kernel, grid, dim3(kPreprocessThreads), smem, stream, after_smoothing_stats, p);
  });
  return status != cudaSuccess ? status : cudaGetLastError();
}

}  // namespace sageattention2
