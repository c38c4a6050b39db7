// The Python extension module sageattention2._C. Importing it registers the ops (TORCH_LIBRARY in
// ops.cpp, linked into the same library); it also reports what this build contains, and holds
// sageattn's call cache (torch/call_cache.cpp). Nothing here touches a tensor, so pybind11 alone
// is included (torch/extension.h cost ~30 s of compile time for this one file).
#include <cuda_runtime_api.h>  // CUDART_VERSION
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sstream>
#include <string>
#include <vector>

#ifndef SAGE_ARCH_LIST
#define SAGE_ARCH_LIST ""
#endif

namespace {

// The kernel families of the build, as build_info() reports them: `family` is the name Python
// keys on (sageattention2.ops: *_FAMILY), `description` says what it computes. The
// preprocessing and the warp-level kernels compile for every arch of the build; FP8 MMA exists
// from sm_89 on (the FP8 variants of older archs are stubs); the Hopper kernel has code for
// sm_90a only (other archs compile it empty).
struct KernelFamily {
  const char* family;
  const char* description;
  int min_arch;             // the first sm_XY with code of this family
  const char* only_arch;    // or the one arch with code, when not null
};
constexpr KernelFamily kKernelFamilies[] = {
    {"preprocess", "smoothing_stats, quantize_kv", 0, nullptr},
    {"attention_mma", "INT8 QK, fp16/bf16 PV, mma.sync", 0, nullptr},
    {"attention_mma_fp8", "INT8/INT4 QK, FP8 PV, mma.sync", 89, nullptr},
    {"attention_wgmma", "INT8 QK, FP8 or fp16/bf16 PV, wgmma", 0, "sm_90a"},
};

std::vector<std::string> split_archs(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// {"cuda_version": "13.0", "archs": ["sm_80", ...],
//  "kernels": [{"family": "attention_mma", "description": "...", "archs": ["sm_80", ...]}, ...]}
pybind11::dict build_info() {
  pybind11::dict info;
  const int v = CUDART_VERSION;
  info["cuda_version"] = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  const auto archs = split_archs(SAGE_ARCH_LIST);
  info["archs"] = archs;
  pybind11::list kernels;
  for (const KernelFamily& kernel : kKernelFamilies) {
    std::vector<std::string> built;
    for (const auto& a : archs) {
      const int number = std::stoi(a.substr(a.find('_') + 1));  // "sm_90a" -> 90
      if (kernel.only_arch != nullptr ? a == kernel.only_arch : number >= kernel.min_arch) built.push_back(a);
    }
    pybind11::dict entry;
    entry["family"] = kernel.family;
    entry["description"] = kernel.description;
    entry["archs"] = built;
    kernels.append(entry);
  }
  info["kernels"] = kernels;
  return info;
}

}  // namespace

namespace sageattention2 {
void register_call_cache(pybind11::module_& m);  // torch/call_cache.cpp
}  // namespace sageattention2

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sageattention2 CUDA kernels; the ops live under torch.ops.sageattention2";
  m.def("build_info", &build_info, "CUDA version, archs and kernel families this extension was compiled for");
  sageattention2::register_call_cache(m);
}
