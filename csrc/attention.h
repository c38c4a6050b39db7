// Host interface of the attention ops (docs/DESIGN.md). Validation and output allocation are
// shared by the CUDA and Meta implementations.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace sageattention2 {

struct AttentionOutputs {
  at::Tensor out, lse;
};

AttentionOutputs allocate_attention_mma(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                        const at::Tensor& k_codes, const at::Tensor& k_scale,
                                        const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                        const std::optional<at::Tensor>& v_scale,
                                        const std::optional<at::Tensor>& v_mean,
                                        const std::optional<at::Tensor>& k_mean, const std::string& qk_dtype,
                                        int64_t kv_len, bool out_nhd, bool return_lse);

std::tuple<at::Tensor, at::Tensor> attention_mma_cuda(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                                      const at::Tensor& k_codes, const at::Tensor& k_scale,
                                                      const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& v_scale,
                                                      const std::optional<at::Tensor>& v_mean,
                                                      const std::optional<at::Tensor>& k_mean,
                                                      const std::string& qk_dtype, int64_t kv_len, double sm_scale,
                                                      bool is_causal, bool out_nhd, bool return_lse);

AttentionOutputs allocate_attention_wgmma(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                          const at::Tensor& v_fp8, const at::Tensor& v_tile_scale,
                                          const std::optional<at::Tensor>& v_mean,
                                          const std::optional<at::Tensor>& k_mean, int64_t kv_len, bool out_nhd,
                                          bool return_lse);

std::tuple<at::Tensor, at::Tensor> attention_wgmma_cuda(const at::Tensor& q, const at::Tensor& k_codes,
                                                        const at::Tensor& k_scale, const at::Tensor& v_fp8,
                                                        const at::Tensor& v_tile_scale, const std::optional<at::Tensor>& v_mean,
                                                        const std::optional<at::Tensor>& k_mean, int64_t kv_len,
                                                        double sm_scale, bool is_causal, bool out_nhd, bool return_lse);

}  // namespace sageattention2
