// The launches of the attention backward (hopper/backward/kernel.cuh): the per-query inputs
// (prepare), the kernel (one CTA per 128 keys of a KV head, 384 threads), dQ's finalize.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/tensor_map.h"
#include "hopper/backward/kernel.cuh"

namespace sageattention2 {

template <typename T, bool kCausal>
static cudaError_t launch_backward(const AttentionBackwardParams& p, int batch, cudaStream_t stream) {
  using Kernel = AttentionBackwardKernel<T, kCausal>;
  auto kernel = attention_backward_wgmma_kernel<T, kCausal>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int blocks = (p.q_len + Kernel::kBlockQ - 1) / Kernel::kBlockQ;
  const int64_t rows = static_cast<int64_t>(batch) * p.heads * p.q_padded;
  attention_backward_prepare_kernel<T><<<static_cast<unsigned>((rows * 16 + 255) / 256), 256, 0, stream>>>(p, rows);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  AttentionBackwardMaps maps;
  const int64_t q_slabs = static_cast<int64_t>(batch) * p.heads, kv_slabs = static_cast<int64_t>(batch) * p.kv_heads;
  // [slabs][rows][128] 16-bit elements (params.h) = [slabs][rows][256] bytes, in boxes of 64 channels x box_rows.
  const auto encode_rows = [](CUtensorMap* map, const void* base, int64_t slabs, int64_t rows, uint32_t box_rows) {
    return encode_byte_map(map, base, 256, static_cast<uint64_t>(rows), static_cast<uint64_t>(slabs), 128, box_rows);
  };
  err = encode_rows(&maps.q, p.q, q_slabs, p.q_len, Kernel::kBlockQ);
  if (err == cudaSuccess) err = encode_rows(&maps.dout, p.dout, q_slabs, p.q_len, Kernel::kBlockQ);
  if (err == cudaSuccess) err = encode_rows(&maps.k, p.k, kv_slabs, p.kv_len, Kernel::kBlockK);
  if (err == cudaSuccess) err = encode_rows(&maps.v, p.v, kv_slabs, p.kv_len, Kernel::kBlockK);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.kv_len + Kernel::kBlockK - 1) / Kernel::kBlockK, p.kv_heads, batch);
  kernel<<<grid, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(p, maps);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
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
