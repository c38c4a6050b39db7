// Argument validation and output allocation of the preprocessing ops: the one place that
// knows their shapes (used by the CUDA and the Meta implementations alike).
//
// Batch, heads and tokens are handled as SymInts, so that under torch.compile(dynamic=True) the
// Meta implementation traces symbolic sequence lengths instead of specialising on each one.
// head_dim and strides are read as plain integers (a guard), since kernels specialise on them.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "common/geometry.h"
#include "torch/preprocess.h"

namespace sageattention2 {
namespace {

at::Tensor empty_absent(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(at::kFloat));
}

// A [B, H, N, D] fp16/bf16 view: N > 0, D a multiple of 8 up to 256, last dim contiguous.
void check_bhnd(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, " must be a 4-D [batch, heads, tokens, head_dim] tensor, got ",
              t.dim(), " dimensions");
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, name,
              " must be float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.sym_size(2) > 0, name, " must have at least one token (size(2) > 0)");
  TORCH_CHECK(t.sym_size(0) > 0 && t.sym_size(1) > 0, name, " must have batch and heads > 0, got shape ",
              t.sym_sizes());
  const int64_t d = t.sym_size(3).guard_int(__FILE__, __LINE__);
  TORCH_CHECK(d % kElemsPerVector == 0 && d > 0 && d <= kMaxHeadDim, name,
              ".size(-1) (head_dim) must be a multiple of 8 in [8, 256], got ", d);
  TORCH_CHECK(t.sym_stride(3) == 1, name, " must be contiguous in its last dimension, got stride ",
              t.sym_stride(3));
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(t.sym_stride(i) % kElemsPerVector == 0, name, ".stride(", i,
                ") must be a multiple of 8 elements (16-byte rows), got ", t.sym_stride(i));
}

void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), a_name, " and ", b_name, " must be on the same device, got ",
              a.device(), " and ", b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), a_name, " and ", b_name,
              " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

