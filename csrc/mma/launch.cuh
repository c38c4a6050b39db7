// The launch of the warp-level kernel's variants (no ATen here: see preprocess/params.h): its
// shared memory and grid, and the switch over head_dim x causal x Q smoothing inside a family
// (mma/variant.h). Included by the instantiation units only.
#pragma once

#include "common/launch.cuh"
#include "mma/kernel.cuh"
#include "mma/variant.h"

namespace sageattention2 {
namespace mma_launch {

template <typename T, int kHeadDim, bool kCausal, bool kSmoothQ, QkCodes kQk, PvOperands kPv, bool kPacked = false>
cudaError_t launch(const AttentionMmaParams& p, cudaStream_t stream) {
  using Kernel = AttentionMmaKernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv, kPacked>;
  constexpr auto kernel = attention_mma_kernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv, kPacked>;
  int device = 0, smem_limit = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  if constexpr (kPv == PvOperands::kFp8) {
    // The code the driver picked for this GPU must have the FP8 MMA (sm_89+; archs before it
    // compile the FP8 variants as stubs).
    int version = 0;
    status = binary_version_once<kernel>(device, &version);
    if (status != cudaSuccess) return status;
    if (version < 89) return cudaErrorNotSupported;
  }
  status = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device, &smem_limit);
  if (status != cudaSuccess) return status;
  if (Kernel::kSmemBytes > smem_limit) return cudaErrorNotSupported;  // INT8 + FP16 PV, hd128, on a 99 KB SM
  status = allow_dynamic_smem_once<kernel>(device, Kernel::kSmemBytes);
  if (status != cudaSuccess) return status;
  // Packed: one CTA per entry of the sequences' block table (mma/item.cuh) and head.
  const dim3 grid = kPacked ? dim3(static_cast<unsigned>(p.packed_entries), p.q_heads, 1)
                            : dim3(static_cast<unsigned>((p.q_len + kMmaBlockQ - 1) / kMmaBlockQ), p.q_heads, p.batch);
  return launch_kernel(kernel, grid, dim3(Kernel::kThreads), Kernel::kSmemBytes, stream, p.after_quantize_kv, p);
}

// Q smoothing is a variant, not a runtime test: its Delta-S operand (16 registers a tile at
// head_dim 128) pushed the INT8 + FP16 PV loop, at 255 registers, into spilling.
// Packed sequences are a variant too (INT8 QK without Q smoothing only: 16 kernels), which
// leaves the others' code as it was.
template <typename T, int kHeadDim, bool kCausal, QkCodes kQk, PvOperands kPv>
cudaError_t launch_smooth_q(const AttentionMmaParams& p, cudaStream_t stream) {
  if (p.packed_blocks != nullptr) {
    if constexpr (kQk == QkCodes::kInt8) {
      if (p.q_mean == nullptr) return launch<T, kHeadDim, kCausal, false, kQk, kPv, true>(p, stream);
    }
    return cudaErrorInvalidValue;  // validated by torch/attention_shapes.cpp
  }
  return p.q_mean != nullptr ? launch<T, kHeadDim, kCausal, true, kQk, kPv>(p, stream)
                             : launch<T, kHeadDim, kCausal, false, kQk, kPv>(p, stream);
}

template <typename T, int kHeadDim, QkCodes kQk, PvOperands kPv>
cudaError_t launch_causal(const AttentionMmaParams& p, cudaStream_t stream) {
  return p.causal ? launch_smooth_q<T, kHeadDim, true, kQk, kPv>(p, stream)
                  : launch_smooth_q<T, kHeadDim, false, kQk, kPv>(p, stream);
}

template <typename T, QkCodes kQk, PvOperands kPv>
cudaError_t launch_head_dim(const AttentionMmaParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_causal<T, 64, kQk, kPv>(p, stream);
    case 128: return launch_causal<T, 128, kQk, kPv>(p, stream);
    default: return cudaErrorInvalidValue;  // validated by torch/attention_shapes.cpp
  }
}

}  // namespace mma_launch

template <typename T, QkCodes kQk, PvOperands kPv>
cudaError_t AttentionMmaVariant<T, kQk, kPv>::launch(const AttentionMmaParams& p, cudaStream_t stream) {
  return mma_launch::launch_head_dim<T, kQk, kPv>(p, stream);
}

}  // namespace sageattention2
