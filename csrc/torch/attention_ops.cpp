// CUDA implementations of the attention ops attention_mma and attention_wgmma: validate and
// allocate (attention_shapes.cpp), fill the kernel parameters, launch on the current stream
// (mma/launch.cu, hopper/launch.cu).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "hopper/params.h"
#include "mma/params.h"
#include "torch/attention.h"
#include "torch/preprocess.h"  // check_launchable, int8_heads_pointer

namespace sageattention2 {
namespace {

// The parameters both attention kernels share: the caller's Q, the output and LSE, the shapes.
template <typename Params>
void set_shared_params(Params& p, const at::Tensor& q, const at::Tensor& k_codes, const AttentionOutputs& out,
                       int64_t kv_len, bool return_lse) {
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.q_stride_n = q.stride(2);
  p.out = out.out.data_ptr();
  p.out_stride_b = out.out.stride(0);
  p.out_stride_h = out.out.stride(1);
  p.out_stride_n = out.out.stride(2);
  p.lse = return_lse ? out.lse.data_ptr<float>() : nullptr;
  p.batch = static_cast<int>(q.size(0));
  p.q_heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k_codes.size(1));
  p.head_dim = static_cast<int>(q.size(3));
  p.q_len = q.size(2);
  p.kv_len = kv_len;
  p.k_padded = k_codes.size(2);
}

}  // namespace

