// Entry of the Hopper kernel's launches (no ATen here: see preprocess/params.h): the tensor maps
// of the quantized K and of V (quantized, or the caller's), and the switch over the PV tier and
// the input dtype, whose launches the units of hopper/instantiations/ compile. The kernel has sm_90a code only; other archs of the build
// compile it empty.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/tensor_map.h"
#include "hopper/variant.h"

namespace sageattention2 {
namespace {

// The caller's 16-bit V [B][Hkv][kv_len][D] through its element strides (a multiple of 8 elements:
// 16 bytes, as the copy engine needs), read in boxes of 64 channels x 128 keys with the 128-byte
// swizzle (the layout mnmajor_descriptor_128b() describes). Keys past kv_len read as zeros.
cudaError_t encode_input_v_map(CUtensorMap* map, const AttentionWgmmaParams& p) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  // Packed items: V's zero-padded copy [1][Hkv][k_padded][D], every item from its code row.
  const int64_t keys = p.packed_items != nullptr ? p.k_padded : p.kv_len;
  const int64_t batch = p.packed_items != nullptr ? 1 : p.batch;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(p.head_dim), static_cast<cuuint64_t>(keys),
                              static_cast<cuuint64_t>(p.kv_heads), static_cast<cuuint64_t>(batch)};
  // A dimension of extent 1 is never stepped over; its stride (any value in a view) becomes the
  // one of contiguous memory, which the encoder accepts.
  const int64_t extents[4] = {p.head_dim, keys, p.kv_heads, batch};
  const int64_t view_strides[3] = {p.v_stride_n, p.v_stride_h, p.v_stride_b};
  cuuint64_t strides[3];
  int64_t inner = 1;  // elements: the previous dimension's extent x stride
  for (int i = 0; i < 3; ++i) {
    const int64_t stride = extents[i + 1] == 1 ? inner * extents[i] : view_strides[i];
    strides[i] = 2 * static_cast<cuuint64_t>(stride);
    inner = stride;
  }
  const cuuint32_t box[4] = {64, kWgmmaBlockK, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(p.v), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_attention_wgmma(const AttentionWgmmaParams& p, InputDtype dtype, cudaStream_t stream) {
  // (Packed items: one slab of codes per KV head, every item's rows in it.)
  const uint64_t heads = static_cast<uint64_t>(p.packed_items != nullptr ? 1 : p.batch) * p.kv_heads;
  const uint64_t d = static_cast<uint64_t>(p.head_dim), n = static_cast<uint64_t>(p.k_padded);
  CUtensorMap k_map, v_map;
  // K codes [B*Hkv][k_padded][D]: boxes of 128 keys x D bytes (head_dim 256: x 128 bytes, two
  // per tile, as a swizzle span is at most 128 bytes). V codes [B*Hkv][D][k_padded]: boxes of D
  // channels x 128 keys; or the caller's V (encode_input_v_map).
  const uint32_t k_box_inner = static_cast<uint32_t>(d < 128 ? d : 128);
  cudaError_t status = encode_byte_map(&k_map, p.k_codes, d, n, heads, k_box_inner, kWgmmaBlockK);
  if (status == cudaSuccess)
    status = p.fp8_pv ? encode_byte_map(&v_map, p.v, n, d, heads, kWgmmaBlockK, static_cast<uint32_t>(d))
                      : encode_input_v_map(&v_map, p);
  if (status != cudaSuccess) return status;
  if (p.fp8_pv)
    return dtype == InputDtype::kFloat16 ? AttentionWgmmaVariant<__half, true>::launch(p, k_map, v_map, stream)
                                         : AttentionWgmmaVariant<__nv_bfloat16, true>::launch(p, k_map, v_map, stream);
  return dtype == InputDtype::kFloat16 ? AttentionWgmmaVariant<__half, false>::launch(p, k_map, v_map, stream)
                                       : AttentionWgmmaVariant<__nv_bfloat16, false>::launch(p, k_map, v_map, stream);
}

}  // namespace sageattention2
