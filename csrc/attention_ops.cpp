// The attention ops (docs/DESIGN.md): validation and output allocation (one place, used by
// the CUDA and Meta implementations; SymInt-aware like preprocess_shapes.cpp), and the CUDA
// implementation that fills the kernel parameters.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <cstring>

#include "attention.h"
#include "attention_params.h"
#include "preprocess.h"

namespace sageattention2 {
namespace {

// log2(e) in double: sageattn's sm_scale * log2(e) (ops.LOG2E) is one double product, rounded to
// float once where a kernel takes it, so the chain and the ops called one by one agree bit for bit.
constexpr double kLog2e = 1.4426950408889634;

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

// A composite op's own arguments (sageattn_wgmma, sageattn_mma), before its three steps validate
// theirs (so that a bad k or v is named as such, not as a preprocessing output).
void check_chain_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sample_stride) {
  TORCH_CHECK(sample_stride >= 1, "sample_stride must be >= 1, got ", sample_stride);
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "k and v must be 4-D [batch, kv_heads, kv_len, head_dim] tensors, got ",
              k.dim(), "-D and ", v.dim(), "-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q (", q.scalar_type(), ") and k (", k.scalar_type(),
              ") must have the same dtype");
}

// The tokens whose mean is a smoothing vector: every sample_stride-th one (a view), or none.
std::optional<at::Tensor> token_sample(const at::Tensor& t, bool wanted, int64_t sample_stride) {
  if (!wanted) return std::nullopt;
  return t.slice(2, std::nullopt, std::nullopt, sample_stride);
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

namespace {

// attention_mma, launched the ordinary way or (after_quantize_kv) as a programmatic dependent of
// the quantize_kv launched just before it by the same call.
std::tuple<at::Tensor, at::Tensor> launch_mma(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                              const at::Tensor& k_codes, const at::Tensor& k_scale,
                                              const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                              const std::optional<at::Tensor>& v_scale,
                                              const std::optional<at::Tensor>& v_mean,
                                              const std::optional<at::Tensor>& k_mean, const std::string& qk_dtype,
                                              int64_t kv_len, double sm_scale, bool is_causal, bool out_nhd,
                                              bool return_lse, bool after_quantize_kv) {
  AttentionOutputs out = allocate_attention_mma(q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean,
                                                qk_dtype, kv_len, out_nhd, return_lse);
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
  const InputDtype dtype = q.scalar_type() == at::kHalf ? InputDtype::kFloat16 : InputDtype::kBFloat16;
  const cudaError_t status = launch_attention_mma(p, dtype, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status != cudaErrorNotSupported, "attention_mma: ",
              fp8_v ? "FP8 PV needs an sm_89+ GPU and a build with code for it (TORCH_CUDA_ARCH_LIST 8.9 or 9.0a)"
                    : "this variant needs more shared memory per block than this GPU allows");
  C10_CUDA_CHECK(status);
  return {out.out, out.lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_mma_cuda(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                                      const at::Tensor& k_codes, const at::Tensor& k_scale,
                                                      const std::optional<at::Tensor>& delta_s, const at::Tensor& v,
                                                      const std::optional<at::Tensor>& v_scale,
                                                      const std::optional<at::Tensor>& v_mean,
                                                      const std::optional<at::Tensor>& k_mean,
                                                      const std::string& qk_dtype, int64_t kv_len, double sm_scale,
                                                      bool is_causal, bool out_nhd, bool return_lse) {
  return launch_mma(q, q_mean, k_codes, k_scale, delta_s, v, v_scale, v_mean, k_mean, qk_dtype, kv_len, sm_scale,
                    is_causal, out_nhd, return_lse, false);
}

AttentionOutputs allocate_attention_wgmma(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                          const at::Tensor& v_fp8, const at::Tensor& v_tile_scale,
                                          const std::optional<at::Tensor>& v_mean,
                                          const std::optional<at::Tensor>& k_mean, int64_t kv_len, bool out_nhd,
                                          bool return_lse) {
  check_q(q);
  check_codes(k_codes, "k_codes", kWgmmaBlockK);
  const c10::SymInt batch = q.sym_size(0), q_heads = q.sym_size(1), q_len = q.sym_size(2);
  const c10::SymInt kv_heads = k_codes.sym_size(1), k_padded = k_codes.sym_size(2);
  const int64_t head_dim = q.sym_size(3).guard_int(__FILE__, __LINE__);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128 for attention_wgmma, got ", head_dim);
  TORCH_CHECK(q_len > 0, "q must have at least one token");
  TORCH_CHECK(k_codes.sym_size(0) == batch && k_codes.sym_size(3) == head_dim,
              "k_codes must be [batch, kv_heads, padded_kv_len, head_dim] with q's batch and head_dim");
  TORCH_CHECK(q_heads % kv_heads == 0, "q heads (", q_heads, ") must be a multiple of kv heads (", kv_heads, ")");
  TORCH_CHECK(kv_len > 0 && k_padded >= kv_len && k_padded < kv_len + kWgmmaBlockK,
              "kv_len must be the unpadded length of k_codes (padded to ", kWgmmaBlockK, "), got ", kv_len);
  check_f32(k_scale, "k_scale", {batch, kv_heads, k_padded / kWgmmaBlockK, 4});
  TORCH_CHECK(v_fp8.scalar_type() == at::kFloat8_e4m3fn && v_fp8.is_contiguous(),
              "v_fp8 must be contiguous float8_e4m3fn (from quantize_kv), got ", v_fp8.scalar_type());
  TORCH_CHECK(v_fp8.sym_sizes() == c10::SymIntArrayRef({batch, kv_heads, c10::SymInt(head_dim), k_padded}),
              "v_fp8 must have shape [batch, kv_heads, head_dim, padded_kv_len] = ",
              c10::SymIntArrayRef({batch, kv_heads, c10::SymInt(head_dim), k_padded}), ", got ", v_fp8.sym_sizes());
  check_f32(v_tile_scale, "v_tile_scale", {batch, kv_heads, k_padded / kWgmmaBlockK});
  if (v_mean) check_f32(*v_mean, "v_mean", {batch, kv_heads, c10::SymInt(head_dim)});
  if (k_mean) check_f32(*k_mean, "k_mean", {batch, kv_heads, c10::SymInt(head_dim)});
  for (const at::Tensor* t : {&k_codes, &k_scale, &v_fp8, &v_tile_scale})
    TORCH_CHECK(t->device() == q.device(), "all inputs must be on ", q.device());
  for (const auto* t : {&v_mean, &k_mean})
    TORCH_CHECK(!*t || (*t)->device() == q.device(), "all inputs must be on ", q.device());
  return allocate_outputs(batch, q_heads, q_len, head_dim, q.options(), out_nhd, return_lse);
}

namespace {

// attention_wgmma (after_quantize_kv: quantize_kv was launched by the same call just before).
std::tuple<at::Tensor, at::Tensor> launch_wgmma(const at::Tensor& q, const at::Tensor& k_codes,
                                                const at::Tensor& k_scale, const at::Tensor& v_fp8,
                                                const at::Tensor& v_tile_scale, const std::optional<at::Tensor>& v_mean,
                                                const std::optional<at::Tensor>& k_mean, int64_t kv_len,
                                                double sm_scale, bool is_causal, bool out_nhd, bool return_lse,
                                                bool after_quantize_kv) {
  AttentionOutputs out =
      allocate_attention_wgmma(q, k_codes, k_scale, v_fp8, v_tile_scale, v_mean, k_mean, kv_len, out_nhd, return_lse);
  check_launchable(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionWgmmaParams p;
  set_shared_params(p, q, k_codes, out, kv_len, return_lse);
  p.k_codes = k_codes.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v_codes = static_cast<const uint8_t*>(v_fp8.data_ptr());
  p.v_tile_scale = v_tile_scale.data_ptr<float>();
  p.v_mean = v_mean ? v_mean->data_ptr<float>() : nullptr;
  p.k_mean = k_mean ? k_mean->data_ptr<float>() : nullptr;
  p.sm_scale = static_cast<float>(sm_scale);
  p.causal = is_causal;
  p.after_quantize_kv = after_quantize_kv;
  const InputDtype dtype = q.scalar_type() == at::kHalf ? InputDtype::kFloat16 : InputDtype::kBFloat16;
  const cudaError_t status = launch_attention_wgmma(p, dtype, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status != cudaErrorNotSupported,
              "attention_wgmma: this build has no sm_90a code or the driver lacks cuTensorMapEncodeTiled");
  C10_CUDA_CHECK(status);
  return {out.out, out.lse};
}

// Whether sageattn_wgmma launches each step as a programmatic dependent of the one before
// (launch.cuh): on unless SAGEATTN_PDL=0 (benchmarks: the same process with and without).
bool programmatic_launches() {
  const char* forced = std::getenv("SAGEATTN_PDL");
  return forced == nullptr || std::strcmp(forced, "0") != 0;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_wgmma_cuda(const at::Tensor& q, const at::Tensor& k_codes,
                                                        const at::Tensor& k_scale, const at::Tensor& v_fp8,
                                                        const at::Tensor& v_tile_scale, const std::optional<at::Tensor>& v_mean,
                                                        const std::optional<at::Tensor>& k_mean, int64_t kv_len,
                                                        double sm_scale, bool is_causal, bool out_nhd, bool return_lse) {
  return launch_wgmma(q, k_codes, k_scale, v_fp8, v_tile_scale, v_mean, k_mean, kv_len, sm_scale, is_causal, out_nhd,
                      return_lse, false);
}

AttentionOutputs allocate_sageattn_wgmma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool smooth_k,
                                         bool smooth_v, int64_t sample_stride, bool out_nhd, bool return_lse) {
  check_chain_inputs(q, k, v, sample_stride);
  std::optional<at::Tensor> k_mean, v_mean;
  if (smooth_k || smooth_v) {
    SmoothingStatsOutputs stats = allocate_smoothing_stats(
        std::nullopt, token_sample(k, smooth_k, sample_stride), token_sample(v, smooth_v, sample_stride), smooth_v);
    if (smooth_k) k_mean = stats.k_mean;
    if (smooth_v) v_mean = stats.v_mean;
  }
  QuantizeKVOutputs kv = allocate_quantize_kv(k, v, k_mean, v_mean, std::nullopt, std::nullopt, kWgmmaBlockK, "int8");
  return allocate_attention_wgmma(q, kv.k_codes, kv.k_scales, kv.v_codes, kv.v_tile_scale, v_mean, k_mean,
                                  k.sym_size(2).guard_int(__FILE__, __LINE__), out_nhd, return_lse);
}

std::tuple<at::Tensor, at::Tensor> sageattn_wgmma_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       bool smooth_k, bool smooth_v, int64_t sample_stride,
                                                       double sm_scale, bool is_causal, bool out_nhd, bool return_lse) {
  check_chain_inputs(q, k, v, sample_stride);
  std::optional<at::Tensor> k_mean, v_mean;
  // All of smoothing_stats' outputs live until the end: quantize_kv, launched as its programmatic
  // dependent, may write before it completes (V without v_mean), so none of its outputs may
  // reuse memory of a tensor smoothing_stats still touches.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats;
  if (smooth_k || smooth_v) {
    stats = smoothing_stats_cuda(std::nullopt, token_sample(k, smooth_k, sample_stride),
                                 token_sample(v, smooth_v, sample_stride), smooth_v);
    if (smooth_k) k_mean = std::get<1>(stats);
    if (smooth_v) v_mean = std::get<2>(stats);
  }
  const bool programmatic = programmatic_launches();
  auto kv = quantize_kv_after_cuda(k, v, k_mean, v_mean, std::nullopt, std::nullopt, kWgmmaBlockK, "int8", 1.0,
                                   programmatic && (smooth_k || smooth_v));
  return launch_wgmma(q, std::get<0>(kv), std::get<1>(kv), std::get<2>(kv), std::get<4>(kv), v_mean, k_mean, k.size(2),
                      sm_scale, is_causal, out_nhd, return_lse, programmatic);
}

namespace {

// What sageattn_mma's steps take, from its arguments (ops.sageattn_mma_chain is the same in
// Python): which statistics run, and over which tokens.
struct MmaChainPlan {
  bool fp8;    // P~ and V in E4M3 (V's per-channel scale from the statistics)
  bool stats;  // a smoothing_stats launch runs
  std::optional<at::Tensor> stats_q, stats_k, stats_v;

  MmaChainPlan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& pv_dtype,
               bool smooth_q, bool smooth_k, int64_t sample_stride) {
    TORCH_CHECK(pv_dtype == "fp8" || pv_dtype == "input", "pv_dtype must be 'fp8' or 'input', got '", pv_dtype, "'");
    fp8 = pv_dtype == "fp8";
    stats = smooth_q || smooth_k || fp8;
    if (smooth_q) stats_q = q;
    // smoothing_stats takes K and V over the same tokens: with FP8 PV, V's range needs all of them.
    if (smooth_k) stats_k = fp8 ? k : *token_sample(k, true, sample_stride);
    if (fp8) stats_v = v;
  }
};

}  // namespace

AttentionOutputs allocate_sageattn_mma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::string& qk_dtype, const std::string& pv_dtype, bool smooth_q,
                                       bool smooth_k, bool smooth_v, int64_t sample_stride, bool out_nhd,
                                       bool return_lse) {
  check_chain_inputs(q, k, v, sample_stride);
  const MmaChainPlan plan(q, k, v, pv_dtype, smooth_q, smooth_k, sample_stride);
  std::optional<at::Tensor> q_mean, k_mean, v_mean, v_scale;
  if (plan.stats) {
    SmoothingStatsOutputs stats =
        allocate_smoothing_stats(plan.stats_q, plan.stats_k, plan.stats_v, plan.fp8 && smooth_v);
    if (smooth_q) q_mean = stats.q_mean;
    if (smooth_k) k_mean = stats.k_mean;
    if (plan.fp8) v_scale = stats.v_scale;
    if (plan.fp8 && smooth_v) v_mean = stats.v_mean;
  }
  QuantizeKVOutputs kv = allocate_quantize_kv(k, plan.fp8 ? std::optional<at::Tensor>(v) : std::nullopt, k_mean,
                                              v_mean, v_scale, q_mean, kMmaBlockK, qk_dtype);
  return allocate_attention_mma(q, q_mean, kv.k_codes, kv.k_scales,
                                q_mean ? std::optional<at::Tensor>(kv.delta_s) : std::nullopt,
                                plan.fp8 ? kv.v_codes : v, v_scale, v_mean, k_mean, qk_dtype,
                                k.sym_size(2).guard_int(__FILE__, __LINE__), out_nhd, return_lse);
}

std::tuple<at::Tensor, at::Tensor> sageattn_mma_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::string& qk_dtype, const std::string& pv_dtype,
                                                     bool smooth_q, bool smooth_k, bool smooth_v,
                                                     int64_t sample_stride, double sm_scale, bool is_causal,
                                                     bool out_nhd, bool return_lse) {
  check_chain_inputs(q, k, v, sample_stride);
  const MmaChainPlan plan(q, k, v, pv_dtype, smooth_q, smooth_k, sample_stride);
  std::optional<at::Tensor> q_mean, k_mean, v_mean, v_scale;
  // As in sageattn_wgmma_cuda: the statistics' outputs live until the end, so that nothing
  // quantize_kv writes can reuse memory a still-running smoothing_stats touches.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats;
  if (plan.stats) {
    stats = smoothing_stats_cuda(plan.stats_q, plan.stats_k, plan.stats_v, plan.fp8 && smooth_v);
    if (smooth_q) q_mean = std::get<0>(stats);
    if (smooth_k) k_mean = std::get<1>(stats);
    if (plan.fp8) v_scale = std::get<3>(stats);
    if (plan.fp8 && smooth_v) v_mean = std::get<2>(stats);
  }
  const bool programmatic = programmatic_launches();
  // The Delta-S multiplier of quantize_kv: the Q scales' sm_scale * log2(e) (kLog2e).
  auto kv = quantize_kv_after_cuda(k, plan.fp8 ? std::optional<at::Tensor>(v) : std::nullopt, k_mean, v_mean, v_scale,
                                   q_mean, kMmaBlockK, qk_dtype, sm_scale * kLog2e,
                                   programmatic && plan.stats);
  return launch_mma(q, q_mean, std::get<0>(kv), std::get<1>(kv),
                    q_mean ? std::optional<at::Tensor>(std::get<3>(kv)) : std::nullopt,
                    plan.fp8 ? std::get<2>(kv) : v, v_scale, v_mean, k_mean, qk_dtype, k.size(2), sm_scale, is_causal,
                    out_nhd, return_lse, programmatic);
}

}  // namespace sageattention2
