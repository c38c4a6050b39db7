// attention_mma, INT8 QK + fp16/bf16 PV, fp16 inputs: its 8 kernels (head_dim x causal x Q smoothing).
#include "mma/launch.cuh"

namespace sageattention2 {
template struct AttentionMmaVariant<__half, QkCodes::kInt8, PvOperands::kInput>;
}  // namespace sageattention2
