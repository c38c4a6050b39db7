// Argument validation and output allocation of the attention ops attention_mma and
// attention_wgmma (docs/DESIGN.md#attention-mma and #attention-wgmma): the one place that knows
// their shapes, used by the CUDA and the Meta implementations alike (SymInt-aware like
// preprocess_shapes.cpp).
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "hopper/params.h"  // kWgmmaBlockK
#include "mma/params.h"     // kMmaBlockK
#include "torch/attention.h"

namespace sageattention2 {
namespace {

void check_codes(const at::Tensor& t, const char* name, int64_t block) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D [batch, heads, padded_tokens, head_dim] (from quantize_*)");
  TORCH_CHECK(t.scalar_type() == at::kChar, name, " must be int8 codes, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (as quantize_* returns it)");
  TORCH_CHECK(t.sym_size(2) % block == 0, name, ".size(2) must be a multiple of ", block);
}

void check_f32(const at::Tensor& t, const char* name, c10::SymIntArrayRef expected) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), name, " must be contiguous float32");
  TORCH_CHECK(t.sym_sizes() == expected, name, " must have shape ", expected, ", got ", t.sym_sizes());
}

// The caller's Q, which both attention kernels quantize themselves: rows read as 16-byte vectors.
void check_q(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 4, "q must be a 4-D [batch, q_heads, q_len, head_dim] tensor");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "q must be float16 or bfloat16, got ",
              q.scalar_type());
  TORCH_CHECK(q.sym_stride(3) == 1, "q must be contiguous in its last dimension");
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(q.sym_stride(i) % 8 == 0, "q.stride(", i, ") must be a multiple of 8 elements (16-byte rows)");
}

// The output of both attention ops: [B, Hq, q_len, Dv] in `opts`' dtype, HND memory or the
// [B, Hq, q_len, Dv] view of NHD memory; the LSE [B, Hq, q_len] float32 or an empty [0].
AttentionOutputs allocate_outputs(const c10::SymInt& batch, const c10::SymInt& q_heads, const c10::SymInt& q_len,
                                  int64_t head_dim, const at::TensorOptions& opts, bool out_nhd, bool return_lse) {
  AttentionOutputs out;
  out.out = out_nhd ? at::empty_symint({batch, q_len, q_heads, c10::SymInt(head_dim)}, opts).transpose(1, 2)
                    : at::empty_symint({batch, q_heads, q_len, c10::SymInt(head_dim)}, opts);
  out.lse = return_lse ? at::empty_symint({batch, q_heads, q_len}, opts.dtype(at::kFloat))
                       : at::empty({0}, opts.dtype(at::kFloat));
  return out;
}

}  // namespace

