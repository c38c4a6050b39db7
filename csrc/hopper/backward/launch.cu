// The launch of the attention backward kernel
// (hopper/backward/kernel.cuh): one CTA per 128 keys of a head, 256 threads; then dQ's finalize.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "hopper/backward/kernel.cuh"

namespace sageattention2 {

template <typename T, bool kCausal>
static cudaError_t launch_backward(const AttentionBackwardParams& p, int batch, cudaStream_t stream) {
  using Kernel = AttentionBackwardKernel<T, kCausal>;
  auto kernel = attention_backward_wgmma_kernel<T, kCausal>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.kv_len + Kernel::kBlockK - 1) / Kernel::kBlockK, p.heads, batch);
  kernel<<<grid, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int blocks = (p.q_len + Kernel::kBlockQ - 1) / Kernel::kBlockQ;
  const int64_t float4s = static_cast<int64_t>(batch) * p.heads * blocks * 2048;
  attention_backward_dq_finalize_kernel<T><<<static_cast<unsigned>((float4s + 255) / 256), 256, 0, stream>>>(
      p.dq_accum, static_cast<T*>(p.dq), p.q_len, blocks, p.scale, float4s);
  return cudaGetLastError();
}

cudaError_t launch_attention_backward_wgmma(const AttentionBackwardParams& p, bool bf16, bool causal, int batch,
                                            cudaStream_t stream) {
  if (bf16) return causal ? launch_backward<__nv_bfloat16, true>(p, batch, stream)
                          : launch_backward<__nv_bfloat16, false>(p, batch, stream);
  return causal ? launch_backward<__half, true>(p, batch, stream) : launch_backward<__half, false>(p, batch, stream);
}

}  // namespace sageattention2
