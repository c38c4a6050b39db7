// The op layer: schemas of the sageattention2 ops, their CUDA implementations, and Meta
// implementations (output shapes only) through which torch.compile and FakeTensor trace.
#include <torch/library.h>

#include "torch/attention.h"
#include "torch/parallel.h"
#include "torch/preprocess.h"

namespace sageattention2 {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_meta(
    const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& v, bool smooth_v) {
  auto o = allocate_smoothing_stats(q, k, v, smooth_v);
  return {o.q_mean, o.k_mean, o.v_mean, o.v_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_meta(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double /*delta_s_multiplier*/) {
  auto o = allocate_quantize_kv(k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk_dtype);
  return {o.k_codes, o.k_scales, o.v_codes, o.delta_s, o.v_tile_scale};
}

std::tuple<at::Tensor, at::Tensor> center_keys_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                                                    const at::Tensor& k_mean, double /*scale*/) {
  auto o = allocate_center_keys(q, k, lse, k_mean);
  return {o.k_centered, o.lse_centered};
}

std::tuple<at::Tensor, at::Tensor> attention_mma_meta(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                                      const at::Tensor& k_codes, const at::Tensor& k_scale,
                                                      const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& v_scale,
                                                      const std::optional<at::Tensor>& v_mean,
                                                      const std::optional<at::Tensor>& k_mean,
                                                      const std::string& qk_dtype, int64_t kv_len,
                                                      double /*sm_scale*/, bool /*is_causal*/, bool out_nhd,
                                                      bool return_lse) {
  auto o = allocate_attention_mma(q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean, qk_dtype, kv_len,
                                  out_nhd, return_lse);
  return {o.out, o.lse};
}

std::tuple<at::Tensor, at::Tensor> attention_wgmma_meta(const at::Tensor& q, const at::Tensor& k_codes,
                                                        const at::Tensor& k_scale, const at::Tensor& v,
                                                        const std::optional<at::Tensor>& v_tile_scale,
                                                        const std::optional<at::Tensor>& v_mean,
                                                        const std::optional<at::Tensor>& k_mean, int64_t kv_len,
                                                        double /*sm_scale*/, bool /*is_causal*/, bool out_nhd,
                                                        bool return_lse) {
  auto o = allocate_attention_wgmma(q, k_codes, k_scale, v, v_tile_scale, v_mean, k_mean, kv_len, out_nhd, return_lse);
  return {o.out, o.lse};
}

std::tuple<at::Tensor, at::Tensor> sageattn_wgmma_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::string& pv_dtype, bool smooth_k, bool smooth_v, int64_t sample_stride,
                                                       double /*sm_scale*/, bool is_causal, bool out_nhd,
                                                       bool return_lse, const std::optional<at::Tensor>& key_ranges,
                                                       const std::optional<at::Tensor>& key_mask, int64_t sample_tokens) {
  auto o = allocate_sageattn_wgmma(q, k, v, pv_dtype, smooth_k, smooth_v, sample_stride, out_nhd, return_lse,
                                   key_ranges, is_causal, key_mask, sample_tokens);
  return {o.out, o.lse};
}

std::tuple<at::Tensor, at::Tensor> sageattn_wgmma_varlen_meta(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& items,
                                                              const at::Tensor& blocks, int64_t max_seqlen_k,
                                                              int64_t code_rows, bool /*smooth_k*/,
                                                              bool /*smooth_v*/, double /*sm_scale*/,
                                                              bool /*is_causal*/, bool return_lse,
                                                              const std::optional<at::Tensor>& v_rows) {
  auto o = allocate_sageattn_wgmma_varlen(q, k, v, items, blocks, max_seqlen_k, code_rows, return_lse, v_rows);
  return {o.out, o.lse};
}

std::tuple<at::Tensor, at::Tensor> sageattn_mma_varlen_meta(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& items,
                                                            const at::Tensor& blocks, int64_t max_seqlen_k,
                                                            int64_t code_rows, const std::string& pv_dtype,
                                                            bool /*smooth_k*/, bool /*smooth_v*/, double /*sm_scale*/,
                                                            bool /*is_causal*/, bool return_lse) {
  auto o = allocate_sageattn_mma_varlen(q, k, v, items, blocks, max_seqlen_k, code_rows, pv_dtype, return_lse);
  return {o.out, o.lse};
}

std::tuple<at::Tensor, at::Tensor> sageattn_mma_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::string& qk_dtype, const std::string& pv_dtype,
                                                     bool smooth_q, bool smooth_k, bool smooth_v,
                                                     int64_t sample_stride, double /*sm_scale*/, bool /*is_causal*/,
                                                     bool out_nhd, bool return_lse, double int4_guard) {
  auto o = allocate_sageattn_mma(q, k, v, qk_dtype, pv_dtype, smooth_q, smooth_k, smooth_v, sample_stride, out_nhd,
                                 return_lse, int4_guard);
  return {o.out, o.lse};
}

}  // namespace
}  // namespace sageattention2

