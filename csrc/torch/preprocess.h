// Host interface of the preprocessing ops (docs/DESIGN.md#smoothing_stats and #quantize_kv).
//
// Validation and output allocation live in preprocess_shapes.cpp and serve both the CUDA
// implementation and the Meta implementation that torch.compile traces with, so an output
// shape is computed in exactly one place.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace sageattention2 {

enum class QkDtype { kInt8, kInt4 };
QkDtype parse_qk_dtype(const std::string& name);

// --- smoothing_stats ---
struct SmoothingStatsOutputs {
  at::Tensor q_mean, k_mean, v_mean, v_scale;  // absent ones are empty [0] float32
};
SmoothingStatsOutputs allocate_smoothing_stats(const std::optional<at::Tensor>& q,
                                               const std::optional<at::Tensor>& k,
                                               const std::optional<at::Tensor>& v, bool smooth_v);

// --- quantize_kv ---
struct QuantizeKVOutputs {
  at::Tensor k_codes, k_scales, v_codes, delta_s, v_tile_scale;
};
QuantizeKVOutputs allocate_quantize_kv(const at::Tensor& k, const std::optional<at::Tensor>& v,
                                       const std::optional<at::Tensor>& k_mean,
                                       const std::optional<at::Tensor>& v_mean,
                                       const std::optional<at::Tensor>& v_scale,
                                       const std::optional<at::Tensor>& q_mean, int64_t block_k,
                                       const std::string& qk_dtype);

// --- center_keys (the backward's inputs for PyTorch's kernels, _backward) ---
struct CenterKeysOutputs {
  at::Tensor k_centered, lse_centered;
};
CenterKeysOutputs allocate_center_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                                       const at::Tensor& k_mean);

// Checks that only a real (non-meta) CUDA launch needs: device and 16-byte alignment of every
// row, since the kernels move 16-byte vectors.
void check_launchable(const at::Tensor& t, const char* name);
// The INT4 guard's per-head flags (docs/DECISIONS.md#d38) as the kernels read them: `op`'s
// int8_heads must be a contiguous uint8 [B, H_kv] tensor (batch x kv_heads elements).
const uint8_t* int8_heads_pointer(const at::Tensor& int8_heads, int64_t batch, int64_t kv_heads, const char* op);

// Key ranges: a key-padding mask run in one launch (docs/DECISIONS.md#d43): [B][3] int32 on
// the device, each batch item's first and end key and the stride of its smoothing sample (the
// caller's to keep within 0 <= first < end <= kv_len, stride >= 1).

// CUDA implementations (preprocess_ops.cpp). They validate through the allocate_* functions above.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_cuda(
    const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& v, bool smooth_v);
std::tuple<at::Tensor, at::Tensor> center_keys_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                                                    const at::Tensor& k_mean, double scale);
// The key ranges of a [1 or batch, 1, rows, keys] key-padding mask (docs/DESIGN.md#key-ranges), read
// on the GPU: int32 [batch, 3] (first key, end key, sample stride ceil(count / sample_tokens) | 1)
// and int32 [batch, 1 + chunks] valid (the item's mask is a key-padding mask with a non-empty
// contiguous range where its whole row is 1; where its first row is not, its range is every
// key).
std::tuple<at::Tensor, at::Tensor> key_ranges_of_mask_cuda(const at::Tensor& key_mask, int64_t batch,
                                                           int64_t sample_tokens);
// The rows of out ([B, H, N, D] view) and lse ([B, H, N], or empty) of the items whose valid is 0
// set to NaN.
void poison_invalid_items_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& valid);

// smoothing_stats of K and V (no Q) over every stride-th key of each batch item's key range,
// one CTA per item and head.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_key_ranges_cuda(
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v, bool smooth_v, const int* key_ranges);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier);
// smoothing_stats of q, k (and v) with, for q and k, each channel's max |x - mean| / 448
// ([B, H, D] float: the INT4 guard's statistic, docs/DECISIONS.md#d38), returned after v_scale.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_ranges_cuda(
    const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v, bool smooth_v);
// The same, launched as a programmatic dependent of the smoothing_stats launch that the caller
// made just before it, whose inputs and outputs it keeps alive until this launch
// (after_smoothing_stats; what that allows: quantize_kv_kernel).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_after_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier, bool after_smoothing_stats);
// The same over the heads whose int8_heads flag ([B, H_kv] uint8) is int8_heads_run (all heads
// without int8_heads): the INT4 guard's two launches (docs/DECISIONS.md#d38). The K codes and
// scales of the other heads, and their Delta-S, are left unwritten.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_heads_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier, bool after_smoothing_stats, const std::optional<at::Tensor>& int8_heads,
    bool int8_heads_run, const int* key_ranges = nullptr);

// quantize_kv of packed sequences for the Hopper kernel (docs/DESIGN.md#packed-sequences): k and
// v are [items, Hkv, total_k, D] views of one packed tensor (batch stride 0), key_ranges
// ([items][3]) each item's keys in it, packed_items ([items][3]) each item's first code row.
// INT8 K (block_k 128) and E4M3 V with one scale per tile, each item's codes back to back in one
// slab of code_rows rows per head: k_codes [1, Hkv, code_rows, D], k_scale [1, Hkv, code_rows /
// 128, 4], v_fp8 [1, Hkv, D, code_rows], v_tile_scale [1, Hkv, code_rows / 128] (without v: K
// only, the last two undefined). item_padded: the longest item's keys rounded up to 128 (the grid).
// With v_scale ([items, Hkv, D], the warp-level kernel's per-channel scales) V takes those, and
// v_tile_scale is undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_packed_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const int* key_ranges, const int* packed_items, int64_t code_rows,
    int64_t item_padded, bool after_smoothing_stats, const std::optional<at::Tensor>& v_scale = std::nullopt);

}  // namespace sageattention2
