// The composite ops sageattn_wgmma and sageattn_mma (docs/DESIGN.md#composite-ops): a sageattn
// call's preprocessing and attention launches in one op, with its shapes (for the Meta
// implementation) and its CUDA implementation side by side.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "hopper/params.h"  // kWgmmaBlockK
#include "mma/params.h"     // kMmaBlockK
#include "torch/attention.h"
#include "torch/environment.h"
#include "torch/preprocess.h"

namespace sageattention2 {
namespace {

// A composite op's own arguments (sageattn_wgmma, sageattn_mma), before its three steps validate
// theirs (so that a bad k or v is named as such, not as a preprocessing output).
void check_chain_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t sample_stride) {
  TORCH_CHECK(sample_stride >= 1, "sample_stride must be >= 1, got ", sample_stride);
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "k and v must be 4-D [batch, kv_heads, kv_len, head_dim] tensors, got ",
              k.dim(), "-D and ", v.dim(), "-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q (", q.scalar_type(), ") and k (", k.scalar_type(),
              ") must have the same dtype");
}

// int4_guard: 0 (off) or the guard's threshold, a ratio of channel ranges (>= 1).
void check_int4_guard(double int4_guard) {
  TORCH_CHECK(int4_guard == 0.0 || int4_guard >= 1.0, "int4_guard must be 0 (off) or >= 1, got ", int4_guard);
}

// pv_dtype of the Hopper composite: "fp8" (V quantized, one scale per tile) or "input" (V as it is).
bool wgmma_fp8_pv(const std::string& pv_dtype) {
  TORCH_CHECK(pv_dtype == "fp8" || pv_dtype == "input", "pv_dtype must be 'fp8' or 'input', got '", pv_dtype, "'");
  return pv_dtype == "fp8";
}

// key_ranges of sageattn_wgmma: int32 [batch, 3], contiguous, on q's device, without is_causal
// and with sample_stride 1 (each item's stride is its own).
void check_key_ranges(const std::optional<at::Tensor>& key_ranges, const at::Tensor& q, bool is_causal,
                      int64_t sample_stride) {
  if (!key_ranges) return;
  const at::Tensor& r = *key_ranges;
  TORCH_CHECK(r.scalar_type() == at::kInt && r.dim() == 2 && r.sym_size(0) == q.sym_size(0) && r.sym_size(1) == 3,
              "key_ranges must be an int32 [batch, 3] tensor (per batch item: first key, end key, smoothing "
              "sample stride), got ", r.scalar_type(), " ", r.sym_sizes());
  TORCH_CHECK(sample_stride == 1, "with key_ranges, sample_stride must be 1 (each item's is key_ranges[:, 2]), got ",
              sample_stride);
  TORCH_CHECK(r.device() == q.device(), "key_ranges must be on q's device (", q.device(), "), got ", r.device());
  TORCH_CHECK(r.is_contiguous(), "key_ranges must be contiguous");
  TORCH_CHECK(!is_causal, "key_ranges cannot be combined with is_causal (a key-padding mask, as SDPA's attn_mask)");
}

// key_mask of sageattn_wgmma: a [1 or batch, 1, 1 or q_len, kv_len] bool or float16/bfloat16/float32
// mask on q's device, not with key_ranges or is_causal, with sample_tokens >= 1 and sample_stride 1.
void check_key_mask(const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& key_ranges,
                    const at::Tensor& q, const at::Tensor& k, bool is_causal, int64_t sample_stride,
                    int64_t sample_tokens) {
  if (!key_mask) return;
  const at::Tensor& m = *key_mask;
  TORCH_CHECK(!key_ranges, "key_mask and key_ranges cannot both be given");
  TORCH_CHECK(m.dim() == 4 && (m.sym_size(0) == 1 || m.sym_size(0) == q.sym_size(0)) && m.sym_size(1) == 1 &&
                  (m.sym_size(2) == 1 || m.sym_size(2) == q.sym_size(2)) && m.sym_size(3) == k.sym_size(2),
              "key_mask must be [1 or batch, 1, 1 or q_len, kv_len], got ", m.sym_sizes());
  const auto t = m.scalar_type();
  TORCH_CHECK(t == at::kBool || t == at::kHalf || t == at::kBFloat16 || t == at::kFloat,
              "key_mask must be bool, float16, bfloat16 or float32, got ", t);
  TORCH_CHECK(m.device() == q.device(), "key_mask must be on q's device (", q.device(), "), got ", m.device());
  TORCH_CHECK(!is_causal, "key_mask cannot be combined with is_causal (a key-padding mask, as SDPA's attn_mask)");
  TORCH_CHECK(sample_tokens >= 1, "with key_mask, sample_tokens must be >= 1, got ", sample_tokens);
  TORCH_CHECK(sample_stride == 1, "with key_mask, sample_stride must be 1 (each item's comes from sample_tokens), got ",
              sample_stride);
}

