// attention_wgmma, fp16 inputs, FP8 PV: its 4 kernels (head_dim x causal).
#include "hopper/launch.cuh"

namespace sageattention2 {
template struct AttentionWgmmaVariant<__half, true>;
}  // namespace sageattention2
