// The context-parallel ops' validation and implementations (torch/parallel.h).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudaTypedefs.h>  // PFN_cuStreamWriteValue32, PFN_cuStreamWaitValue32

#include <algorithm>
#include <cstdint>
#include <utility>

#include "common/driver_entry.h"
#include "parallel/copy_many.h"
#include "parallel/merge_parts.h"
#include "torch/parallel.h"

namespace sageattention2 {
namespace {

constexpr int64_t kWordBytes = 16;
constexpr int64_t kMaxWords = int64_t{1} << 31;

// [first byte, one past the last byte] that a strided view touches.
std::pair<uintptr_t, uintptr_t> byte_extent(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// (An empty tensor touches no byte: Ulysses' empty shards and a rank's empty share of heads.)
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = byte_extent(a);
  const auto [b0, b1] = byte_extent(b);
  return a0 < b1 && b0 < a1;
}

}  // namespace

// SymInt-aware: the Meta implementation runs it under dynamic shapes (torch.compile, opcheck).
void check_copy_many(at::TensorList dsts, at::TensorList srcs) {
  TORCH_CHECK(dsts.size() == srcs.size(), "copy_many_: dsts and srcs must be lists of the same length, got ",
              dsts.size(), " and ", srcs.size());
  TORCH_CHECK(dsts.size() <= static_cast<size_t>(kCopyManyMaxPairs), "copy_many_ takes at most ",
              kCopyManyMaxPairs, " pairs, got ", dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor &dst = dsts[i], &src = srcs[i];
    TORCH_CHECK(dst.sym_sizes() == src.sym_sizes() && dst.scalar_type() == src.scalar_type(), "copy_many_: dsts[", i,
                "] and srcs[", i, "] must have the same shape and dtype, got ", dst.sym_sizes(), " ", dst.scalar_type(),
                " and ", src.sym_sizes(), " ", src.scalar_type());
    TORCH_CHECK(dst.dim() >= 1 && dst.dim() <= 4, "copy_many_: pair ", i, " must have 1 to 4 dimensions, got ",
                dst.dim());
    TORCH_CHECK(dst.device() == dsts[0].device() && src.device() == dsts[0].device(), "copy_many_: pair ", i,
                " must be on ", dsts[0].device(), " (every tensor on one device), got ", dst.device(), " and ",
                src.device());
    const int64_t elem = dst.element_size();
    for (const at::Tensor* t : {&dst, &src}) {
      const char* name = t == &dst ? "dsts" : "srcs";
      TORCH_CHECK(t->sym_stride(-1) == 1 && (t->sym_size(-1) * elem) % kWordBytes == 0, "copy_many_: ", name, "[", i,
                  "] must have a contiguous last dimension of a multiple of 16 bytes (the kernel moves 16-byte "
                  "words), got size ", t->sym_size(-1), " stride ", t->sym_stride(-1));
      for (int64_t d = 0; d + 1 < t->dim(); ++d) {
        TORCH_CHECK((t->sym_stride(d) * elem) % kWordBytes == 0, "copy_many_: ", name, "[", i, "]'s stride ", d,
                    " must be a multiple of 16 bytes, got ", t->sym_stride(d) * elem, " bytes");
      }
    }
    TORCH_CHECK(dst.sym_numel() * elem / kWordBytes < kMaxWords, "copy_many_: pair ", i, " has ",
                dst.sym_numel() * elem, " bytes; at most 32 GiB a pair");
  }
}

void copy_many_meta(at::TensorList dsts, at::TensorList srcs, bool /*by_copy_engine*/) {
  check_copy_many(dsts, srcs);
}

namespace {

// A pair by the copy engines: the trailing dimensions contiguous on both sides form one run of
// bytes, the dimension before them the rows of one cudaMemcpy2DAsync (each side its own pitch),
// and the dimensions before that are walked here, a 2-D copy each. Past this many 2-D copies a
// pair goes to the kernel instead (a view of HND memory by token rows would be one per token).
constexpr int64_t kEngineCopiesPerPair = 64;

struct EngineCopy {
  int64_t run_dim;  // the run is dimensions [run_dim, dim); the rows, dimension run_dim - 1 if any
  int64_t copies;   // 2-D copies: the product of the sizes before the rows
};

EngineCopy engine_copy_of(const at::Tensor& dst, const at::Tensor& src) {
  int64_t d = dst.dim() - 1, run = dst.size(d);
  while (d > 0 && (dst.size(d - 1) == 1 || (dst.stride(d - 1) == run && src.stride(d - 1) == run))) {
    run *= dst.size(d - 1);
    --d;
  }
  int64_t copies = 1;
  for (int64_t i = 0; i + 1 < d; ++i) copies *= dst.size(i);
  if (d > 0 && (dst.stride(d - 1) < run || src.stride(d - 1) < run)) {
    copies = kEngineCopiesPerPair + 1;  // rows closer than a run (overlapping reads): the kernel's
  }
  return {d, copies};
}

void copy_by_engine(const at::Tensor& dst, const at::Tensor& src, const EngineCopy& how, cudaStream_t stream) {
  const int64_t elem = dst.element_size(), rows_dim = how.run_dim - 1;
  int64_t width = elem;
  for (int64_t d = how.run_dim; d < dst.dim(); ++d) width *= dst.size(d);
  const int64_t rows = rows_dim >= 0 ? dst.size(rows_dim) : 1;
  const int64_t dst_pitch = rows_dim >= 0 ? dst.stride(rows_dim) * elem : width;
  const int64_t src_pitch = rows_dim >= 0 ? src.stride(rows_dim) * elem : width;
  auto* const dst_base = static_cast<char*>(dst.data_ptr());
  const auto* const src_base = static_cast<const char*>(src.data_ptr());
  for (int64_t copy = 0; copy < how.copies; ++copy) {
    int64_t dst_offset = 0, src_offset = 0, rest = copy;
    for (int64_t d = rows_dim - 1; d >= 0; --d) {
      const int64_t index = rest % dst.size(d);
      rest /= dst.size(d);
      dst_offset += index * dst.stride(d) * elem;
      src_offset += index * src.stride(d) * elem;
    }
    C10_CUDA_CHECK(cudaMemcpy2DAsync(dst_base + dst_offset, dst_pitch, src_base + src_offset, src_pitch, width, rows,
                                     cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace

void copy_many_cuda(at::TensorList dsts, at::TensorList srcs, bool by_copy_engine) {
  check_copy_many(dsts, srcs);
  if (dsts.empty()) return;
  TORCH_CHECK(dsts[0].is_cuda(), "copy_many_: the tensors must be CUDA tensors, got ", dsts[0].device());
  CopyManyParams p;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor &dst = dsts[i], &src = srcs[i];
    for (const at::Tensor* t : {&dst, &src}) {
      TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % kWordBytes == 0, "copy_many_: ",
                  t == &dst ? "dsts[" : "srcs[", i, "] must start at a 16-byte aligned address");
    }
    for (size_t j = 0; j < dsts.size(); ++j) {
      TORCH_CHECK(!overlap(src, dsts[j]), "copy_many_: srcs[", i, "] overlaps dsts[", j, "]");
      TORCH_CHECK(j >= i || !overlap(dst, dsts[j]), "copy_many_: dsts[", i, "] overlaps dsts[", j, "]");
    }
    if (dst.numel() == 0) continue;
    if (by_copy_engine) {
      if (const EngineCopy how = engine_copy_of(dst, src); how.copies <= kEngineCopiesPerPair) {
        const c10::cuda::CUDAGuard guard(dst.device());
        copy_by_engine(dst, src, how, at::cuda::getCurrentCUDAStream());
        continue;
      }
    }
    const int64_t elem = dst.element_size(), outer = dst.dim() - 1;
    CopyPair& pair = p.pairs[p.num_pairs++];
    pair.src = src.data_ptr();
    pair.dst = dst.data_ptr();
    uint32_t rows[3];
    for (int d = 0; d < 3; ++d) {  // outer dimensions right-aligned; the missing ones of size 1
      const int64_t source_dim = d - (3 - outer);
      rows[d] = source_dim < 0 ? 1u : static_cast<uint32_t>(dst.size(source_dim));
      pair.src_stride[d] = source_dim < 0 ? 0 : src.stride(source_dim) * elem / kWordBytes;
      pair.dst_stride[d] = source_dim < 0 ? 0 : dst.stride(source_dim) * elem / kWordBytes;
    }
    pair.walk = VectorWalk::of(rows[0], rows[1], rows[2], static_cast<uint32_t>(dst.size(-1) * elem / kWordBytes));
  }
  if (p.num_pairs == 0) return;
  const c10::cuda::CUDAGuard guard(dsts[0].device());
  C10_CUDA_CHECK(launch_copy_many(p, dsts[0].get_device(), at::cuda::getCurrentCUDAStream()));
}

void check_flags(at::TensorList flags, const char* op) {
  for (size_t i = 0; i < flags.size(); ++i) {
    const at::Tensor& flag = flags[i];
    TORCH_CHECK(flag.scalar_type() == at::kInt && flag.sym_numel() == 1, op, ": flags[", i,
                "] must be a one-element int32 tensor, got ", flag.scalar_type(), " of shape ", flag.sym_sizes());
    TORCH_CHECK(flag.device() == flags[0].device(), op, ": flags[", i, "] is on ", flag.device(), ", flags[0] on ",
                flags[0].device());
  }
}

namespace {

// Stream memory operations (CUDA driver API, "Stream Memory Operations"), looked up once: the
// front end of the stream runs them, no SM, so they signal and wait beside a kernel that holds
// every SM (a barrier kernel would wait for that kernel's tail: 0.7 ms a Wan2.1-14B-like call on
// 2 H200s, session 52).
template <typename Fn>
Fn driver_function(const char* name) {
  const Fn fn = driver_entry_point<Fn>(name);
  TORCH_CHECK(fn != nullptr, "the CUDA driver has no ", name, " (stream memory operations)");
  return fn;
}

// One stream memory operation per flag, on the current stream of the flags' device.
template <typename Fn>
void on_each_flag(at::TensorList flags, int64_t value, const char* op, const char* driver_name, Fn fn,
                  unsigned int mode) {
  check_flags(flags, op);
  if (flags.empty()) return;
  const c10::cuda::CUDAGuard guard(flags[0].device());
  const CUstream stream = at::cuda::getCurrentCUDAStream().stream();
  for (const at::Tensor& flag : flags) {
    const CUresult result =
        fn(stream, reinterpret_cast<CUdeviceptr>(flag.data_ptr()), static_cast<cuuint32_t>(value), mode);
    TORCH_CHECK(result == CUDA_SUCCESS, op, ": ", driver_name, " failed with CUresult ", static_cast<int>(result));
  }
}

}  // namespace

// CU_STREAM_WRITE_VALUE_DEFAULT: a system-wide fence before the write, so that a peer that sees
// the value also sees every byte this stream wrote before it (into its memory, by the copy engines).
void signal_flags_cuda(at::TensorList flags, int64_t value) {
  static const auto write = driver_function<PFN_cuStreamWriteValue32_v11070>("cuStreamWriteValue32");
  on_each_flag(flags, value, "signal_flags_", "cuStreamWriteValue32", write, CU_STREAM_WRITE_VALUE_DEFAULT);
}

// GEQ compares (int32_t)(*flag - value) >= 0: counts that wrap around still order.
void wait_flags_cuda(at::TensorList flags, int64_t value) {
  static const auto wait = driver_function<PFN_cuStreamWaitValue32_v11070>("cuStreamWaitValue32");
  on_each_flag(flags, value, "wait_flags_", "cuStreamWaitValue32", wait, CU_STREAM_WAIT_VALUE_GEQ);
}

void signal_flags_meta(at::TensorList flags, int64_t /*value*/) { check_flags(flags, "signal_flags_"); }
void wait_flags_meta(at::TensorList flags, int64_t /*value*/) { check_flags(flags, "wait_flags_"); }

// SymInt-aware like check_copy_many.
void check_merge_parts(at::TensorList outs, at::TensorList lses) {
  TORCH_CHECK(!outs.empty() && outs.size() <= static_cast<size_t>(kMergeMaxParts),
              "merge_attention_parts: outs must hold 1 to ", kMergeMaxParts, " parts, got ", outs.size());
  TORCH_CHECK(lses.size() == outs.size(), "merge_attention_parts: lses must hold one LSE per part (",
              outs.size(), "), got ", lses.size());
  const at::Tensor& first = outs[0];
  TORCH_CHECK(first.scalar_type() == at::kHalf || first.scalar_type() == at::kBFloat16,
              "merge_attention_parts: outs must be float16 or bfloat16, got ", first.scalar_type());
  TORCH_CHECK(first.dim() == 4, "merge_attention_parts: outs must be [B, H, N, D], got ", first.dim(),
              " dimensions");
  TORCH_CHECK(first.sym_size(3) % 8 == 0, "merge_attention_parts: the head_dim of outs must be a multiple of 8, got ",
              first.sym_size(3));
  const c10::SymIntArrayRef rows = first.sym_sizes().slice(0, 3);
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor &out = outs[i], &lse = lses[i];
    TORCH_CHECK(out.sym_sizes() == first.sym_sizes() && out.scalar_type() == first.scalar_type() &&
                    out.device() == first.device(),
                "merge_attention_parts: outs[", i, "] must be like outs[0] (", first.sym_sizes(), " ",
                first.scalar_type(), " on ", first.device(), "), got ", out.sym_sizes(), " ", out.scalar_type(),
                " on ", out.device());
    TORCH_CHECK(out.sym_stride(3) == 1, "merge_attention_parts: outs[", i,
                "] must be contiguous in its last dimension, got stride ", out.sym_stride(3));
    for (int64_t d = 0; d < 3; ++d) {
      TORCH_CHECK(out.sym_stride(d) % 8 == 0, "merge_attention_parts: outs[", i, "].stride(", d,
                  ") must be a multiple of 8 elements (16-byte vectors), got ", out.sym_stride(d));
    }
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sym_sizes() == rows && lse.device() == first.device(),
                "merge_attention_parts: lses[", i, "] must be float32 ", rows, " on ", first.device(), ", got ",
                lse.scalar_type(), " ", lse.sym_sizes(), " on ", lse.device());
  }
  TORCH_CHECK(first.sym_numel() / 8 < kMaxWords, "merge_attention_parts: outs[0] has ", first.sym_numel(),
              " elements; at most 2^34");
}

namespace {

std::tuple<at::Tensor, at::Tensor> allocate_merged(const at::Tensor& first, bool out_nhd) {
  const auto s = first.sym_sizes();
  at::Tensor merged = out_nhd ? at::empty_symint({s[0], s[2], s[1], s[3]}, first.options()).transpose(1, 2)
                              : at::empty_symint(s, first.options());
  return {merged, at::empty_symint(s.slice(0, 3), first.options().dtype(at::kFloat))};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_parts_meta(at::TensorList outs, at::TensorList lses, bool out_nhd) {
  check_merge_parts(outs, lses);
  return allocate_merged(outs[0], out_nhd);
}

std::tuple<at::Tensor, at::Tensor> merge_parts_cuda(at::TensorList outs, at::TensorList lses, bool out_nhd) {
  check_merge_parts(outs, lses);
  const at::Tensor& first = outs[0];
  TORCH_CHECK(first.is_cuda(), "merge_attention_parts: the tensors must be CUDA tensors, got ", first.device());
  const c10::cuda::CUDAGuard guard(first.device());
  auto [merged, merged_lse] = allocate_merged(first, out_nhd);
  // The walk follows the merged output's memory: (batch, tokens, heads) for NHD.
  const int order[3] = {0, out_nhd ? 2 : 1, out_nhd ? 1 : 2};
  MergePartsParams p;
  p.parts = static_cast<int>(outs.size());
  for (int part = 0; part < p.parts; ++part) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(outs[part].data_ptr()) % kWordBytes == 0, "merge_attention_parts: outs[",
                part, "] must start at a 16-byte aligned address");
    p.outs[part] = outs[part].data_ptr();
    p.lses[part] = lses[part].data_ptr<float>();
    for (int d = 0; d < 3; ++d) {
      p.out_stride[part][d] = outs[part].stride(order[d]);
      p.lse_stride[part][d] = lses[part].stride(order[d]);
    }
  }
  p.merged = merged.data_ptr();
  p.merged_lse = merged_lse.data_ptr<float>();
  for (int d = 0; d < 3; ++d) {
    p.merged_stride[d] = merged.stride(order[d]);
    p.merged_lse_stride[d] = merged_lse.stride(order[d]);
  }
  const auto rows = [&](int d) { return static_cast<uint32_t>(first.size(order[d])); };
  p.walk = VectorWalk::of(rows(0), rows(1), rows(2), static_cast<uint32_t>(first.size(3) / 8));
  if (p.walk.vectors == 0) return {merged, merged_lse};
  const InputDtype dtype = first.scalar_type() == at::kHalf ? InputDtype::kFloat16 : InputDtype::kBFloat16;
  C10_CUDA_CHECK(launch_merge_parts(p, dtype, first.get_device(), at::cuda::getCurrentCUDAStream()));
  return {merged, merged_lse};
}

}  // namespace sageattention2
