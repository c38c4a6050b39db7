// The op of the attention backward kernel (hopper/backward/kernel.cuh): _backward runs it with
// SAGEATTN_BACKWARD_KERNEL=wgmma, the GPU tests compare it with _backward's formulas.
//   attention_backward_wgmma(q, k, v, out, dout, lse, k_mean, scale, is_causal) -> (dq, dk, dv)
// q, out, dout: contiguous [B, H, Nq, 128] float16/bfloat16; k, v: contiguous [B, Hkv, Nk, 128]
// with Hkv dividing H (GQA: dK and dV per KV head, summed over its group); lse: the forward's,
// natural log, contiguous float32 [B, H, Nq] (-inf or +inf: a row that sees no key, P = 0);
// k_mean: contiguous float32 [B, Hkv, 1, 128], subtracted from K for dQ (K smoothing, the
// kernel's center_keys; zeros: none); is_causal needs Nq == Nk.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <utility>

#include "hopper/backward/params.h"

namespace sageattention2 {

namespace {

void check_operand(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.is_contiguous() && t.device() == q.device(),
              "attention_backward_wgmma: ", name, " must be a contiguous 4-D CUDA tensor [B, H, N, 128] on q's device ",
              q.device(), ", got ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "attention_backward_wgmma: ", name, " must have q's dtype ",
              q.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == q.size(0) && t.size(3) == 128, "attention_backward_wgmma: ", name, " must be [",
              q.size(0), ", H, N, 128], got ", t.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_wgmma_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& dout,
    const at::Tensor& lse, const at::Tensor& k_mean, double scale, bool is_causal) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "attention_backward_wgmma: q must be float16 or bfloat16, got ", q.scalar_type());
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"}})
    check_operand(*t, q, name);
  TORCH_CHECK(out.sizes() == q.sizes() && dout.sizes() == q.sizes(), "attention_backward_wgmma: out and dout must ",
              "have q's shape ", q.sizes(), ", got ", out.sizes(), " and ", dout.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "attention_backward_wgmma: v must have k's shape ", k.sizes(), ", got ",
              v.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "attention_backward_wgmma: k's heads (", k.size(1),
              ") must divide q's (", q.size(1), ")");
  TORCH_CHECK(!is_causal || q.size(2) == k.size(2), "attention_backward_wgmma: is_causal needs as many queries as keys");
  TORCH_CHECK(lse.is_cuda() && lse.device() == q.device() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
              "attention_backward_wgmma: lse must be a contiguous float32 [", q.size(0), ", ", q.size(1), ", ",
              q.size(2), "] on q's device, got ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK(k_mean.is_cuda() && k_mean.device() == q.device() && k_mean.scalar_type() == at::kFloat &&
                  k_mean.is_contiguous() && k_mean.dim() == 4 && k_mean.size(0) == k.size(0) &&
                  k_mean.size(1) == k.size(1) && k_mean.size(2) == 1 && k_mean.size(3) == 128,
              "attention_backward_wgmma: k_mean must be a contiguous [", k.size(0), ", ", k.size(1),
              ", 1, 128] float32 tensor on q's device, got ", k_mean.sizes(), " ", k_mean.scalar_type());
  TORCH_CHECK(q.size(2) < (int64_t{1} << 30) && k.size(2) < (int64_t{1} << 30),
              "attention_backward_wgmma: sequence lengths must be below 2^30");
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t q_blocks = (q.size(2) + 63) / 64, q_padded = q_blocks * 64;
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.numel() == 0 || k.size(2) == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const auto floats = q.options().dtype(at::kFloat);
  at::Tensor dq_accum = at::zeros({q.size(0), q.size(1), q_blocks, 2, 4096}, floats);
  at::Tensor lse_log2 = at::empty({q.size(0), q.size(1), q_padded}, floats);
  at::Tensor delta = at::empty({q.size(0), q.size(1), q_padded}, floats);
  AttentionBackwardParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.dout = dout.data_ptr();
  p.k_mean = k_mean.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1));
  p.q_len = static_cast<int>(q.size(2));
  p.q_padded = static_cast<int>(q_padded);
  p.kv_len = static_cast<int>(k.size(2));
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const cudaError_t err = launch_attention_backward_wgmma(p, q.scalar_type() == at::kBFloat16, is_causal,
                                                          static_cast<int>(q.size(0)),
                                                          at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "attention_backward_wgmma: launch failed: ", cudaGetErrorString(err));
  return {dq, dk, dv};
}

}  // namespace
}  // namespace sageattention2

TORCH_LIBRARY_FRAGMENT(sageattention2, m) {
  m.def(
      "attention_backward_wgmma(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor k_mean, "
      "float scale, bool is_causal) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(sageattention2, CUDA, m) {
  m.impl("attention_backward_wgmma", &sageattention2::attention_backward_wgmma_cuda);
}
