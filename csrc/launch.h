// Kernel launch with programmatic dependent launch (CUDA C++ Programming Guide, "Programmatic
// Dependent Launch and Synchronization"; sm_90+): the kernel may be scheduled while the previous
// kernel of the stream finishes its last wave, so its launch latency and its prologue (work that
// does not read the previous kernel's results) overlap that tail. A kernel launched this way
// must call ptx::wait_for_previous_grid() before it reads anything the previous kernel writes
// or writes anything it reads. The chain of one sageattn call (smoothing_stats -> finalize ->
// quantize_kv -> attention_wgmma) left 12 us of gaps between its kernels at 1K (torch.profiler).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

namespace sageattention2 {

template <typename... Params, typename... Args>
cudaError_t launch_overlapping_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                        cudaStream_t stream, Args&&... args) {
  int device = 0, major = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (status != cudaSuccess) return status;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  // Older GPUs: an ordinary launch. SAGEATTN_PDL=0 turns it off (benchmarks: scripts/ab_env.py).
  const char* env = std::getenv("SAGEATTN_PDL");
  config.numAttrs = major >= 9 && !(env != nullptr && env[0] == '0') ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace sageattention2
