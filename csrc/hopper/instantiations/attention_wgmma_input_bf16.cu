// attention_wgmma, bf16 inputs, 16-bit PV (the accurate tier): its 8 kernels (head_dim 64, 128 x causal, each also for packed items).
#include "hopper/launch.cuh"

namespace sageattention2 {
template struct AttentionWgmmaVariant<__nv_bfloat16, false>;
}  // namespace sageattention2