// The tokens whose mean is a smoothing vector: every sample_stride-th one (a view), or none.
std::optional<at::Tensor> token_sample(const at::Tensor& t, bool wanted, int64_t sample_stride) {
  if (!wanted) return std::nullopt;
  return t.slice(2, std::nullopt, std::nullopt, sample_stride);
}

}  // namespace

AttentionOutputs allocate_sageattn_wgmma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const std::string& pv_dtype, bool smooth_k, bool smooth_v,
                                         int64_t sample_stride, bool out_nhd, bool return_lse,
                                         const std::optional<at::Tensor>& key_ranges, bool is_causal,
                                         const std::optional<at::Tensor>& key_mask, int64_t sample_tokens) {
  check_chain_inputs(q, k, v, sample_stride);
  check_key_ranges(key_ranges, q, is_causal, sample_stride);
  check_key_mask(key_mask, key_ranges, q, k, is_causal, sample_stride, sample_tokens);
  const bool fp8 = wgmma_fp8_pv(pv_dtype);
  smooth_v = smooth_v && fp8;  // (16-bit V is not quantized: nothing to smooth)
  std::optional<at::Tensor> k_mean, v_mean;
  if (smooth_k || smooth_v) {
    SmoothingStatsOutputs stats = allocate_smoothing_stats(
        std::nullopt, token_sample(k, smooth_k, sample_stride), token_sample(v, smooth_v, sample_stride), smooth_v);
    if (smooth_k) k_mean = stats.k_mean;
    if (smooth_v) v_mean = stats.v_mean;
  }
  QuantizeKVOutputs kv = allocate_quantize_kv(k, fp8 ? std::optional<at::Tensor>(v) : std::nullopt, k_mean, v_mean,
                                              std::nullopt, std::nullopt, kWgmmaBlockK, "int8");
  return allocate_attention_wgmma(q, kv.k_codes, kv.k_scales, fp8 ? kv.v_codes : v,
                                  fp8 ? std::optional<at::Tensor>(kv.v_tile_scale) : std::nullopt, v_mean, k_mean,
                                  k.sym_size(2).guard_int(__FILE__, __LINE__), out_nhd, return_lse);
}

std::tuple<at::Tensor, at::Tensor> sageattn_wgmma_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::string& pv_dtype, bool smooth_k, bool smooth_v,
                                                       int64_t sample_stride, double sm_scale, bool is_causal,
                                                       bool out_nhd, bool return_lse,
                                                       const std::optional<at::Tensor>& key_ranges,
                                                       const std::optional<at::Tensor>& key_mask, int64_t sample_tokens) {
  check_chain_inputs(q, k, v, sample_stride);
  check_key_ranges(key_ranges, q, is_causal, sample_stride);
  check_key_mask(key_mask, key_ranges, q, k, is_causal, sample_stride, sample_tokens);
  const int* ranges = key_ranges ? key_ranges->data_ptr<int>() : nullptr;
  at::Tensor mask_valid;  // [B] 1 where key_mask is a key-padding mask (key_ranges_of_mask_cuda)
  at::Tensor mask_ranges;
  if (key_mask) {
    std::tie(mask_ranges, mask_valid) = key_ranges_of_mask_cuda(*key_mask, q.size(0), sample_tokens);
    ranges = mask_ranges.data_ptr<int>();
  }
  const bool fp8 = wgmma_fp8_pv(pv_dtype);
  smooth_v = smooth_v && fp8;
  std::optional<at::Tensor> k_mean, v_mean;
  // All of smoothing_stats' outputs live until the end: quantize_kv, launched as its programmatic
  // dependent, may write before it completes (V without v_mean), so none of its outputs may
  // reuse memory of a tensor smoothing_stats still touches.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats;
  if (smooth_k || smooth_v) {
    stats = smoothing_stats_key_ranges_cuda(token_sample(k, smooth_k, sample_stride),
                                            token_sample(v, smooth_v, sample_stride), smooth_v, ranges);
    if (smooth_k) k_mean = std::get<1>(stats);
    if (smooth_v) v_mean = std::get<2>(stats);
  }
  const bool programmatic = programmatic_launches();
  auto kv = quantize_kv_heads_cuda(k, fp8 ? std::optional<at::Tensor>(v) : std::nullopt, k_mean, v_mean, std::nullopt,
                                   std::nullopt, kWgmmaBlockK, "int8", 1.0, programmatic && (smooth_k || smooth_v),
                                   std::nullopt, false, ranges);
  auto result = attention_wgmma_after_cuda(q, std::get<0>(kv), std::get<1>(kv), fp8 ? std::get<2>(kv) : v,
                                           fp8 ? std::optional<at::Tensor>(std::get<4>(kv)) : std::nullopt, v_mean,
                                           k_mean, k.size(2), sm_scale, is_causal, out_nhd, return_lse, programmatic,
                                           ranges);
  if (key_mask) poison_invalid_items_cuda(std::get<0>(result), std::get<1>(result), mask_valid);
  return result;
}

