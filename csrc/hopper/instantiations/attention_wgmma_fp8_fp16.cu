// attention_wgmma, fp16 inputs, FP8 PV: its 12 kernels (head_dim 64, 128, 256 x causal, each also for packed items).
#include "hopper/launch.cuh"

namespace sageattention2 {
template struct AttentionWgmmaVariant<__half, true>;
}  // namespace sageattention2
