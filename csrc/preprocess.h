// Host interface of the preprocessing ops (docs/DESIGN.md "Ops").
//
// Validation and output allocation live in preprocess_shapes.cpp and serve both the CUDA
// implementation and the Meta implementation that torch.compile traces with, so an output
// shape is computed in exactly one place.
#pragma once

#include <ATen/ATen.h>

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

// --- quantize_q ---
struct QuantizeQOutputs {
  at::Tensor codes, scales, block_mean;
};
QuantizeQOutputs allocate_quantize_q(const at::Tensor& q, const std::optional<at::Tensor>& q_mean,
                                     int64_t block_q, int64_t warps, const std::string& qk_dtype,
                                     bool smooth_block);

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

// Checks that only a real (non-meta) CUDA launch needs: device and 16-byte alignment of every
// row, since the kernels move 16-byte vectors.
void check_launchable(const at::Tensor& t, const char* name);

// CUDA implementations (preprocess_ops.cpp). They validate through the allocate_* functions above.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_cuda(
    const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& v, bool smooth_v);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q_cuda(
    const at::Tensor& q, const std::optional<at::Tensor>& q_mean, int64_t block_q, int64_t warps,
    const std::string& qk_dtype, bool smooth_block, double scale_multiplier);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier);
// The same, launched as a programmatic dependent of the smoothing_stats launch that the caller
// made just before it, whose inputs and outputs it keeps alive until this launch
// (after_smoothing_stats; what that allows: quantize_kv_kernel).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_after_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier, bool after_smoothing_stats);

// quantize_kv's Hopper-path outputs (block_k 128, INT8, one V scale per tile) for the first
// key_blocks 128-key blocks of every head, written by prepare_kv on `ctas` SMs while the
// attention kernel launched next runs (DESIGN.md, "K and V prepared beside the kernel"): `ready`
// holds the per-tile counters that kernel waits on. Not an op: the outputs are complete only
// once that kernel has read every tile.
struct PreparedKV {
  QuantizeKVOutputs kv;
  at::Tensor ready;
};
PreparedKV prepare_kv_cuda(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& k_mean,
                           const std::optional<at::Tensor>& v_mean, int64_t key_blocks, int ctas,
                           int heads_per_wave);

}  // namespace sageattention2