namespace {

// sageattn_wgmma_varlen's arguments (attention.h), for its CUDA and Meta implementations alike.
void check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& items,
                         const at::Tensor& blocks, int64_t max_seqlen_k, int64_t code_rows,
                         const std::optional<at::Tensor>& v_rows) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "q, k and v must be 3-D [total tokens, heads, head_dim] (packed sequences), got ", q.dim(), "-D, ",
              k.dim(), "-D and ", v.dim(), "-D");
  const auto t = q.scalar_type();
  TORCH_CHECK((t == at::kHalf || t == at::kBFloat16) && k.scalar_type() == t && v.scalar_type() == t,
              "q, k and v must be float16 or bfloat16, all the same, got ", t, ", ", k.scalar_type(), ", ",
              v.scalar_type());
  const int64_t d = q.size(2);
  TORCH_CHECK((d == 64 || d == 128 || d == 256) && k.size(2) == d && v.size(2) == d,
              "packed sequences run at head_dim 64, 128 or 256, the same for q, k and v; got ", d, ", ",
              k.size(2), ", ", v.size(2));
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "k and v must be [total_k, kv_heads, head_dim] alike, and q's heads a multiple of kv_heads; got q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(0) % 8 == 0 && x->stride(1) % 8 == 0,
                "q, k and v must have a contiguous last dimension and token and head strides that are multiples "
                "of 8 elements, got strides ", x->strides());
  TORCH_CHECK(items.scalar_type() == at::kInt && items.dim() == 3 && items.size(0) == 2 && items.size(1) >= 1 &&
                  items.size(2) == 3 && items.is_contiguous(),
              "items must be a contiguous int32 [2, sequences, 3] tensor, got ", items.scalar_type(), " ",
              items.sizes());
  TORCH_CHECK(blocks.scalar_type() == at::kInt && blocks.dim() == 2 && blocks.size(0) >= 1 && blocks.size(1) == 2 &&
                  blocks.is_contiguous(),
              "blocks must be a contiguous int32 [Q blocks, 2] tensor (sequence, block), got ", blocks.scalar_type(),
              " ", blocks.sizes());
  TORCH_CHECK(items.device() == q.device() && blocks.device() == q.device() && k.device() == q.device() &&
                  v.device() == q.device(),
              "q, k, v, items and blocks must be on one device");
  TORCH_CHECK(max_seqlen_k >= 1, "max_seqlen_k must be >= 1, got ", max_seqlen_k);
  TORCH_CHECK(code_rows > 0 && code_rows % kWgmmaBlockK == 0, "code_rows must be a positive multiple of ",
              kWgmmaBlockK, ", got ", code_rows);
  if (v_rows) {
    TORCH_CHECK(d == 64 || d == 128, "the accurate tier (v_rows given) runs head_dim 64 or 128, got ", d);
    TORCH_CHECK(v_rows->scalar_type() == at::kLong && v_rows->dim() == 1 && v_rows->size(0) >= k.size(0) &&
                    v_rows->size(0) <= k.size(0) + code_rows && v_rows->device() == q.device(),
                "v_rows must be an int64 [total_k + pad rows] tensor on q's device (each key's row, then the "
                "rows to zero), with at most code_rows pad rows; got ", v_rows->scalar_type(), " ", v_rows->sizes(),
                " for ", k.size(0), " keys and ", code_rows, " code rows");
  }
}

