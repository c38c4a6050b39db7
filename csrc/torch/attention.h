// Host interface of the attention ops (docs/DESIGN.md#ops): the single ops attention_mma and
// attention_wgmma (validation and output allocation in attention_shapes.cpp, shared by the CUDA
// and Meta implementations; CUDA implementations in attention_ops.cpp) and the composites
// sageattn_wgmma and sageattn_mma (composites.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace sageattention2 {

// log2(e) in double: sageattn's sm_scale * log2(e) (ops.LOG2E) is one double product, rounded to
// float once where a kernel takes it, so the chain and the ops called one by one agree bit for bit.
inline constexpr double kLog2e = 1.4426950408889634;

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
// The same, launched as a programmatic dependent of the quantize_kv that the caller launched just
// before it (after_quantize_kv; what that allows: mma/params.h).
std::tuple<at::Tensor, at::Tensor> attention_mma_after_cuda(
    const at::Tensor& q, const std::optional<at::Tensor>& q_mean, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const std::optional<at::Tensor>& delta_s, const at::Tensor& v, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& k_mean, const std::string& qk_dtype,
    int64_t kv_len, double sm_scale, bool is_causal, bool out_nhd, bool return_lse, bool after_quantize_kv);

// attention_mma over the heads whose int8_heads flag ([B, H_kv] uint8) is int8_heads_run, into
// `out` (allocate_attention_mma's for this call): the INT4 guard's two launches, INT4 and INT8
// codes into one output (docs/DECISIONS.md#d38). Internal to sageattn_mma, which made every
// input: nothing is validated here.
void attention_mma_heads_into_cuda(const AttentionOutputs& out, const at::Tensor& q,
                                   const std::optional<at::Tensor>& q_mean, const at::Tensor& k_codes,
                                   const at::Tensor& k_scale, const std::optional<at::Tensor>& delta_s,
                                   const at::Tensor& v, const std::optional<at::Tensor>& v_scale,
                                   const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& k_mean,
                                   const std::string& qk_dtype, int64_t kv_len, double sm_scale, bool is_causal,
                                   bool return_lse, const at::Tensor& int8_heads, bool int8_heads_run);

// v: quantize_kv's E4M3 codes with v_tile_scale (the FP8 PV tier), or the caller's V in q's
// dtype without (the accurate tier, P and V in 16 bits).
AttentionOutputs allocate_attention_wgmma(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                          const at::Tensor& v, const std::optional<at::Tensor>& v_tile_scale,
                                          const std::optional<at::Tensor>& v_mean,
                                          const std::optional<at::Tensor>& k_mean, int64_t kv_len, bool out_nhd,
                                          bool return_lse);

std::tuple<at::Tensor, at::Tensor> attention_wgmma_cuda(const at::Tensor& q, const at::Tensor& k_codes,
                                                        const at::Tensor& k_scale, const at::Tensor& v,
                                                        const std::optional<at::Tensor>& v_tile_scale,
                                                        const std::optional<at::Tensor>& v_mean,
                                                        const std::optional<at::Tensor>& k_mean, int64_t kv_len,
                                                        double sm_scale, bool is_causal, bool out_nhd, bool return_lse);
// The same, launched as a programmatic dependent of the quantize_kv that the caller launched just
// before it (after_quantize_kv; what that allows: hopper/params.h).
std::tuple<at::Tensor, at::Tensor> attention_wgmma_after_cuda(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& v,
    const std::optional<at::Tensor>& v_tile_scale, const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& k_mean,
    int64_t kv_len, double sm_scale, bool is_causal, bool out_nhd, bool return_lse, bool after_quantize_kv,
    const int* key_ranges = nullptr);

// A packed [total, H, D] tensor as [items, H, total, D] with a batch stride of 0: the packed
// launches see every item as a batch entry over all tokens, each item reading (or writing) only
// its own rows of the one memory (its key range, its packed_items rows).
at::Tensor items_view(const at::Tensor& t, int64_t items);

// The packed ops' outputs: out [total_q, Hq, D] (q's shape: the packed ops take one head_dim for
// q, k and v) and lse [Hq, total_q], or an empty lse without return_lse.
AttentionOutputs allocate_packed_outputs(const at::Tensor& q, bool return_lse);

