// copy_many_: every (source, destination) pair of a call copied by one launch (docs/DESIGN.md,
// "Context parallelism"). Shared by the host (torch/parallel_ops.cpp) and the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fast_divisor.h"

namespace sageattention2 {

// Ulysses on 8 ranks moves q, k and v to every rank: 24 pairs; the parameter block stays under
// the 4 KB that every arch takes without the CUDA 12.1 large-parameter path.
inline constexpr int kCopyManyMaxPairs = 32;
inline constexpr int kCopyManyThreads = 256;

// One pair as rows of 16-byte words: up to three outer dimensions (size 1 where absent), each
// with its own stride on either side, and the last dimension contiguous on both.
struct CopyPair {
  const void* src;
  void* dst;
  int64_t src_stride[3];  // words
  int64_t dst_stride[3];
  uint32_t rows[3];       // sizes of the outer dimensions
  uint32_t row_words;
  uint32_t words;         // rows[0] * rows[1] * rows[2] * row_words, < 2^31
  FastDivisor by_row_words, by_rows2, by_rows1;
};

struct CopyManyParams {
  CopyPair pairs[kCopyManyMaxPairs];
  int num_pairs = 0;
};

cudaError_t launch_copy_many(const CopyManyParams& p, int device, cudaStream_t stream);

}  // namespace sageattention2
