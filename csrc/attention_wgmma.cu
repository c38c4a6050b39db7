// Instantiations and launch of the Hopper attention kernel (no ATen here: see
// preprocess_params.h): the tensor maps of the quantized K and V, and the dtype x head_dim x
// causal switch. The kernel has sm_90a code only; other archs of the build compile it empty.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "attention_wgmma_kernel.cuh"
#include "launch.cuh"

namespace sageattention2 {
namespace {

// cuTensorMapEncodeTiled through the runtime's driver entry point: no link against libcuda.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 3-D byte tensor [outer][rows][inner] read in boxes of [box_rows][box_inner] with the swizzle
// whose span is the box's row (64 or 128 bytes): the layout kmajor_descriptor() describes.
cudaError_t encode_byte_map(CUtensorMap* map, const void* base, uint64_t inner, uint64_t rows, uint64_t outer,
                            uint32_t box_inner, uint32_t box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {inner, rows, outer};
  const cuuint64_t strides[2] = {inner, inner * rows};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {box_inner, box_rows, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapSwizzle swizzle = box_inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T, int kHeadDim, bool kCausal>
cudaError_t launch(const AttentionWgmmaParams& p, const CUtensorMap& k_map, const CUtensorMap& v_map,
                   cudaStream_t stream) {
  using Kernel = AttentionWgmmaKernel<T, kHeadDim, kCausal>;
  auto kernel = attention_wgmma_kernel<T, kHeadDim, kCausal>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::kSmemBytes);
  if (status != cudaSuccess) return status;
  // Up to 8 units per SM the grid is persistent (one CTA per SM): there the items are short and
  // their start-up and drain, overlapped with the neighbouring items, weigh most (+2..10 % at 1K).
  // Beyond, a CTA per unit: the hardware's dynamic block scheduling evens out per-item time
  // variation that a static round-robin accumulates (-2..4 % persistent at 16K; A/B in one
  // process, benchmarks/RESULTS.md).
  int device = 0, sms = 0;
  status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  const int64_t units = Kernel::schedule(p.q_len, p.batch, p.q_heads).units;
  bool persistent = units <= 8 * static_cast<int64_t>(sms);
  if (units > 0x7fffffff) persistent = true;  // gridDim.x's limit
  const int64_t ctas = persistent && units > sms ? sms : units;
  // After quantize_kv (after_quantize_kv): a programmatic dependent launch, which starts once that
  // grid's last CTAs have started, and waits for its end at griddepcontrol.wait
  // (AttentionWgmmaKernel).
  return launch_kernel(kernel, dim3(static_cast<unsigned>(ctas)), dim3(Kernel::kThreads), Kernel::kSmemBytes, stream,
                       p.after_quantize_kv, p, k_map, v_map);
}

template <typename T, int kHeadDim>
cudaError_t launch_causal(const AttentionWgmmaParams& p, const CUtensorMap& k_map, const CUtensorMap& v_map,
                          cudaStream_t stream) {
  return p.causal ? launch<T, kHeadDim, true>(p, k_map, v_map, stream)
                  : launch<T, kHeadDim, false>(p, k_map, v_map, stream);
}

template <typename T>
cudaError_t launch_head_dim(const AttentionWgmmaParams& p, const CUtensorMap& k_map, const CUtensorMap& v_map,
                            cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_causal<T, 64>(p, k_map, v_map, stream);
    case 128: return launch_causal<T, 128>(p, k_map, v_map, stream);
    default: return cudaErrorInvalidValue;  // validated by attention_ops.cpp
  }
}

}  // namespace

cudaError_t launch_attention_wgmma(const AttentionWgmmaParams& p, InputDtype dtype, cudaStream_t stream) {
  const uint64_t heads = static_cast<uint64_t>(p.batch) * p.kv_heads;
  const uint64_t d = static_cast<uint64_t>(p.head_dim), n = static_cast<uint64_t>(p.k_padded);
  CUtensorMap k_map, v_map;
  // K codes [B*Hkv][k_padded][D]: boxes of 128 keys x D bytes. V codes [B*Hkv][D][k_padded]:
  // boxes of D channels x 128 keys.
  cudaError_t status = encode_byte_map(&k_map, p.k_codes, d, n, heads, static_cast<uint32_t>(d), kWgmmaBlockK);
  if (status == cudaSuccess)
    status = encode_byte_map(&v_map, p.v_codes, n, d, heads, kWgmmaBlockK, static_cast<uint32_t>(d));
  if (status != cudaSuccess) return status;
  return dtype == InputDtype::kFloat16 ? launch_head_dim<__half>(p, k_map, v_map, stream)
                                       : launch_head_dim<__nv_bfloat16>(p, k_map, v_map, stream);
}

}  // namespace sageattention2