// attention_wgmma over packed sequences (docs/DESIGN.md#packed-sequences), after
// quantize_kv_packed_cuda: q [total_q, Hq, D] packed, each of `items` items its queries from
// packed_items' rows, its keys key_ranges' (of total_k), its codes from its code row, the
// `blocks` Q blocks of packed_blocks ([blocks][2]: item, block) its schedule; FP8 PV (v the codes,
// with v_tile_scale) or 16-bit (v a zero-padded copy [code rows, Hkv, D], without); causal:
// each item's diagonal top-left aligned. Returns out [total_q, Hq, D] and lse [Hq, total_q] (or empty). Internal to
// sageattn_wgmma_varlen, which made and validated every input.
std::tuple<at::Tensor, at::Tensor> attention_wgmma_packed_cuda(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& v,
    const std::optional<at::Tensor>& v_tile_scale, const std::optional<at::Tensor>& v_mean,
    const std::optional<at::Tensor>& k_mean,
    const int* key_ranges, const int* packed_items, int64_t items, const int* packed_blocks, int64_t blocks,
    int64_t total_k,
    double sm_scale, bool is_causal, bool return_lse, bool after_quantize_kv);

// attention_mma over packed sequences (docs/DESIGN.md#packed-sequences), after
// quantize_kv_packed_cuda: INT8 K codes and scales in code rows, v the FP8 codes (v_scale per
// sequence, [S, Hkv, D]) or the caller's packed [total_k, Hkv, D] V (read at each sequence's key
// range); packed_blocks ([blocks][2]: sequence, block) one CTA each per head. Returns out
// [total_q, Hq, D] and lse [Hq, total_q] (or empty). Internal to sageattn_mma_varlen, which made
// and validated every input.
std::tuple<at::Tensor, at::Tensor> attention_mma_packed_cuda(
    const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& v,
    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_mean,
    const std::optional<at::Tensor>& k_mean, const int* key_ranges, const int* packed_items, const int* packed_blocks,
    int64_t blocks, int64_t max_seqlen_k, double sm_scale, bool is_causal, bool return_lse, bool after_quantize_kv);

// The Hopper path of a sageattn call in one op (docs/DESIGN.md#composite-ops): smoothing_stats
// over every sample_stride-th token (K's mean with smooth_k, V's with smooth_v and FP8 PV),
// quantize_kv for block_k 128 (V with one scale per tile where pv_dtype is "fp8"; "input": K
// only, V as it is), then attention_wgmma. The intermediates are never
// returned: at short sequences a call is host-bound, and each op dispatched from Python cost
// 15-37 us of host time (docs/DECISIONS.md#d20). key_ranges (int32 [B, 3] on q's device, or
// none): batch item b attends its keys key_ranges[b, 0] to key_ranges[b, 1] (exclusive) alone,
// with K's and V's quantization groups over them and their means over every key_ranges[b, 2]-th
// of them (sample_stride then 1; a key-padding mask in one launch, docs/DECISIONS.md#d43); the
// values are the caller's to keep within 0 <= first < end <= kv_len, stride >= 1 (sageattn's
// Python layer derives them from the mask). Or key_mask ([1 or B, 1, 1 or Nq, Nk] bool or
// additive): the key ranges are read from it on the GPU (key_ranges_of_mask_cuda, each item's
// sample stride from sample_tokens), with no synchronisation; the output rows (and LSE) of an
// item whose mask is not a key-padding mask are NaN (docs/DECISIONS.md#d43).
std::tuple<at::Tensor, at::Tensor> sageattn_wgmma_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::string& pv_dtype, bool smooth_k, bool smooth_v, int64_t sample_stride,
                                                       double sm_scale, bool is_causal, bool out_nhd, bool return_lse,
                                                       const std::optional<at::Tensor>& key_ranges,
                                                       const std::optional<at::Tensor>& key_mask, int64_t sample_tokens);
AttentionOutputs allocate_sageattn_wgmma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const std::string& pv_dtype, bool smooth_k,
                                         bool smooth_v, int64_t sample_stride, bool out_nhd, bool return_lse,
                                         const std::optional<at::Tensor>& key_ranges, bool is_causal,
                                         const std::optional<at::Tensor>& key_mask, int64_t sample_tokens);

