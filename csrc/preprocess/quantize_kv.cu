// Entry of quantize_kv's launch (no ATen here: see preprocess/params.h): the switch over the input
// dtype, whose launches the units of preprocess/instantiations/ compile.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "preprocess/quantize_kv_variant.h"

namespace sageattention2 {

cudaError_t launch_quantize_kv(const QuantizeKVParams& p, InputDtype dtype, bool int4, cudaStream_t stream,
                               bool after_smoothing_stats) {
  const cudaError_t status =
      dtype == InputDtype::kFloat16
          ? QuantizeKvVariant<__half>::launch(p, int4, stream, after_smoothing_stats)
          : QuantizeKvVariant<__nv_bfloat16>::launch(p, int4, stream, after_smoothing_stats);
  return status != cudaSuccess ? status : cudaGetLastError();
}

}  // namespace sageattention2