TORCH_LIBRARY(sageattention2, m) {
  // docs/DESIGN.md#ops documents every argument and output.
  m.def(
      "smoothing_stats(Tensor? q, Tensor? k, Tensor? v, bool smooth_v) "
      "-> (Tensor q_mean, Tensor k_mean, Tensor v_mean, Tensor v_scale)");
  m.def(
      "quantize_kv(Tensor k, Tensor? v, Tensor? k_mean, Tensor? v_mean, Tensor? v_scale, "
      "Tensor? q_mean, int block_k, str qk_dtype, float delta_s_multiplier) "
      "-> (Tensor k_codes, Tensor k_scale, Tensor v_fp8, Tensor delta_s, Tensor v_tile_scale)");
  m.def("center_keys(Tensor q, Tensor k, Tensor lse, Tensor k_mean, float scale) -> (Tensor k_centered, "
        "Tensor lse_centered)");
  m.def("copy_many_(Tensor(a!)[] dsts, Tensor[] srcs, bool by_copy_engine=False) -> ()");
  // (wait_flags_ reads its flags; marked as written so that no graph reorders or drops the wait)
  m.def("signal_flags_(Tensor(a!)[] flags, int value) -> ()");
  m.def("wait_flags_(Tensor(a!)[] flags, int value) -> ()");
  m.def("merge_attention_parts(Tensor[] outs, Tensor[] lses, bool out_nhd) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_mma(Tensor q, Tensor? q_mean, Tensor k_codes, Tensor k_scale, Tensor? delta_s, Tensor v, "
      "Tensor? v_scale, Tensor? v_mean, Tensor? k_mean, str qk_dtype, int kv_len, float sm_scale, bool is_causal, "
      "bool out_nhd, bool return_lse) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_wgmma(Tensor q, Tensor k_codes, Tensor k_scale, Tensor v, Tensor? v_scale, Tensor? v_mean, "
      "Tensor? k_mean, int kv_len, float sm_scale, bool is_causal, bool out_nhd, bool return_lse) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "sageattn_wgmma(Tensor q, Tensor k, Tensor v, str pv_dtype, bool smooth_k, bool smooth_v, int sample_stride, "
      "float sm_scale, "
      "bool is_causal, bool out_nhd, bool return_lse, Tensor? key_ranges=None, Tensor? key_mask=None, "
      "int sample_tokens=0) -> (Tensor out, Tensor lse)");
  m.def(
      "sageattn_wgmma_varlen(Tensor q, Tensor k, Tensor v, Tensor items, Tensor blocks, int max_seqlen_k, "
      "int code_rows, bool smooth_k, bool smooth_v, float sm_scale, bool is_causal, bool return_lse, "
      "Tensor? v_rows=None) -> (Tensor out, Tensor lse)");
  m.def(
      "sageattn_mma(Tensor q, Tensor k, Tensor v, str qk_dtype, str pv_dtype, bool smooth_q, bool smooth_k, "
      "bool smooth_v, int sample_stride, float sm_scale, bool is_causal, bool out_nhd, bool return_lse, "
      "float int4_guard=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "sageattn_mma_varlen(Tensor q, Tensor k, Tensor v, Tensor items, Tensor blocks, int max_seqlen_k, "
      "int code_rows, str pv_dtype, bool smooth_k, bool smooth_v, float sm_scale, bool is_causal, "
      "bool return_lse) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(sageattention2, CUDA, m) {
  m.impl("smoothing_stats", &sageattention2::smoothing_stats_cuda);
  m.impl("quantize_kv", &sageattention2::quantize_kv_cuda);
  m.impl("center_keys", &sageattention2::center_keys_cuda);
  m.impl("copy_many_", &sageattention2::copy_many_cuda);
  m.impl("signal_flags_", &sageattention2::signal_flags_cuda);
  m.impl("wait_flags_", &sageattention2::wait_flags_cuda);
  m.impl("merge_attention_parts", &sageattention2::merge_parts_cuda);
  m.impl("attention_mma", &sageattention2::attention_mma_cuda);
  m.impl("attention_wgmma", &sageattention2::attention_wgmma_cuda);
  m.impl("sageattn_wgmma", &sageattention2::sageattn_wgmma_cuda);
  m.impl("sageattn_wgmma_varlen", &sageattention2::sageattn_wgmma_varlen_cuda);
  m.impl("sageattn_mma", &sageattention2::sageattn_mma_cuda);
  m.impl("sageattn_mma_varlen", &sageattention2::sageattn_mma_varlen_cuda);
}

TORCH_LIBRARY_IMPL(sageattention2, Meta, m) {
  m.impl("smoothing_stats", &sageattention2::smoothing_stats_meta);
  m.impl("quantize_kv", &sageattention2::quantize_kv_meta);
  m.impl("center_keys", &sageattention2::center_keys_meta);
  m.impl("copy_many_", &sageattention2::copy_many_meta);
  m.impl("signal_flags_", &sageattention2::signal_flags_meta);
  m.impl("wait_flags_", &sageattention2::wait_flags_meta);
  m.impl("merge_attention_parts", &sageattention2::merge_parts_meta);
  m.impl("attention_mma", &sageattention2::attention_mma_meta);
  m.impl("attention_wgmma", &sageattention2::attention_wgmma_meta);
  m.impl("sageattn_wgmma", &sageattention2::sageattn_wgmma_meta);
  m.impl("sageattn_wgmma_varlen", &sageattention2::sageattn_wgmma_varlen_meta);
  m.impl("sageattn_mma", &sageattention2::sageattn_mma_meta);
  m.impl("sageattn_mma_varlen", &sageattention2::sageattn_mma_varlen_meta);
}
