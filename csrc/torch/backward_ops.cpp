// The op of the attention backward kernel (hopper/backward/kernel.cuh): _backward runs it with
// SAGEATTN_BACKWARD_KERNEL=wgmma, the GPU tests compare it with _backward's formulas.
//   attention_backward_wgmma(q, k, v, dout, lse_log2, delta, scale, is_causal)
//     -> (dq, dk, dv)
// q, k, v, dout: contiguous [B, H, N, 128] float16/bfloat16 with the same heads (GQA expanded by
// the caller); lse_log2 and delta: contiguous float32 [B, H, Nq]; is_causal needs Nq == Nk.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "hopper/backward/params.h"

namespace sageattention2 {

namespace {

void check_operand(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.is_contiguous(), "attention_backward_wgmma: ", name,
              " must be a contiguous 4-D CUDA tensor [B, H, N, 128], got ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "attention_backward_wgmma: ", name, " must have q's dtype ",
              q.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(3) == 128, "attention_backward_wgmma: ",
              name, " must be [", q.size(0), ", ", q.size(1), ", N, 128], got ", t.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_wgmma_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout, const at::Tensor& lse_log2,
    const at::Tensor& delta, double scale, bool is_causal) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "attention_backward_wgmma: q must be float16 or bfloat16, got ", q.scalar_type());
  check_operand(q, q, "q");
  check_operand(k, q, "k");
  check_operand(v, q, "v");
  check_operand(dout, q, "dout");
  TORCH_CHECK(v.size(2) == k.size(2) && dout.size(2) == q.size(2), "attention_backward_wgmma: v must have k's ",
              "length and dout q's");
  TORCH_CHECK(!is_causal || q.size(2) == k.size(2), "attention_backward_wgmma: is_causal needs as many queries as keys");
  for (const auto* t : {&lse_log2, &delta})
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == q.size(0) && t->size(1) == q.size(1) && t->size(2) == q.size(2),
                "attention_backward_wgmma: lse_log2 and delta must be contiguous float32 [B, H, Nq]");
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t q_blocks = (q.size(2) + 63) / 64;
  at::Tensor dq_accum = at::zeros({q.size(0), q.size(1), q_blocks, 2, 4096}, q.options().dtype(at::kFloat));
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.numel() == 0 || k.size(2) == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  // LSE and D padded to whole Q blocks (+inf: P = 0 past q_len), for the kernel's 16-byte copies.
  const int64_t q_padded = q_blocks * 64, pad = q_padded - q.size(2);
  const at::Tensor lse_padded = pad == 0 ? lse_log2 : at::constant_pad_nd(lse_log2, {0, pad}, INFINITY);
  const at::Tensor delta_padded = pad == 0 ? delta : at::constant_pad_nd(delta, {0, pad}, 0.0);
  AttentionBackwardParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.lse_log2 = lse_padded.data_ptr<float>();
  p.delta = delta_padded.data_ptr<float>();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.heads = static_cast<int>(q.size(1));
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
      "attention_backward_wgmma(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse_log2, Tensor delta, "
      "float scale, bool is_causal) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(sageattention2, CUDA, m) {
  m.impl("attention_backward_wgmma", &sageattention2::attention_backward_wgmma_cuda);
}
