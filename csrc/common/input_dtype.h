// The dtype of the caller's tensors (Q, K, V and the output): the one type switch from the host
// side into the kernels' templates.
#pragma once

namespace sageattention2 {

enum class InputDtype { kFloat16, kBFloat16 };

}  // namespace sageattention2