// The validated items tensor of both packed composites ([2, S, 3] int32: the key ranges, then
// the packed items) and the caller's K and V as one batch entry per sequence (items_view).
struct PackedSequences {
  int64_t count;
  const int* ranges;
  const int* packed;
  at::Tensor k_items, v_items;

  PackedSequences(const at::Tensor& items, const at::Tensor& k, const at::Tensor& v)
      : count(items.size(1)),
        ranges(items.data_ptr<int>()),
        packed(ranges + 3 * count),
        k_items(items_view(k, count)),
        v_items(items_view(v, count)) {}
};

// sageattn_mma_varlen's arguments: sageattn_wgmma_varlen's, at the warp-level kernel's head dims,
// and its PV type.
void check_mma_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& items,
                             const at::Tensor& blocks, int64_t max_seqlen_k, int64_t code_rows,
                             const std::string& pv_dtype) {
  check_varlen_inputs(q, k, v, items, blocks, max_seqlen_k, code_rows, std::nullopt);
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "the warp-level kernel runs packed sequences at head_dim 64 or "
              "128, got ", q.size(2));
  TORCH_CHECK(pv_dtype == "fp8" || pv_dtype == "input", "pv_dtype must be 'fp8' or 'input', got '", pv_dtype, "'");
}

}  // namespace

AttentionOutputs allocate_sageattn_wgmma_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& items, const at::Tensor& blocks,
                                                int64_t max_seqlen_k, int64_t code_rows, bool return_lse,
                                                const std::optional<at::Tensor>& v_rows) {
  check_varlen_inputs(q, k, v, items, blocks, max_seqlen_k, code_rows, v_rows);
  return allocate_packed_outputs(q, return_lse);
}

std::tuple<at::Tensor, at::Tensor> sageattn_wgmma_varlen_cuda(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& items,
                                                              const at::Tensor& blocks, int64_t max_seqlen_k,
                                                              int64_t code_rows, bool smooth_k, bool smooth_v,
                                                              double sm_scale, bool is_causal, bool return_lse,
                                                              const std::optional<at::Tensor>& v_rows) {
  check_varlen_inputs(q, k, v, items, blocks, max_seqlen_k, code_rows, v_rows);
  const PackedSequences seqs(items, k, v);
  const int *ranges = seqs.ranges, *packed = seqs.packed;
  const at::Tensor &k_items = seqs.k_items, &v_items = seqs.v_items;
  // The accurate tier reads V through the copy engine in tiles of 128 keys: a copy with each
  // sequence's keys from its code row and zeros up to the next, so that no sequence's last tile
  // reaches the next one's keys (the last row takes the keys of sequences without queries, and
  // is never read). Only the pad rows are zeroed (v_rows lists them after the keys' rows): a
  // zero fill of the whole copy wrote V's bytes twice. It runs first, so that the statistics,
  // quantize_kv and the kernel keep their programmatic chain.
  const bool fp8 = !v_rows.has_value();
  at::Tensor v_padded;
  if (!fp8) {
    const int64_t keys = k.size(0);
    v_padded = at::empty({code_rows + 1, v.size(1), v.size(2)}, v.options());
    v_padded.index_copy_(0, v_rows->narrow(0, 0, keys), v);
    if (v_rows->size(0) > keys) v_padded.index_fill_(0, v_rows->narrow(0, keys, v_rows->size(0) - keys), 0);
    smooth_v = false;  // (V is not quantized)
  }
  std::optional<at::Tensor> k_mean, v_mean;
  // As in sageattn_wgmma_cuda: the statistics' outputs live until the end.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats;
  if (smooth_k || smooth_v) {
    stats = smoothing_stats_key_ranges_cuda(smooth_k ? std::optional<at::Tensor>(k_items) : std::nullopt,
                                            smooth_v ? std::optional<at::Tensor>(v_items) : std::nullopt, smooth_v,
                                            ranges);
    if (smooth_k) k_mean = std::get<1>(stats);
    if (smooth_v) v_mean = std::get<2>(stats);
  }
  const bool programmatic = programmatic_launches();
  const int64_t item_padded = (max_seqlen_k + kWgmmaBlockK - 1) / kWgmmaBlockK * kWgmmaBlockK;
  auto kv = quantize_kv_packed_cuda(k_items, fp8 ? std::optional<at::Tensor>(v_items) : std::nullopt, k_mean, v_mean,
                                    ranges, packed, code_rows, item_padded, programmatic && (smooth_k || smooth_v));
  return attention_wgmma_packed_cuda(q, std::get<0>(kv), std::get<1>(kv), fp8 ? std::get<2>(kv) : v_padded,
                                     fp8 ? std::optional<at::Tensor>(std::get<3>(kv)) : std::nullopt, v_mean, k_mean,
                                     ranges, packed, seqs.count, blocks.data_ptr<int>(), blocks.size(0), k.size(0),
                                     sm_scale, is_causal, return_lse, programmatic);
}

