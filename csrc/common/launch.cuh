// One kernel launch, optionally as a CUDA programmatic dependent launch (CUDA Programming Guide,
// "Programmatic Dependent Launch and Synchronization"; PTX ISA "griddepcontrol"): the grid may
// start once every CTA of the kernel before it on the stream has executed
// griddepcontrol.launch_dependents (or exited), and must execute griddepcontrol.wait before it
// reads what that kernel writes. Only for a kernel launched right after one of ours by the same
// call, whose own inputs were complete when it started.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

#include "common/input_dtype.h"

namespace sageattention2 {

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Calls fn with a value of the element type that `dtype` names (__half or __nv_bfloat16).
template <typename Fn>
void dispatch_input_dtype(InputDtype dtype, Fn&& fn) {
  if (dtype == InputDtype::kFloat16) fn(__half{});
  else fn(__nv_bfloat16{});
}

}  // namespace sageattention2
