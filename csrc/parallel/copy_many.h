// copy_many_: every (source, destination) pair of a call copied by one launch (docs/DESIGN.md,
// "Context parallelism"). Shared by the host (torch/parallel_ops.cpp) and the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "parallel/vector_walk.h"

namespace sageattention2 {

// Ulysses on 8 ranks moves q, k and v to every rank: 24 pairs; the parameter block stays under
// the 4 KB that every arch takes without the CUDA 12.1 large-parameter path.
inline constexpr int kCopyManyMaxPairs = 32;

// One pair: the walk over its shape, and the strides of its outer dimensions on either side (in
// 16-byte vectors).
struct CopyPair {
  const void* src;
  void* dst;
  int64_t src_stride[3];
  int64_t dst_stride[3];
  VectorWalk walk;
};

struct CopyManyParams {
  CopyPair pairs[kCopyManyMaxPairs];
  int num_pairs = 0;
};

cudaError_t launch_copy_many(const CopyManyParams& p, int device, cudaStream_t stream);

}  // namespace sageattention2