AttentionOutputs allocate_sageattn_mma_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& items, const at::Tensor& blocks,
                                              int64_t max_seqlen_k, int64_t code_rows, const std::string& pv_dtype,
                                              bool return_lse) {
  check_mma_varlen_inputs(q, k, v, items, blocks, max_seqlen_k, code_rows, pv_dtype);
  return allocate_packed_outputs(q, return_lse);
}

std::tuple<at::Tensor, at::Tensor> sageattn_mma_varlen_cuda(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& items,
                                                            const at::Tensor& blocks, int64_t max_seqlen_k,
                                                            int64_t code_rows, const std::string& pv_dtype,
                                                            bool smooth_k, bool smooth_v, double sm_scale,
                                                            bool is_causal, bool return_lse) {
  check_mma_varlen_inputs(q, k, v, items, blocks, max_seqlen_k, code_rows, pv_dtype);
  const PackedSequences seqs(items, k, v);
  const int *ranges = seqs.ranges, *packed = seqs.packed;
  const at::Tensor &k_items = seqs.k_items, &v_items = seqs.v_items;
  const bool fp8 = pv_dtype == "fp8";
  smooth_v = smooth_v && fp8;  // (16-bit V is not quantized)
  // As sageattn_mma: one statistics launch, K's mean (over the items' sample: every key with FP8
  // PV, whose V range needs them all) and FP8 V's range and mean; the outputs live until the end.
  std::optional<at::Tensor> k_mean, v_mean, v_scale;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats;
  if (smooth_k || fp8) {
    stats = smoothing_stats_key_ranges_cuda(smooth_k ? std::optional<at::Tensor>(k_items) : std::nullopt,
                                            fp8 ? std::optional<at::Tensor>(v_items) : std::nullopt, smooth_v, ranges);
    if (smooth_k) k_mean = std::get<1>(stats);
    if (smooth_v) v_mean = std::get<2>(stats);
    if (fp8) v_scale = std::get<3>(stats);
  }
  const bool programmatic = programmatic_launches();
  const int64_t item_padded = (max_seqlen_k + kMmaBlockK - 1) / kMmaBlockK * kMmaBlockK;
  auto kv = quantize_kv_packed_cuda(k_items, fp8 ? std::optional<at::Tensor>(v_items) : std::nullopt, k_mean, v_mean,
                                    ranges, packed, code_rows, item_padded, programmatic && (smooth_k || fp8), v_scale);
  return attention_mma_packed_cuda(q, std::get<0>(kv), std::get<1>(kv), fp8 ? std::get<2>(kv) : v, v_scale, v_mean,
                                   k_mean, ranges, packed, blocks.data_ptr<int>(), blocks.size(0), max_seqlen_k,
                                   sm_scale, is_causal, return_lse, programmatic);
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
                                       bool return_lse, double int4_guard) {
  check_chain_inputs(q, k, v, sample_stride);
  check_int4_guard(int4_guard);
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

namespace {

// sageattn_mma with INT4 QK and the guard (docs/DECISIONS.md#d38). One smoothing_stats launch
// over all tokens of Q, K (their means and channel ranges) and V; per KV head a flag, 1 where
// K's or any of its Q heads' largest channel range exceeds `threshold` times their mean nonzero
// channel range (INT4's per-thread groups share one scale over all channels: a few wide channels leave
// the others a code or two); quantize_kv and attention_mma each twice, INT4 over the heads
// flagged 0 (V's FP8 codes with them), INT8 over those flagged 1, the attention into one output.
// No programmatic launches: the flags come from ATen reductions between the launches.
std::tuple<at::Tensor, at::Tensor> sageattn_mma_int4_guarded(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const MmaChainPlan& plan,
                                                             bool smooth_q, bool smooth_k, bool smooth_v,
                                                             double sm_scale, bool is_causal, bool out_nhd,
                                                             bool return_lse, double threshold) {
  TORCH_CHECK(plan.fp8, "INT4 QK runs with FP8 PV only");
  const auto stats = smoothing_stats_ranges_cuda(q, k, v, smooth_v);
  const std::optional<at::Tensor> q_mean = smooth_q ? std::optional<at::Tensor>(std::get<0>(stats)) : std::nullopt;
  const std::optional<at::Tensor> k_mean = smooth_k ? std::optional<at::Tensor>(std::get<1>(stats)) : std::nullopt;
  const std::optional<at::Tensor> v_mean = smooth_v ? std::optional<at::Tensor>(std::get<2>(stats)) : std::nullopt;
  const at::Tensor& v_scale = std::get<3>(stats);
  // [B, H]: the largest channel range over the mean of the nonzero ones (a head_dim padded with
  // zero channels, 40 -> 64, must not look spread: ops.channel_spread).
  const auto spread = [](const at::Tensor& range) {
    return range.amax(-1).mul(range.gt(0).sum(-1)).div(range.sum(-1));
  };
  const int64_t batch = q.size(0), kv_heads = k.size(1);
  const at::Tensor q_spread = spread(std::get<4>(stats)).view({batch, kv_heads, -1}).amax(-1);
  const at::Tensor int8_heads =
      spread(std::get<5>(stats)).gt(threshold).logical_or(q_spread.gt(threshold)).to(at::kByte).contiguous();
  const double delta_s_multiplier = sm_scale * kLog2e;
  auto kv4 = quantize_kv_heads_cuda(k, v, k_mean, v_mean, v_scale, q_mean, kMmaBlockK, "int4", delta_s_multiplier,
                                    false, int8_heads, false);
  auto kv8 = quantize_kv_heads_cuda(k, std::nullopt, k_mean, std::nullopt, std::nullopt, q_mean, kMmaBlockK, "int8",
                                    delta_s_multiplier, false, int8_heads, true);
  const at::Tensor& v_codes = std::get<2>(kv4);
  const int64_t kv_len = k.size(2);
  const AttentionOutputs out =
      allocate_attention_mma(q, q_mean, std::get<0>(kv4), std::get<1>(kv4),
                             q_mean ? std::optional<at::Tensor>(std::get<3>(kv4)) : std::nullopt, v_codes, v_scale,
                             v_mean, k_mean, "int4", kv_len, out_nhd, return_lse);
  attention_mma_heads_into_cuda(out, q, q_mean, std::get<0>(kv4), std::get<1>(kv4),
                                q_mean ? std::optional<at::Tensor>(std::get<3>(kv4)) : std::nullopt, v_codes, v_scale,
                                v_mean, k_mean, "int4", kv_len, sm_scale, is_causal, return_lse, int8_heads, false);
  attention_mma_heads_into_cuda(out, q, q_mean, std::get<0>(kv8), std::get<1>(kv8),
                                q_mean ? std::optional<at::Tensor>(std::get<3>(kv8)) : std::nullopt, v_codes, v_scale,
                                v_mean, k_mean, "int8", kv_len, sm_scale, is_causal, return_lse, int8_heads, true);
  return {out.out, out.lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sageattn_mma_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::string& qk_dtype, const std::string& pv_dtype,
                                                     bool smooth_q, bool smooth_k, bool smooth_v,
                                                     int64_t sample_stride, double sm_scale, bool is_causal,
                                                     bool out_nhd, bool return_lse, double int4_guard) {
  check_chain_inputs(q, k, v, sample_stride);
  check_int4_guard(int4_guard);
  if (int4_guard > 0 && parse_qk_dtype(qk_dtype) == QkDtype::kInt4) {
    const MmaChainPlan plan(q, k, v, pv_dtype, smooth_q, smooth_k, sample_stride);
    return sageattn_mma_int4_guarded(q, k, v, plan, smooth_q, smooth_k, smooth_v, sm_scale, is_causal, out_nhd,
                                     return_lse, int4_guard);
  }
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
  return attention_mma_after_cuda(q, q_mean, std::get<0>(kv), std::get<1>(kv),
                    q_mean ? std::optional<at::Tensor>(std::get<3>(kv)) : std::nullopt,
                    plan.fp8 ? std::get<2>(kv) : v, v_scale, v_mean, k_mean, qk_dtype, k.size(2), sm_scale, is_causal,
                    out_nhd, return_lse, programmatic);
}

}  // namespace sageattention2
