// The Python extension module sageattention2._C. Importing it registers the ops
// (TORCH_LIBRARY in ops.cpp); it also reports what this build contains.
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <sstream>
#include <string>
#include <vector>

#ifndef SAGE_ARCH_LIST
#define SAGE_ARCH_LIST ""
#endif

namespace {

std::vector<std::string> split_archs(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

pybind11::dict build_info() {
  pybind11::dict info;
  const int v = CUDART_VERSION;
  info["cuda_version"] = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  const auto archs = split_archs(SAGE_ARCH_LIST);
  info["archs"] = archs;
  pybind11::dict kernels;
  // The preprocessing and the warp-level kernels compile for every arch of the build; the Hopper
  // kernel has code for sm_90a only (other archs compile it empty).
  kernels["preprocess (smoothing_stats, quantize_kv)"] = archs;
  kernels["attention_mma (INT8 QK, fp16/bf16 PV, mma.sync)"] = archs;
  // FP8 MMA exists from sm_89 on; the FP8 variants of older archs are stubs.
  std::vector<std::string> fp8, hopper;
  for (const auto& a : archs) {
    const std::string digits = a.substr(a.find('_') + 1);
    if (std::stoi(digits) >= 89) fp8.push_back(a);
    if (a == "sm_90a") hopper.push_back(a);
  }
  kernels["attention_mma_fp8 (INT8/INT4 QK, FP8 PV, mma.sync)"] = fp8;
  kernels["attention_wgmma (INT8 QK, FP8 PV, wgmma)"] = hopper;
  info["kernels"] = kernels;
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sageattention2 CUDA kernels; the ops live under torch.ops.sageattention2";
  m.def("build_info", &build_info, "CUDA version and archs this extension was compiled for");
}
