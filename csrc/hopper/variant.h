// The launch of the Hopper kernel for one input dtype and PV tier (kFp8Pv: FP8, else the input
// dtype), over head_dim x causal. Defined in hopper/launch.cuh and explicitly instantiated, one
// dtype x tier per unit, in hopper/instantiations/ (so that nvcc compiles the 16 kernels in
// parallel); hopper/launch.cu only calls it.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime_api.h>

#include "hopper/params.h"

namespace sageattention2 {

template <typename T, bool kFp8Pv>
struct AttentionWgmmaVariant {
  static cudaError_t launch(const AttentionWgmmaParams& p, const CUtensorMap& k_map, const CUtensorMap& v_map,
                            cudaStream_t stream);
};

}  // namespace sageattention2
