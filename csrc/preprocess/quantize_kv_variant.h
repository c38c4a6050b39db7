// The launch of quantize_kv for one input dtype, over INT8/INT4 K codes x head_dim (64, 128, 256,
// any other). Defined in preprocess/quantize_kv_launch.cuh and explicitly instantiated, one dtype per
// unit, in preprocess/instantiations/ (so that nvcc compiles the 16 kernels in parallel);
// preprocess/quantize_kv.cu only calls it.
#pragma once

#include <cuda_runtime_api.h>

#include "preprocess/params.h"

namespace sageattention2 {

template <typename T>
struct QuantizeKvVariant {
  static cudaError_t launch(const QuantizeKVParams& p, bool int4, cudaStream_t stream, bool after_smoothing_stats);
};

}  // namespace sageattention2
