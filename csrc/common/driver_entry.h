// CUDA driver functions through the runtime's driver entry point (cudaGetDriverEntryPointByVersion,
// CUDA runtime API "Driver Entry Point Access"): the extension does not link against libcuda, whose
// version is the machine's, not the build's. Host code only.
#pragma once

#include <cuda_runtime.h>

namespace sageattention2 {

// The driver's `name` with the ABI of CUDA 12.0's headers (`Fn`, a PFN_..._v* type of
// cudaTypedefs.h), or nullptr where this driver has none. Callers look up once (a static).
template <typename Fn>
Fn driver_entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<Fn>(fn);
}

}  // namespace sageattention2
