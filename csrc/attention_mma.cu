// Instantiations and launch of the warp-level attention kernel (no ATen here: see
// preprocess_params.h). The dispatch switch over dtype x head_dim x causal lives here.
#include "attention_mma_kernel.cuh"

namespace sageattention2 {
namespace {

template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch(const AttentionMmaParams& p, cudaStream_t stream) {
  using Kernel = AttentionMmaKernel<T, kHeadDim, kCausal>;
  auto kernel = attention_mma_kernel<T, kHeadDim, kCausal>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>(p.q_padded / kMmaBlockQ), p.q_heads, p.batch);
  kernel<<<grid, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kHeadDim>
cudaError_t launch_causal(const AttentionMmaParams& p, cudaStream_t stream) {
  return p.causal ? launch<T, kHeadDim, true>(p, stream) : launch<T, kHeadDim, false>(p, stream);
}

template <typename T>
cudaError_t launch_head_dim(const AttentionMmaParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_causal<T, 64>(p, stream);
    case 128: return launch_causal<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;  // validated by attention_ops.cpp
  }
}

}  // namespace

cudaError_t launch_attention_mma(const AttentionMmaParams& p, InputDtype dtype, cudaStream_t stream) {
  return dtype == InputDtype::kFloat16 ? launch_head_dim<__half>(p, stream)
                                       : launch_head_dim<__nv_bfloat16>(p, stream);
}

}  // namespace sageattention2
