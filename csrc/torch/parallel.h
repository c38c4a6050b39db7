// Host interface of the context-parallel ops (docs/DESIGN.md, "Context parallelism").
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace sageattention2 {

// copy_many_(dsts, srcs, by_copy_engine): srcs[i] into dsts[i] for every i in one launch
// (parallel/copy_many.cu), or with by_copy_engine by the copy engines (cudaMemcpy2DAsync: no SM,
// so beside a kernel that holds them all; a pair of too many 2-D copies still by the launch).
// Validation shared by the CUDA and the Meta implementation.
void check_copy_many(at::TensorList dsts, at::TensorList srcs);
void copy_many_cuda(at::TensorList dsts, at::TensorList srcs, bool by_copy_engine);
void copy_many_meta(at::TensorList dsts, at::TensorList srcs, bool by_copy_engine);

// signal_flags_(flags, value) / wait_flags_(flags, value): a one-element int32 tensor each (this
// rank's or, mapped, a peer's); on the current stream, once its work so far is done, every flag set
// to value (after a system-wide fence) / the stream waits until every flag holds value or later.
// Stream memory operations: no SM (the halves' signals beside a kernel that holds every SM).
void check_flags(at::TensorList flags, const char* op);
void signal_flags_cuda(at::TensorList flags, int64_t value);
void wait_flags_cuda(at::TensorList flags, int64_t value);
void signal_flags_meta(at::TensorList flags, int64_t value);
void wait_flags_meta(at::TensorList flags, int64_t value);

// merge_attention_parts(outs, lses, out_nhd): the parts' outputs [B, H, N, D] and LSEs [B, H, N],
// each over its own keys, merged by their LSE into (out, lse) over all of them
// (parallel/merge_parts.cu). Validation shared by the CUDA and the Meta implementation.
void check_merge_parts(at::TensorList outs, at::TensorList lses);
std::tuple<at::Tensor, at::Tensor> merge_parts_cuda(at::TensorList outs, at::TensorList lses, bool out_nhd);
std::tuple<at::Tensor, at::Tensor> merge_parts_meta(at::TensorList outs, at::TensorList lses, bool out_nhd);

}  // namespace sageattention2
