// Entry of the warp-level kernel's launches (no ATen here: see preprocess/params.h): the switch
// over the input dtype and the built variant families, whose launches the units of
// mma/instantiations/ compile.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "mma/variant.h"

namespace sageattention2 {
namespace {

// The variants that are built: INT8 QK with either PV, INT4 QK with FP8 PV (the paper's 4-bit
// kernel; INT4 with FP16 PV has no GPU it is the best choice for).
template <typename T>
cudaError_t launch_variant(const AttentionMmaParams& p, cudaStream_t stream) {
  if (p.qk == QkCodes::kInt8 && p.pv == PvOperands::kInput)
    return AttentionMmaVariant<T, QkCodes::kInt8, PvOperands::kInput>::launch(p, stream);
  if (p.qk == QkCodes::kInt8 && p.pv == PvOperands::kFp8)
    return AttentionMmaVariant<T, QkCodes::kInt8, PvOperands::kFp8>::launch(p, stream);
  if (p.qk == QkCodes::kInt4 && p.pv == PvOperands::kFp8)
    return AttentionMmaVariant<T, QkCodes::kInt4, PvOperands::kFp8>::launch(p, stream);
  return cudaErrorInvalidValue;  // validated by torch/attention_shapes.cpp
}

}  // namespace

cudaError_t launch_attention_mma(const AttentionMmaParams& p, InputDtype dtype, cudaStream_t stream) {
  return dtype == InputDtype::kFloat16 ? launch_variant<__half>(p, stream) : launch_variant<__nv_bfloat16>(p, stream);
}

}  // namespace sageattention2