// The warp-level path of a sageattn call in one op, for the same reason
// (docs/DESIGN.md#composite-ops): at most one smoothing_stats launch (Q's mean with smooth_q; K's
// over every sample_stride-th token with smooth_k, or over all tokens with FP8 PV, whose V range
// needs them all), quantize_kv for block_k 128, then attention_mma, each launch a programmatic
// dependent of the one before.
// int4_guard > 0 with INT4 QK: the INT4 guard (docs/DECISIONS.md#d38): the heads (of K, with the
// Q heads that share them) whose Q or K has a channel range above int4_guard times the head's
// mean channel range, after smoothing, run INT8 QK inside the same call.
std::tuple<at::Tensor, at::Tensor> sageattn_mma_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const std::string& qk_dtype, const std::string& pv_dtype,
                                                     bool smooth_q, bool smooth_k, bool smooth_v,
                                                     int64_t sample_stride, double sm_scale, bool is_causal,
                                                     bool out_nhd, bool return_lse, double int4_guard);
AttentionOutputs allocate_sageattn_mma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::string& qk_dtype, const std::string& pv_dtype, bool smooth_q,
                                       bool smooth_k, bool smooth_v, int64_t sample_stride, bool out_nhd,
                                       bool return_lse, double int4_guard);

// The Hopper path over packed sequences in one op (sageattn_varlen, docs/DESIGN.md#packed-sequences):
// q [total_q, Hq, D], k and v [total_k, Hkv, D] (head_dim 64, 128 or 256, fp16/bf16, last dim
// contiguous); items int32 [2, S, 3] on q's device: items[0] the S sequences' key ranges (first
// key, end key, smoothing sample stride) and items[1] their first and end query and first code
// row (each sequence's keys rounded up to 128, back to back: code_rows in all); blocks int32
// [n, 2]: every sequence's Q blocks of 128 queries (sequence, block within it), each once. Each
// sequence is what sageattn_wgmma computes for it alone (smooth_k / smooth_v over its sample),
// in one launch of each kernel: FP8 PV, or with v_rows (int64 [total_k]: each key's row in a
// zero-padded copy of V of code_rows + 1 rows, the last for keys of no sequence) the accurate
// tier (head_dim 64 or 128); is_causal: each sequence's queries and keys top-left aligned, as
// sageattn_wgmma's. Returns out [total_q, Hq, D] and lse [Hq, total_q] (or empty).
std::tuple<at::Tensor, at::Tensor> sageattn_wgmma_varlen_cuda(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& items,
                                                              const at::Tensor& blocks, int64_t max_seqlen_k,
                                                              int64_t code_rows, bool smooth_k, bool smooth_v,
                                                              double sm_scale, bool is_causal, bool return_lse,
                                                              const std::optional<at::Tensor>& v_rows);
AttentionOutputs allocate_sageattn_wgmma_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& items, const at::Tensor& blocks,
                                                int64_t max_seqlen_k, int64_t code_rows, bool return_lse,
                                                const std::optional<at::Tensor>& v_rows);

// The warp-level path over packed sequences in one op (sageattn_varlen on GPUs without the Hopper
// kernel): the same tables as sageattn_wgmma_varlen (items' sample strides: K's smoothing sample
// with pv_dtype "input"; 1 with "fp8", whose V scales need every key), head_dim 64 or 128, INT8
// QK without Q smoothing; each sequence is what sageattn_mma computes for it alone
// (smoothing_stats over its keys, quantize_kv into its code rows, attention_mma over its block
// table entries), in one launch of each kernel.
std::tuple<at::Tensor, at::Tensor> sageattn_mma_varlen_cuda(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& items,
                                                            const at::Tensor& blocks, int64_t max_seqlen_k,
                                                            int64_t code_rows, const std::string& pv_dtype,
                                                            bool smooth_k, bool smooth_v, double sm_scale,
                                                            bool is_causal, bool return_lse);
AttentionOutputs allocate_sageattn_mma_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& items, const at::Tensor& blocks,
                                              int64_t max_seqlen_k, int64_t code_rows, const std::string& pv_dtype,
                                              bool return_lse);

}  // namespace sageattention2
