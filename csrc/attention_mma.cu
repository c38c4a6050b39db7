// Instantiations and launch of the warp-level attention kernel (no ATen here: see
// preprocess_params.h). The dispatch switch over variant x dtype x head_dim x causal lives here.
#include "attention_mma_kernel.cuh"
#include "launch.cuh"

namespace sageattention2 {
namespace {

template <typename T, int kHeadDim, bool kCausal, bool kSmoothQ, QkCodes kQk, PvOperands kPv>
cudaError_t launch(const AttentionMmaParams& p, cudaStream_t stream) {
  using Kernel = AttentionMmaKernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv>;
  auto kernel = attention_mma_kernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv>;
  if constexpr (kPv == PvOperands::kFp8) {
    // The code the driver picked for this GPU must have the FP8 MMA (sm_89+; archs before it
    // compile the FP8 variants as stubs).
    cudaFuncAttributes attributes;
    const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
    if (status != cudaSuccess) return status;
    if (attributes.binaryVersion < 89) return cudaErrorNotSupported;
  }
  int device = 0, smem_limit = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (status != cudaSuccess) return status;
  if (Kernel::kSmemBytes > smem_limit) return cudaErrorNotSupported;  // INT8 + FP16 PV, hd128, on a 99 KB SM
  status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>((p.q_len + kMmaBlockQ - 1) / kMmaBlockQ), p.q_heads, p.batch);
  return launch_kernel(kernel, grid, dim3(Kernel::kThreads), Kernel::kSmemBytes, stream, p.after_quantize_kv, p);
}

// Q smoothing is a variant, not a runtime test: its Delta-S operand (16 registers a tile at
// head_dim 128) pushed the INT8 + FP16 PV loop, at 255 registers, into spilling.
template <typename T, int kHeadDim, bool kCausal, QkCodes kQk, PvOperands kPv>
cudaError_t launch_smooth_q(const AttentionMmaParams& p, cudaStream_t stream) {
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
    default: return cudaErrorInvalidValue;  // validated by attention_ops.cpp
  }
}

// The variants that are built: INT8 QK with either PV, INT4 QK with FP8 PV (the paper's 4-bit
// kernel; INT4 with FP16 PV has no GPU it is the best choice for).
template <typename T>
cudaError_t launch_variant(const AttentionMmaParams& p, cudaStream_t stream) {
  if (p.qk == QkCodes::kInt8 && p.pv == PvOperands::kInput)
    return launch_head_dim<T, QkCodes::kInt8, PvOperands::kInput>(p, stream);
  if (p.qk == QkCodes::kInt8 && p.pv == PvOperands::kFp8)
    return launch_head_dim<T, QkCodes::kInt8, PvOperands::kFp8>(p, stream);
  if (p.qk == QkCodes::kInt4 && p.pv == PvOperands::kFp8)
    return launch_head_dim<T, QkCodes::kInt4, PvOperands::kFp8>(p, stream);
  return cudaErrorInvalidValue;  // validated by attention_ops.cpp
}

}  // namespace

cudaError_t launch_attention_mma(const AttentionMmaParams& p, InputDtype dtype, cudaStream_t stream) {
  return dtype == InputDtype::kFloat16 ? launch_variant<__half>(p, stream) : launch_variant<__nv_bfloat16>(p, stream);
}

}  // namespace sageattention2