// A float32 per-(batch, head) channel vector such as a mean or a scale.
void check_channel_vector(const at::Tensor& t, const char* name, const c10::SymInt& batch,
                          const c10::SymInt& heads, int64_t head_dim, const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3 && t.sym_size(0) == batch && t.sym_size(1) == heads && t.sym_size(2) == head_dim,
              name, " must have shape [", batch, ", ", heads, ", ", head_dim, "], got ", t.sym_sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

QkDtype parse_qk_dtype(const std::string& name) {
  if (name == "int8") return QkDtype::kInt8;
  if (name == "int4") return QkDtype::kInt4;
  TORCH_CHECK(false, "qk_dtype must be \"int8\" or \"int4\", got \"", name, "\"");
}

void check_launchable(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must start at a 16-byte aligned address (its storage offset is not a multiple of 8 "
              "elements)");
}

const uint8_t* int8_heads_pointer(const at::Tensor& int8_heads, int64_t batch, int64_t kv_heads, const char* op) {
  TORCH_CHECK(int8_heads.scalar_type() == at::kByte && int8_heads.is_contiguous() &&
                  int8_heads.numel() == batch * kv_heads,
              op, ": int8_heads must be a contiguous uint8 [B, H_kv] tensor");
  return int8_heads.data_ptr<uint8_t>();
}

SmoothingStatsOutputs allocate_smoothing_stats(const std::optional<at::Tensor>& q,
                                               const std::optional<at::Tensor>& k,
                                               const std::optional<at::Tensor>& v, bool smooth_v) {
  TORCH_CHECK(q || k || v, "smoothing_stats needs at least one of q, k, v");
  const at::Tensor& any = q ? *q : (k ? *k : *v);
  SmoothingStatsOutputs out{empty_absent(any), empty_absent(any), empty_absent(any), empty_absent(any)};
  auto f32 = any.options().dtype(at::kFloat);
  if (q) {
    check_bhnd(*q, "q");
    check_same(*q, "q", any, "the other inputs");
    out.q_mean = at::empty_symint({q->sym_size(0), q->sym_size(1), q->sym_size(3)}, f32);
  }
  if (k) {
    check_bhnd(*k, "k");
    check_same(*k, "k", any, "the other inputs");
    out.k_mean = at::empty_symint({k->sym_size(0), k->sym_size(1), k->sym_size(3)}, f32);
  }
  if (v) {
    check_bhnd(*v, "v");
    check_same(*v, "v", any, "the other inputs");
    if (smooth_v) out.v_mean = at::empty_symint({v->sym_size(0), v->sym_size(1), v->sym_size(3)}, f32);
    out.v_scale = at::empty_symint({v->sym_size(0), v->sym_size(1), v->sym_size(3)}, f32);
  }
  if (q && k) {
    TORCH_CHECK(q->sym_size(0) == k->sym_size(0), "q and k must have the same batch size");
    TORCH_CHECK(q->sym_size(3) == k->sym_size(3), "q and k must have the same head_dim");
  }
  if (k && v) {
    TORCH_CHECK(k->sym_size(0) == v->sym_size(0) && k->sym_size(1) == v->sym_size(1) &&
                    k->sym_size(2) == v->sym_size(2),
                "k and v must have the same batch, heads and tokens, got ", k->sym_sizes(), " and ",
                v->sym_sizes());
  }
  return out;
}

QuantizeKVOutputs allocate_quantize_kv(const at::Tensor& k, const std::optional<at::Tensor>& v,
                                       const std::optional<at::Tensor>& k_mean,
                                       const std::optional<at::Tensor>& v_mean,
                                       const std::optional<at::Tensor>& v_scale,
                                       const std::optional<at::Tensor>& q_mean, int64_t block_k,
                                       const std::string& qk_dtype) {
  check_bhnd(k, "k");
  const QkDtype dtype = parse_qk_dtype(qk_dtype);
  TORCH_CHECK(valid_block_k(static_cast<int>(block_k)), "block_k must be 32, 64 or 128, got ", block_k);
  const c10::SymInt batch = k.sym_size(0), heads = k.sym_size(1), tokens = k.sym_size(2);
  const int64_t d = k.sym_size(3).guard_int(__FILE__, __LINE__);
  if (k_mean) check_channel_vector(*k_mean, "k_mean", batch, heads, d, k);
  if (v) {
    check_bhnd(*v, "v");
    check_same(k, "k", *v, "v");
    TORCH_CHECK(v->sym_sizes() == k.sym_sizes(), "v must have the shape of k, got ", v->sym_sizes(),
                " and ", k.sym_sizes());
    // With v_scale (smoothing_stats' per-channel scale) V is quantized per channel; without it,
    // with one scale per block_k-key tile, taken here (v_tile_scale).
    if (v_scale) check_channel_vector(*v_scale, "v_scale", batch, heads, d, k);
    if (v_mean) check_channel_vector(*v_mean, "v_mean", batch, heads, d, k);
  } else {
    TORCH_CHECK(!v_mean && !v_scale, "v_mean and v_scale are only meaningful with v");
  }
  c10::SymInt q_heads = 0;
  if (q_mean) {
    TORCH_CHECK(q_mean->dim() == 3, "q_mean must have shape [batch, q_heads, head_dim], got ",
                q_mean->sym_sizes());
    q_heads = q_mean->sym_size(1);
    TORCH_CHECK(q_heads > 0 && q_heads % heads == 0, "q_mean's heads (", q_heads,
                ") must be a positive multiple of k's heads (", heads, ")");
    check_channel_vector(*q_mean, "q_mean", batch, q_heads, d, k);
  }
  const c10::SymInt blocks = (tokens + (block_k - 1)) / block_k;
  const c10::SymInt padded = blocks * block_k;
  const int64_t code_dim = dtype == QkDtype::kInt4 ? d / 2 : d;
  auto opts = k.options();
  QuantizeKVOutputs out;
  out.k_codes = at::empty_symint({batch, heads, padded, code_dim}, opts.dtype(at::kChar));
  out.k_scales = at::empty_symint({batch, heads, blocks, 4}, opts.dtype(at::kFloat));
  out.v_codes = v ? at::empty_symint({batch, heads, d, padded}, opts.dtype(at::kFloat8_e4m3fn)) : empty_absent(k);
  out.delta_s = q_mean ? at::empty_symint({batch, q_heads, padded}, opts.dtype(at::kFloat)) : empty_absent(k);
  out.v_tile_scale = v && !v_scale ? at::empty_symint({batch, heads, blocks}, opts.dtype(at::kFloat)) : empty_absent(k);
  return out;
}

CenterKeysOutputs allocate_center_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                                       const at::Tensor& k_mean) {
  check_bhnd(q, "q");
  check_bhnd(k, "k");
  check_same(k, "k", q, "q");
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && k.sym_size(3) == q.sym_size(3), "center_keys: k must be [",
              q.sym_size(0), ", H_kv, N_k, ", q.sym_size(3), "] (q's batch and head_dim), got ", k.sym_sizes());
  TORCH_CHECK(q.sym_size(1) % k.sym_size(1) == 0, "center_keys: k's heads (", k.sym_size(1), ") must divide q's (",
              q.sym_size(1), ")");
  TORCH_CHECK(lse.device() == q.device() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.dim() == 3 && lse.sym_size(0) == q.sym_size(0) && lse.sym_size(1) == q.sym_size(1) &&
                  lse.sym_size(2) == q.sym_size(2),
              "center_keys: lse must be a contiguous float32 [", q.sym_size(0), ", ", q.sym_size(1), ", ",
              q.sym_size(2), "] on q's device, got ", lse.sym_sizes(), " ", lse.scalar_type());
  check_channel_vector(k_mean, "k_mean", k.sym_size(0), k.sym_size(1), k.sym_size(3).guard_int(__FILE__, __LINE__), q);
  return {at::empty_symint(k.sym_sizes(), k.options()), at::empty_symint(lse.sym_sizes(), lse.options())};
}

}  // namespace sageattention2
