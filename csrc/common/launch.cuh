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

#include <atomic>
#include <cstdint>
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

// Facts of a device and settings of a kernel on it, asked of the runtime once per device: each
// query costs host time on every call otherwise, and a short sageattn call is host-bound (a tiny
// call's CPU time is several times its GPU time). Devices 0-63; beyond, asked every time.
inline constexpr int kCachedDevices = 64;

// cudaDeviceGetAttribute, cached per (device, attribute) for the attributes launches ask for.
inline cudaError_t device_attribute(cudaDeviceAttr attribute, int device, int* value) {
  static std::atomic<int> sms[kCachedDevices], smem_optin[kCachedDevices];  // 0: not asked yet
  std::atomic<int>* slot = nullptr;
  if (device >= 0 && device < kCachedDevices) {
    if (attribute == cudaDevAttrMultiProcessorCount) slot = &sms[device];
    if (attribute == cudaDevAttrMaxSharedMemoryPerBlockOptin) slot = &smem_optin[device];
  }
  if (slot != nullptr && (*value = slot->load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  const cudaError_t status = cudaDeviceGetAttribute(value, attribute, device);
  if (status == cudaSuccess && slot != nullptr) slot->store(*value, std::memory_order_relaxed);
  return status;
}

// cudaFuncSetAttribute(kKernel, MaxDynamicSharedMemorySize, bytes), once per device (the setting
// belongs to the device's context and stays; every launch of kKernel asks for the same bytes).
template <auto kKernel>
cudaError_t allow_dynamic_smem_once(int device, int bytes) {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = device >= 0 && device < kCachedDevices ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t status = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (status == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return status;
}

// The compute capability (major * 10 + minor) of the code the driver picked for kKernel on a
// device (cudaFuncAttributes::binaryVersion), once per device.
template <auto kKernel>
cudaError_t binary_version_once(int device, int* version) {
  static std::atomic<int> known[kCachedDevices];  // 0: not asked yet
  std::atomic<int>* slot = device >= 0 && device < kCachedDevices ? &known[device] : nullptr;
  if (slot != nullptr && (*version = slot->load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, kKernel);
  if (status != cudaSuccess) return status;
  *version = attributes.binaryVersion;
  if (slot != nullptr) slot->store(*version, std::memory_order_relaxed);
  return cudaSuccess;
}

// Calls fn with a value of the element type that `dtype` names (__half or __nv_bfloat16).
template <typename Fn>
void dispatch_input_dtype(InputDtype dtype, Fn&& fn) {
  if (dtype == InputDtype::kFloat16) fn(__half{});
  else fn(__nv_bfloat16{});
}

}  // namespace sageattention2
