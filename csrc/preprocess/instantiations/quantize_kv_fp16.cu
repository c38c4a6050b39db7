// quantize_kv, fp16 inputs: its 8 kernels (INT8/INT4 K codes x head_dim 64, 128, 256, any other).
#include "preprocess/quantize_kv_launch.cuh"

namespace sageattention2 {
template struct QuantizeKvVariant<__half>;
}  // namespace sageattention2
