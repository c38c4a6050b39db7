// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda): the
// tensor maps of the Hopper kernels' copy-engine loads (hopper/launch.cu, hopper/backward/launch.cu).
// Host code only.
#pragma once

#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "common/driver_entry.h"

namespace sageattention2 {

// The encoder, looked up once; nullptr where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto encode = driver_entry_point<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  return encode;
}

// A 3-D byte tensor [outer][rows][inner] read in boxes of [box_rows][box_inner] with the swizzle
// whose span is the box's row (64 or 128 bytes): the layout the kernels' K-major wgmma descriptors
// describe. 16-bit tensors are read as their bytes (rows of 2 x 64 channels in 128-byte boxes: the
// backward's Q, dO, K, V); rows past `rows` read as zeros either way.
inline cudaError_t encode_byte_map(CUtensorMap* map, const void* base, uint64_t inner, uint64_t rows, uint64_t outer,
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

}  // namespace sageattention2
