// attention_mma, INT4 QK + FP8 PV, fp16 inputs: its 8 kernels (head_dim x causal x Q smoothing).
#include "mma/launch.cuh"

namespace sageattention2 {
template struct AttentionMmaVariant<__half, QkCodes::kInt4, PvOperands::kFp8>;
}  // namespace sageattention2
