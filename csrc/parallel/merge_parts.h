// merge_attention_parts: attention over disjoint sets of keys, computed part by part (each with
// its output and natural-log LSE), merged into the attention over all of them in one pass
// (docs/DESIGN.md, "Context parallelism"). Shared by the host (torch/parallel_ops.cpp) and the
// kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/input_dtype.h"
#include "parallel/vector_walk.h"

namespace sageattention2 {

// The ring on 8 ranks merges 8 parts; the parameter block stays well under 4 KB.
inline constexpr int kMergeMaxParts = 8;

// Rows are walked in the merged output's memory order: three outer dimensions (batch, then
// tokens and heads in the order the output is laid out) and 16-byte vectors of 8 channels. Every
// tensor's strides are given in that order: elements for the outputs, floats for the LSEs.
struct MergePartsParams {
  const void* outs[kMergeMaxParts];
  int64_t out_stride[kMergeMaxParts][3];
  const float* lses[kMergeMaxParts];
  int64_t lse_stride[kMergeMaxParts][3];
  void* merged;
  int64_t merged_stride[3];
  float* merged_lse;
  int64_t merged_lse_stride[3];
  VectorWalk walk;  // rows of head_dim / 8 vectors
  int parts = 0;
};

cudaError_t launch_merge_parts(const MergePartsParams& p, InputDtype dtype, int device, cudaStream_t stream);

}  // namespace sageattention2
