// The launch of one built variant family of the warp-level kernel: a QK coding x PV operand type
// for one input dtype, over head_dim x causal x Q smoothing. Defined in mma/launch.cuh and
// explicitly instantiated, one family per unit, in mma/instantiations/ (so that nvcc compiles
// the 48 kernels in parallel); mma/launch.cu only calls it.
#pragma once

#include <cuda_runtime_api.h>

#include "mma/params.h"

namespace sageattention2 {

template <typename T, QkCodes kQk, PvOperands kPv>
struct AttentionMmaVariant {
  static cudaError_t launch(const AttentionMmaParams& p, cudaStream_t stream);
};

}  // namespace sageattention2
