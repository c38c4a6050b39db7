// attention_wgmma, fp16 inputs, 16-bit PV (the accurate tier): its 4 kernels (head_dim x causal).
#include "hopper/launch.cuh"

namespace sageattention2 {
template struct AttentionWgmmaVariant<__half, false>;
}  // namespace sageattention2