AttentionOutputs allocate_attention_mma(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                        const at::Tensor& k_codes, const at::Tensor& k_scale,
                                        const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                        const std::optional<at::Tensor>& v_scale,
                                        const std::optional<at::Tensor>& v_mean,
                                        const std::optional<at::Tensor>& k_mean, const std::string& qk_dtype,
                                        int64_t kv_len, bool out_nhd, bool return_lse) {
  TORCH_CHECK(qk_dtype == "int8" || qk_dtype == "int4", "qk_dtype must be 'int8' or 'int4', got '", qk_dtype, "'");
  const bool int4 = qk_dtype == "int4";
  const bool fp8_v = v.scalar_type() == at::kFloat8_e4m3fn;
  check_q(q);
  check_codes(k_codes, "k_codes", kMmaBlockK);
  TORCH_CHECK(v.dim() == 4, "v must be 4-D: [batch, kv_heads, kv_len, head_dim] (float16/bfloat16) or "
              "[batch, kv_heads, head_dim, padded_kv_len] (float8_e4m3fn from quantize_kv)");
  const c10::SymInt batch = q.sym_size(0), q_heads = q.sym_size(1), q_len = q.sym_size(2);
  const c10::SymInt kv_heads = k_codes.sym_size(1), k_padded = k_codes.sym_size(2);
  const int64_t head_dim = q.sym_size(3).guard_int(__FILE__, __LINE__);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128 for attention_mma, got ", head_dim);
  TORCH_CHECK(q_len > 0, "q must have at least one token");
  // INT4 codes hold two channels a byte.
  TORCH_CHECK(k_codes.sym_size(3) * (int4 ? 2 : 1) == head_dim, "k_codes must hold q's head_dim (", head_dim,
              ") channels with qk_dtype '", qk_dtype, "', got k_codes.size(3) = ", k_codes.sym_size(3));
  TORCH_CHECK(k_codes.sym_size(0) == batch && v.sym_size(0) == batch, "q, k and v must share the batch size");
  TORCH_CHECK(v.sym_size(1) == kv_heads, "v must have k's heads");
  TORCH_CHECK(q_heads % kv_heads == 0, "q heads (", q_heads, ") must be a multiple of kv heads (", kv_heads, ")");
  TORCH_CHECK(kv_len > 0 && k_padded >= kv_len && k_padded < kv_len + kMmaBlockK,
              "kv_len must be the unpadded length of k_codes (padded to ", kMmaBlockK, "), got ", kv_len);
  if (fp8_v) {
    TORCH_CHECK(v.is_contiguous(), "v (float8_e4m3fn) must be contiguous, as quantize_kv returns it");
    TORCH_CHECK(v.sym_sizes() == c10::SymIntArrayRef({batch, kv_heads, c10::SymInt(head_dim), k_padded}),
                "v (float8_e4m3fn) must have shape [batch, kv_heads, head_dim, padded_kv_len] = ",
                c10::SymIntArrayRef({batch, kv_heads, c10::SymInt(head_dim), k_padded}), ", got ", v.sym_sizes());
    TORCH_CHECK(v_scale.has_value(), "v_scale is required with float8_e4m3fn v");
    check_f32(*v_scale, "v_scale", {batch, kv_heads, c10::SymInt(head_dim)});
    if (v_mean) check_f32(*v_mean, "v_mean", {batch, kv_heads, c10::SymInt(head_dim)});
  } else {
    TORCH_CHECK(v.scalar_type() == at::kHalf || v.scalar_type() == at::kBFloat16,
                "v must be float16, bfloat16 or float8_e4m3fn, got ", v.scalar_type());
    TORCH_CHECK(!int4, "qk_dtype 'int4' runs with FP8 PV only: pass quantize_kv's float8_e4m3fn v and v_scale");
    TORCH_CHECK(!v_scale && !v_mean, "v_scale and v_mean go with float8_e4m3fn v only");
    TORCH_CHECK(v.scalar_type() == q.scalar_type(), "v (", v.scalar_type(), ") must have q's dtype (",
                q.scalar_type(), ")");
    TORCH_CHECK(v.sym_size(3) == head_dim, "v must have head_dim ", head_dim, ", got ", v.sym_size(3));
    TORCH_CHECK(v.sym_size(2) == kv_len, "v must have kv_len (", kv_len, ") tokens, got ", v.sym_size(2));
    TORCH_CHECK(v.sym_stride(3) == 1, "v must be contiguous in its last dimension");
    for (int i = 0; i < 3; ++i)
      TORCH_CHECK(v.sym_stride(i) % 8 == 0, "v.stride(", i, ") must be a multiple of 8 elements (16-byte rows)");
  }
  check_f32(k_scale, "k_scale", {batch, kv_heads, k_padded / kMmaBlockK, 4});
  // Q smoothed by q_mean needs the Delta-S of that mean (quantize_kv(q_mean=...)), and only then.
  TORCH_CHECK(q_mean.has_value() == delta_s.has_value(),
              "q_mean and delta_s go together: Q smoothed by q_mean needs quantize_kv's delta_s of that q_mean");
  if (q_mean) check_f32(*q_mean, "q_mean", {batch, q_heads, c10::SymInt(head_dim)});
  if (delta_s) check_f32(*delta_s, "delta_s", {batch, q_heads, k_padded});
  if (k_mean) check_f32(*k_mean, "k_mean", {batch, kv_heads, c10::SymInt(head_dim)});
  for (const at::Tensor* t : {&k_codes, &k_scale, &v})
    TORCH_CHECK(t->device() == q.device(), "all inputs must be on ", q.device());
  for (const auto* t : {&q_mean, &delta_s, &v_scale, &v_mean, &k_mean})
    TORCH_CHECK(!*t || (*t)->device() == q.device(), "all inputs must be on ", q.device());

  return allocate_outputs(batch, q_heads, q_len, head_dim, q.options(), out_nhd, return_lse);
}