namespace {

// The tables of packed sequences (mma/params.h), for attention_mma_packed_cuda.
struct MmaPackedTables {
  const int* key_ranges;
  const int* packed_items;
  const int* packed_blocks;
  int64_t entries;
};

// attention_mma into `out` (allocated by allocate_attention_mma), over the heads whose
// int8_heads flag is int8_heads_run (all heads without int8_heads); with `packed`, over packed
// sequences (q, v, out and lse one batch item of all their rows).
void launch_attention_mma_into(const AttentionOutputs& out, const at::Tensor& q,
                               const std::optional<at::Tensor>& q_mean, const at::Tensor& k_codes,
                               const at::Tensor& k_scale, const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                               const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_mean,
                               const std::optional<at::Tensor>& k_mean, const std::string& qk_dtype, int64_t kv_len,
                               double sm_scale, bool is_causal, bool return_lse, bool after_quantize_kv,
                               const std::optional<at::Tensor>& int8_heads, bool int8_heads_run,
                               const MmaPackedTables* packed = nullptr) {
  check_launchable(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const bool fp8_v = v.scalar_type() == at::kFloat8_e4m3fn;
  AttentionMmaParams p;
  set_shared_params(p, q, k_codes, out, kv_len, return_lse);
  p.q_mean = q_mean ? q_mean->data_ptr<float>() : nullptr;
  p.k_mean = k_mean ? k_mean->data_ptr<float>() : nullptr;
  // The product in double, then rounded once, as the reference's scale_multiplier and
  // quantize_kv's delta_s_multiplier are (sageattn's sm_scale * log2(e)), so the codes and scales
  // match theirs bit for bit.
  p.q_scale_multiplier = static_cast<float>(sm_scale * kLog2e);
  p.sm_scale = static_cast<float>(sm_scale);
  p.k_codes = k_codes.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.delta_s = delta_s ? delta_s->data_ptr<float>() : nullptr;
  p.v = v.data_ptr();
  p.v_stride_b = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.v_stride_n = v.stride(2);
  p.v_scale = v_scale ? v_scale->data_ptr<float>() : nullptr;
  p.v_mean = v_mean ? v_mean->data_ptr<float>() : nullptr;
  p.qk = qk_dtype == "int4" ? QkCodes::kInt4 : QkCodes::kInt8;
  p.pv = fp8_v ? PvOperands::kFp8 : PvOperands::kInput;
  p.causal = is_causal;
  p.after_quantize_kv = after_quantize_kv;
  if (int8_heads) {
    p.int8_heads = int8_heads_pointer(*int8_heads, q.size(0), k_codes.size(1), "attention_mma");
    p.int8_heads_run = int8_heads_run ? 1 : 0;
  }
  if (packed != nullptr) {
    p.key_ranges = packed->key_ranges;
    p.packed_items = packed->packed_items;
    p.packed_blocks = packed->packed_blocks;
    p.packed_entries = static_cast<int>(packed->entries);
  }
  const InputDtype dtype = q.scalar_type() == at::kHalf ? InputDtype::kFloat16 : InputDtype::kBFloat16;
  const cudaError_t status = launch_attention_mma(p, dtype, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status != cudaErrorNotSupported, "attention_mma: ",
              fp8_v ? "FP8 PV needs an sm_89+ GPU and a build with code for it (TORCH_CUDA_ARCH_LIST 8.9 or 9.0a)"
                    : "this variant needs more shared memory per block than this GPU allows");
  C10_CUDA_CHECK(status);
}

}  // namespace

// attention_mma, launched the ordinary way or (after_quantize_kv) as a programmatic dependent of
// the quantize_kv launched just before it by the same call.
std::tuple<at::Tensor, at::Tensor> attention_mma_after_cuda(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                              const at::Tensor& k_codes, const at::Tensor& k_scale,
                                              const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                              const std::optional<at::Tensor>& v_scale,
                                              const std::optional<at::Tensor>& v_mean,
                                              const std::optional<at::Tensor>& k_mean, const std::string& qk_dtype,
                                              int64_t kv_len, double sm_scale, bool is_causal, bool out_nhd,
                                              bool return_lse, bool after_quantize_kv) {
  AttentionOutputs out = allocate_attention_mma(q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean,
                                                qk_dtype, kv_len, out_nhd, return_lse);
  launch_attention_mma_into(out, q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean, qk_dtype, kv_len,
                            sm_scale, is_causal, return_lse, after_quantize_kv, std::nullopt, false);
  return {out.out, out.lse};
}

void attention_mma_heads_into_cuda(const AttentionOutputs& out, const at::Tensor& q,
                                   const std::optional<at::Tensor>& q_mean, const at::Tensor& k_codes,
                                   const at::Tensor& k_scale, const std::optional<at::Tensor>& delta_s,
                                   const at::Tensor& v, const std::optional<at::Tensor>& v_scale,
                                   const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& k_mean,
                                   const std::string& qk_dtype, int64_t kv_len, double sm_scale, bool is_causal,
                                   bool return_lse, const at::Tensor& int8_heads, bool int8_heads_run) {
  // (No shape checks of its own: its caller, sageattn_mma, made every input.)
  launch_attention_mma_into(out, q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean, qk_dtype, kv_len,
                            sm_scale, is_causal, return_lse, false, int8_heads, int8_heads_run);
}

at::Tensor items_view(const at::Tensor& t, int64_t items) {
  return t.transpose(0, 1).unsqueeze(0).expand({items, t.size(1), t.size(0), t.size(2)});
}

AttentionOutputs allocate_packed_outputs(const at::Tensor& q, bool return_lse) {
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor lse = return_lse ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attention_mma_packed_cuda(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& v,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_mean,
    const std::optional<at::Tensor>& k_mean, const int* key_ranges, const int* packed_items, const int* packed_blocks,
    int64_t blocks, int64_t max_seqlen_k, double sm_scale, bool is_causal, bool return_lse, bool after_quantize_kv) {
  const auto [out, lse] = allocate_packed_outputs(q, return_lse);
  // The packed [total, H, D] tensors as one batch item [1, H, total, D] (FP8 V: its codes
  // [1, Hkv, D, code_rows] as they are).
  const bool fp8_v = v.scalar_type() == at::kFloat8_e4m3fn;
  const MmaPackedTables tables{key_ranges, packed_items, packed_blocks, blocks};
  launch_attention_mma_into(AttentionOutputs{items_view(out, 1), return_lse ? lse.unsqueeze(0) : lse},
                            items_view(q, 1), std::nullopt, k_codes, k_scale, std::nullopt,
                            fp8_v ? v : items_view(v, 1), v_scale, v_mean, k_mean, "int8", max_seqlen_k, sm_scale,
                            is_causal, return_lse, after_quantize_kv, std::nullopt, false, &tables);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attention_mma_cuda(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                                      const at::Tensor& k_codes, const at::Tensor& k_scale,
                                                      const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& v_scale,
                                                      const std::optional<at::Tensor>& v_mean,
                                                      const std::optional<at::Tensor>& k_mean,
                                                      const std::string& qk_dtype, int64_t kv_len, double sm_scale,
                                                      bool is_causal, bool out_nhd, bool return_lse) {
  return attention_mma_after_cuda(q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean, qk_dtype, kv_len, sm_scale,
                    is_causal, out_nhd, return_lse, false);
}

namespace {

// The rest of attention_wgmma's parameters, which the batched and the packed launches fill alike,
// then the launch on the current stream. key_ranges: null where every item attends all its keys.
void launch_wgmma(AttentionWgmmaParams& p, const at::Tensor& q, const std::optional<at::Tensor>& v_mean,
                  const std::optional<at::Tensor>& k_mean, double sm_scale, bool is_causal, bool after_quantize_kv,
                  const int* key_ranges) {
  p.v_mean = v_mean ? v_mean->data_ptr<float>() : nullptr;
  p.k_mean = k_mean ? k_mean->data_ptr<float>() : nullptr;
  p.sm_scale = static_cast<float>(sm_scale);
  p.causal = is_causal;
  p.after_quantize_kv = after_quantize_kv;
  p.key_ranges = key_ranges;
  const InputDtype dtype = q.scalar_type() == at::kHalf ? InputDtype::kFloat16 : InputDtype::kBFloat16;
  const cudaError_t status = launch_attention_wgmma(p, dtype, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status != cudaErrorNotSupported,
              "attention_wgmma: this build has no sm_90a code or the driver lacks cuTensorMapEncodeTiled");
  C10_CUDA_CHECK(status);
}

}  // namespace

// attention_wgmma (after_quantize_kv: quantize_kv was launched by the same call just before).
std::tuple<at::Tensor, at::Tensor> attention_wgmma_after_cuda(const at::Tensor& q, const at::Tensor& k_codes,
                                                const at::Tensor& k_scale, const at::Tensor& v,
                                                const std::optional<at::Tensor>& v_tile_scale,
                                                const std::optional<at::Tensor>& v_mean,
                                                const std::optional<at::Tensor>& k_mean, int64_t kv_len,
                                                double sm_scale, bool is_causal, bool out_nhd, bool return_lse,
                                                bool after_quantize_kv, const int* key_ranges) {
  AttentionOutputs out =
      allocate_attention_wgmma(q, k_codes, k_scale, v, v_tile_scale, v_mean, k_mean, kv_len, out_nhd, return_lse);
  check_launchable(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionWgmmaParams p;
  set_shared_params(p, q, k_codes, out, kv_len, return_lse);
  p.k_codes = k_codes.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.fp8_pv = v.scalar_type() == at::kFloat8_e4m3fn;
  // The copy engine cannot step along a stride of 0 (a broadcast view of 16-bit V): such a V
  // is read from a contiguous copy, which the caching allocator keeps until the kernel ran.
  bool broadcast = false;
  for (int i = 0; i < 3; ++i) broadcast = broadcast || (v.size(i) > 1 && v.stride(i) == 0);
  const at::Tensor v_read = !p.fp8_pv && broadcast ? v.contiguous() : v;
  p.v = v_read.data_ptr();
  p.v_stride_b = v_read.stride(0);
  p.v_stride_h = v_read.stride(1);
  p.v_stride_n = v_read.stride(2);
  // The copy engine reads the caller's V from a 16-byte aligned address (the strides are
  // multiples of 16 bytes, checked above).
  TORCH_CHECK(p.fp8_pv || reinterpret_cast<uintptr_t>(p.v) % 16 == 0,
              "attention_wgmma: v's data must start at a 16-byte aligned address (v.storage_offset() a multiple of 8)");
  p.v_tile_scale = v_tile_scale ? v_tile_scale->data_ptr<float>() : nullptr;
  launch_wgmma(p, q, v_mean, k_mean, sm_scale, is_causal, after_quantize_kv, key_ranges);
  return {out.out, out.lse};
}

std::tuple<at::Tensor, at::Tensor> attention_wgmma_cuda(const at::Tensor& q, const at::Tensor& k_codes,
                                                        const at::Tensor& k_scale, const at::Tensor& v,
                                                        const std::optional<at::Tensor>& v_tile_scale,
                                                        const std::optional<at::Tensor>& v_mean,
                                                        const std::optional<at::Tensor>& k_mean, int64_t kv_len,
                                                        double sm_scale, bool is_causal, bool out_nhd, bool return_lse) {
  return attention_wgmma_after_cuda(q, k_codes, k_scale, v, v_tile_scale, v_mean, k_mean, kv_len, sm_scale, is_causal, out_nhd,
                      return_lse, false);
}

std::tuple<at::Tensor, at::Tensor> attention_wgmma_packed_cuda(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& v,
    const std::optional<at::Tensor>& v_tile_scale, const std::optional<at::Tensor>& v_mean,
    const std::optional<at::Tensor>& k_mean,
    const int* key_ranges, const int* packed_items, int64_t items, const int* packed_blocks, int64_t blocks,
    int64_t total_k,
    double sm_scale, bool is_causal, bool return_lse, bool after_quantize_kv) {
  check_launchable(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  const auto [out, lse] = allocate_packed_outputs(q, return_lse);
  AttentionWgmmaParams p;
  set_shared_params(p, items_view(q, items), k_codes, AttentionOutputs{items_view(out, items), lse}, total_k,
                    return_lse);
  // The schedule's Q blocks: the table's, as one batch entry's (hopper/params.h).
  p.batch = 1;
  p.q_len = blocks * kWgmmaBlockQ;
  p.packed_blocks = packed_blocks;
  p.lse_rows = q.size(0);
  p.k_codes = k_codes.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.fp8_pv = v_tile_scale.has_value();
  p.v = v.data_ptr();
  if (p.fp8_pv) {
    p.v_tile_scale = v_tile_scale->data_ptr<float>();
  } else {  // V's zero-padded copy [code rows, Hkv, D]: the map's [1, Hkv, k_padded, D]
    p.v_stride_b = 0;
    p.v_stride_h = v.stride(1);
    p.v_stride_n = v.stride(0);
  }
  p.packed_items = packed_items;
  launch_wgmma(p, q, v_mean, k_mean, sm_scale, is_causal, after_quantize_kv, key_ranges);
  return {out, lse};
}

}  // namespace sageattention2