AttentionOutputs allocate_attention_wgmma(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                          const at::Tensor& v, const std::optional<at::Tensor>& v_tile_scale,
                                          const std::optional<at::Tensor>& v_mean,
                                          const std::optional<at::Tensor>& k_mean, int64_t kv_len, bool out_nhd,
                                          bool return_lse) {
  check_q(q);
  check_codes(k_codes, "k_codes", kWgmmaBlockK);
  const c10::SymInt batch = q.sym_size(0), q_heads = q.sym_size(1), q_len = q.sym_size(2);
  const c10::SymInt kv_heads = k_codes.sym_size(1), k_padded = k_codes.sym_size(2);
  const int64_t head_dim = q.sym_size(3).guard_int(__FILE__, __LINE__);
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256,
              "head_dim must be 64, 128 or 256 for attention_wgmma, got ", head_dim);
  TORCH_CHECK(head_dim != 256 || v.scalar_type() == at::kFloat8_e4m3fn,
              "head_dim 256 runs attention_wgmma with FP8 V only (v float8_e4m3fn from quantize_kv), got v of ",
              v.scalar_type());
  TORCH_CHECK(q_len > 0, "q must have at least one token");
  TORCH_CHECK(k_codes.sym_size(0) == batch && k_codes.sym_size(3) == head_dim,
              "k_codes must be [batch, kv_heads, padded_kv_len, head_dim] with q's batch and head_dim");
  TORCH_CHECK(q_heads % kv_heads == 0, "q heads (", q_heads, ") must be a multiple of kv heads (", kv_heads, ")");
  TORCH_CHECK(kv_len > 0 && k_padded >= kv_len && k_padded < kv_len + kWgmmaBlockK,
              "kv_len must be the unpadded length of k_codes (padded to ", kWgmmaBlockK, "), got ", kv_len);
  check_f32(k_scale, "k_scale", {batch, kv_heads, k_padded / kWgmmaBlockK, 4});
  TORCH_CHECK(v.dim() == 4, "v must be 4-D: [batch, kv_heads, head_dim, padded_kv_len] (float8_e4m3fn from "
              "quantize_kv, with v_scale) or [batch, kv_heads, kv_len, head_dim] (q's dtype, without)");
  if (v.scalar_type() == at::kFloat8_e4m3fn) {
    TORCH_CHECK(v.is_contiguous(), "v (float8_e4m3fn) must be contiguous, as quantize_kv returns it");
    TORCH_CHECK(v.sym_sizes() == c10::SymIntArrayRef({batch, kv_heads, c10::SymInt(head_dim), k_padded}),
                "v (float8_e4m3fn) must have shape [batch, kv_heads, head_dim, padded_kv_len] = ",
                c10::SymIntArrayRef({batch, kv_heads, c10::SymInt(head_dim), k_padded}), ", got ", v.sym_sizes());
    TORCH_CHECK(v_tile_scale.has_value(), "v_scale (quantize_kv's v_tile_scale) is required with float8_e4m3fn v");
    check_f32(*v_tile_scale, "v_scale", {batch, kv_heads, k_padded / kWgmmaBlockK});
    if (v_mean) check_f32(*v_mean, "v_mean", {batch, kv_heads, c10::SymInt(head_dim)});
  } else {
    TORCH_CHECK(v.scalar_type() == q.scalar_type(), "v must be float8_e4m3fn (from quantize_kv) or have q's dtype (",
                q.scalar_type(), "), got ", v.scalar_type());
    TORCH_CHECK(!v_tile_scale && !v_mean, "v_scale and v_mean go with float8_e4m3fn v only");
    TORCH_CHECK(v.sym_size(0) == batch && v.sym_size(1) == kv_heads && v.sym_size(2) == kv_len &&
                    v.sym_size(3) == head_dim,
                "v must have shape [batch, kv_heads, kv_len, head_dim] = ",
                c10::SymIntArrayRef({batch, kv_heads, c10::SymInt(kv_len), c10::SymInt(head_dim)}), ", got ",
                v.sym_sizes());
    TORCH_CHECK(v.sym_stride(3) == 1, "v must be contiguous in its last dimension");
    for (int i = 0; i < 3; ++i)
      TORCH_CHECK(v.sym_stride(i) % 8 == 0, "v.stride(", i, ") must be a multiple of 8 elements (16-byte rows)");
  }
  if (k_mean) check_f32(*k_mean, "k_mean", {batch, kv_heads, c10::SymInt(head_dim)});
  for (const at::Tensor* t : {&k_codes, &k_scale, &v})
    TORCH_CHECK(t->device() == q.device(), "all inputs must be on ", q.device());
  for (const auto* t : {&v_tile_scale, &v_mean, &k_mean})
    TORCH_CHECK(!*t || (*t)->device() == q.device(), "all inputs must be on ", q.device());
  return allocate_outputs(batch, q_heads, q_len, head_dim, q.options(), out_nhd, return_lse);
}

}  // namespace sageattention2
