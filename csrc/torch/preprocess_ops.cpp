// CUDA implementations of the preprocessing ops: validate and allocate
// (preprocess_shapes.cpp), fill the kernel parameters, launch on the current stream
// (preprocess/smoothing_stats.cu, preprocess/quantize_kv.cu, preprocess/center_keys.cu).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "torch/preprocess.h"
#include "preprocess/params.h"

namespace sageattention2 {
namespace {

BhndView make_view(const at::Tensor& t) {
  BhndView v;
  v.data = t.data_ptr();
  v.stride_b = t.stride(0);
  v.stride_h = t.stride(1);
  v.stride_n = t.stride(2);
  v.batch = static_cast<int>(t.size(0));
  v.heads = static_cast<int>(t.size(1));
  v.tokens = t.size(2);
  v.head_dim = static_cast<int>(t.size(3));
  return v;
}

InputDtype input_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf ? InputDtype::kFloat16 : InputDtype::kBFloat16;
}

const float* optional_ptr(const std::optional<at::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; }

void check_optional_launchable(const std::optional<at::Tensor>& t, const char* name) {
  if (t) check_launchable(*t, name);
}

// The kernel parameters of quantize_kv.
QuantizeKVParams quantize_kv_params(const at::Tensor& k, const std::optional<at::Tensor>& v,
                                    const std::optional<at::Tensor>& k_mean, const std::optional<at::Tensor>& v_mean,
                                    const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& q_mean,
                                    int64_t block_k, double delta_s_multiplier, const QuantizeKVOutputs& out) {
  QuantizeKVParams p;
  p.k = make_view(k);
  p.has_v = v.has_value();
  if (v) p.v = make_view(*v);
  p.k_mean = optional_ptr(k_mean);
  p.v_mean = optional_ptr(v_mean);
  p.v_scale = optional_ptr(v_scale);
  p.q_mean = optional_ptr(q_mean);
  p.q_heads = q_mean ? static_cast<int>(q_mean->size(1)) : 0;
  p.delta_s_multiplier = static_cast<float>(delta_s_multiplier);
  p.block_k = static_cast<int>(block_k);
  p.padded_tokens = out.k_codes.size(2);
  p.k_codes = out.k_codes.data_ptr<int8_t>();
  p.k_scales = out.k_scales.data_ptr<float>();
  p.v_codes = v ? static_cast<uint8_t*>(out.v_codes.data_ptr()) : nullptr;
  p.delta_s = q_mean ? out.delta_s.data_ptr<float>() : nullptr;
  p.v_tile_scale = v && !v_scale ? out.v_tile_scale.data_ptr<float>() : nullptr;
  return p;
}

// smoothing_stats; with `ranges`, also Q's and K's per-channel max |x - mean| / 448 into
// ranges[0] and ranges[1] (allocated here, [B, H, D] float, where q and k are given).
SmoothingStatsOutputs run_smoothing_stats(const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
                                          const std::optional<at::Tensor>& v, bool smooth_v, at::Tensor* ranges,
                                          const int* key_ranges = nullptr) {
  SmoothingStatsOutputs out = allocate_smoothing_stats(q, k, v, smooth_v);
  check_optional_launchable(q, "q");
  check_optional_launchable(k, "k");
  check_optional_launchable(v, "v");
  const at::Tensor& any = q ? *q : (k ? *k : *v);
  const c10::cuda::CUDAGuard guard(any.device());

  StatsParams p;
  int jobs = 0;
  int64_t max_rows = 0;
  // scale: the source's range is tracked into it (V's FP8 scale; Q's and K's with `ranges`);
  // smooth: around its mean.
  auto add = [&](const std::optional<at::Tensor>& t, at::Tensor& mean, at::Tensor* scale, bool smooth,
                 const int* item_keys = nullptr) {
    if (!t) return;
    StatsSource& s = p.sources[p.num_sources++];
    s.view = make_view(*t);
    s.view.ranges = item_keys;
    s.view.sampled = item_keys != nullptr;
    s.first_job = jobs;
    s.track_range = scale != nullptr;
    s.smooth = scale != nullptr && smooth;
    s.mean_out = mean.numel() > 0 ? mean.data_ptr<float>() : nullptr;
    s.scale_out = scale != nullptr ? scale->data_ptr<float>() : nullptr;
    jobs += s.view.batch * s.view.heads;
    max_rows = std::max(max_rows, s.view.tokens);
  };
  if (ranges != nullptr) {  // smooth: the range around the mean, as V's with smooth_v
    if (q) ranges[0] = at::empty_like(out.q_mean);
    if (k) ranges[1] = at::empty_like(out.k_mean);
  }
  add(q, out.q_mean, ranges != nullptr && q ? &ranges[0] : nullptr, true);
  add(k, out.k_mean, ranges != nullptr && k ? &ranges[1] : nullptr, true, key_ranges);
  add(v, out.v_mean, v ? &out.v_scale : nullptr, smooth_v, key_ranges);
  bool equal_sources = true;
  for (int i = 0; i < p.num_sources; ++i)
    equal_sources = equal_sources && p.sources[i].view.batch * p.sources[i].view.heads * p.num_sources == jobs;
  p.jobs_per_source = equal_sources ? jobs / p.num_sources : 0;

  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // Key ranges: each item's sampled keys, at most kv_len, in one CTA per item and head (sageattn's
  // samples are at most kStatsSingleChunkRows keys, as without ranges).
  const StatsGrid grid = key_ranges != nullptr ? StatsGrid{1, max_rows} : stats_grid(max_rows, jobs, sms);
  p.chunks = grid.chunks;
  p.rows_per_chunk = grid.rows_per_chunk;
  // One chunk per job (sageattn's sampled means): its CTA writes the results, no partials, no
  // second launch, and no allocation either (at a few us of host time each, a call at short
  // sequences is host-bound: docs/DECISIONS.md#d19).
  at::Tensor partial_sum, partial_max, partial_min;
  p.partial_sum = p.partial_max = p.partial_min = nullptr;
  if (grid.chunks > 1) {
    auto f32 = any.options().dtype(at::kFloat);
    partial_sum = at::empty({jobs, grid.chunks, kMaxHeadDim}, f32);
    p.partial_sum = p.partial_max = p.partial_min = partial_sum.data_ptr<float>();
    if (v || ranges != nullptr) {
      partial_max = at::empty({jobs, grid.chunks, kMaxHeadDim}, f32);
      partial_min = at::empty({jobs, grid.chunks, kMaxHeadDim}, f32);
      p.partial_max = partial_max.data_ptr<float>();
      p.partial_min = partial_min.data_ptr<float>();
    }
  }
  C10_CUDA_CHECK(launch_smoothing_stats(p, jobs, input_dtype(any), at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_cuda(
    const std::optional<at::Tensor>& q, const std::optional<at::Tensor>& k,
    const std::optional<at::Tensor>& v, bool smooth_v) {
  const SmoothingStatsOutputs out = run_smoothing_stats(q, k, v, smooth_v, nullptr);
  return {out.q_mean, out.k_mean, out.v_mean, out.v_scale};
}

std::tuple<at::Tensor, at::Tensor> key_ranges_of_mask_cuda(const at::Tensor& key_mask, int64_t batch,
                                                           int64_t sample_tokens) {
  const c10::cuda::CUDAGuard guard(key_mask.device());
  KeyMaskParams p;
  // The rows of a mask per query spread over about 4 CTAs per SM in all (each compares its rows
  // with the first). Rows that are one row's broadcast (stride 0: an expanded [B, 1, 1, N]) are
  // equal without a look.
  const int64_t rows = key_mask.stride(2) == 0 ? 1 : key_mask.size(2);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = std::min<int64_t>(rows, std::max<int64_t>(1, (4 * sms + batch - 1) / batch));
  p.rows_per_chunk = static_cast<int>((rows + want - 1) / want);
  p.chunks = static_cast<int>((rows + p.rows_per_chunk - 1) / p.rows_per_chunk);
  auto i32 = key_mask.options().dtype(at::kInt);
  at::Tensor ranges = at::empty({batch, 3}, i32), valid = at::empty({batch, 1 + p.chunks}, i32);
  p.mask = key_mask.data_ptr();
  p.mask_batch = static_cast<int>(key_mask.size(0));
  p.stride_b = key_mask.stride(0);
  p.rows = static_cast<int>(rows);
  p.stride_r = key_mask.stride(2);
  p.keys = static_cast<int>(key_mask.size(3));
  p.stride_k = key_mask.stride(3);
  const int64_t bytes = key_mask.element_size();
  p.vector_rows = p.stride_k == 1 && reinterpret_cast<uintptr_t>(p.mask) % 16 == 0 && (p.stride_r * bytes) % 16 == 0 &&
                  (p.mask_batch == 1 || (p.stride_b * bytes) % 16 == 0);
  p.batch = static_cast<int>(batch);
  p.sample_tokens = static_cast<int>(sample_tokens);
  p.ranges = ranges.data_ptr<int>();
  p.valid = valid.data_ptr<int>();
  KeyMaskDtype dtype = KeyMaskDtype::kBool;
  switch (key_mask.scalar_type()) {
    case at::kHalf: dtype = KeyMaskDtype::kFloat16; p.lowest = -65504.0f; break;
    case at::kBFloat16: dtype = KeyMaskDtype::kBFloat16; p.lowest = -3.38953139e38f; break;
    case at::kFloat: dtype = KeyMaskDtype::kFloat32; p.lowest = -3.40282347e38f; break;
    default: break;
  }
  C10_CUDA_CHECK(launch_key_ranges_of_mask(p, dtype, at::cuda::getCurrentCUDAStream()));
  return {ranges, valid};
}

void poison_invalid_items_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& valid) {
  PoisonParams p;
  p.out = out.data_ptr();
  p.stride_b = out.stride(0);
  p.stride_h = out.stride(1);
  p.stride_n = out.stride(2);
  p.lse = lse.numel() > 0 ? lse.data_ptr<float>() : nullptr;
  p.valid = valid.data_ptr<int>();
  p.valid_per_item = static_cast<int>(valid.size(1));
  p.batch = static_cast<int>(out.size(0));
  p.heads = static_cast<int>(out.size(1));
  p.tokens = out.size(2);
  p.head_dim = static_cast<int>(out.size(3));
  C10_CUDA_CHECK(launch_poison_invalid_items(p, input_dtype(out), at::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_key_ranges_cuda(
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v, bool smooth_v, const int* key_ranges) {
  const SmoothingStatsOutputs out = run_smoothing_stats(std::nullopt, k, v, smooth_v, nullptr, key_ranges);
  return {out.q_mean, out.k_mean, out.v_mean, out.v_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> smoothing_stats_ranges_cuda(
    const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& v, bool smooth_v) {
  at::Tensor ranges[2];
  const SmoothingStatsOutputs out = run_smoothing_stats(q, k, v, smooth_v, ranges);
  return {out.q_mean, out.k_mean, out.v_mean, out.v_scale, ranges[0], ranges[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier) {
  return quantize_kv_after_cuda(k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk_dtype, delta_s_multiplier, false);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_after_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier, bool after_smoothing_stats) {
  return quantize_kv_heads_cuda(k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk_dtype, delta_s_multiplier,
                                after_smoothing_stats, std::nullopt, false);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_heads_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& q_mean, int64_t block_k, const std::string& qk_dtype,
    double delta_s_multiplier, bool after_smoothing_stats, const std::optional<at::Tensor>& int8_heads,
    bool int8_heads_run, const int* key_ranges) {
  QuantizeKVOutputs out = allocate_quantize_kv(k, v, k_mean, v_mean, v_scale, q_mean, block_k, qk_dtype);
  check_launchable(k, "k");
  check_optional_launchable(v, "v");
  check_optional_launchable(k_mean, "k_mean");
  check_optional_launchable(v_mean, "v_mean");
  check_optional_launchable(v_scale, "v_scale");
  check_optional_launchable(q_mean, "q_mean");
  const c10::cuda::CUDAGuard guard(k.device());
  QuantizeKVParams p = quantize_kv_params(k, v, k_mean, v_mean, v_scale, q_mean, block_k, delta_s_multiplier, out);
  p.v_overlaps_prior_grid = after_smoothing_stats;
  p.k.ranges = p.v.ranges = key_ranges;
  if (int8_heads) {
    p.int8_heads = int8_heads_pointer(*int8_heads, k.size(0), k.size(1), "quantize_kv");
    p.int8_heads_run = int8_heads_run ? 1 : 0;
  }
  const bool int4 = parse_qk_dtype(qk_dtype) == QkDtype::kInt4;
  C10_CUDA_CHECK(
      launch_quantize_kv(p, input_dtype(k), int4, at::cuda::getCurrentCUDAStream(), after_smoothing_stats));
  return {out.k_codes, out.k_scales, out.v_codes, out.delta_s, out.v_tile_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_kv_packed_cuda(
    const at::Tensor& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_mean,
    const std::optional<at::Tensor>& v_mean, const int* key_ranges, const int* packed_items, int64_t code_rows,
    int64_t item_padded, bool after_smoothing_stats, const std::optional<at::Tensor>& v_scale) {
  constexpr int64_t kBlock = 128;  // both kernels' key block
  TORCH_CHECK(code_rows > 0 && code_rows % kBlock == 0 && item_padded > 0 && item_padded % kBlock == 0,
              "quantize_kv (packed): code_rows and item_padded must be positive multiples of 128, got ", code_rows,
              " and ", item_padded);
  check_launchable(k, "k");
  check_optional_launchable(v, "v");
  check_optional_launchable(k_mean, "k_mean");
  check_optional_launchable(v_mean, "v_mean");
  check_optional_launchable(v_scale, "v_scale");
  const c10::cuda::CUDAGuard guard(k.device());
  const int64_t heads = k.size(1), d = k.size(3);
  QuantizeKVOutputs out;
  out.k_codes = at::empty({1, heads, code_rows, d}, k.options().dtype(at::kChar));
  out.k_scales = at::empty({1, heads, code_rows / kBlock, 4}, k.options().dtype(at::kFloat));
  if (v) {
    out.v_codes = at::empty({1, heads, d, code_rows}, k.options().dtype(at::kFloat8_e4m3fn));
    if (!v_scale) out.v_tile_scale = at::empty({1, heads, code_rows / kBlock}, k.options().dtype(at::kFloat));
  }
  QuantizeKVParams p = quantize_kv_params(k, v, k_mean, v_mean, v_scale, std::nullopt, kBlock, 1.0, out);
  p.v_overlaps_prior_grid = after_smoothing_stats;
  p.k.ranges = p.v.ranges = key_ranges;
  p.packed_items = packed_items;
  p.item_padded_tokens = item_padded;
  C10_CUDA_CHECK(launch_quantize_kv(p, input_dtype(k), false, at::cuda::getCurrentCUDAStream(), after_smoothing_stats));
  return {out.k_codes, out.k_scales, out.v_codes, out.v_tile_scale};
}

std::tuple<at::Tensor, at::Tensor> center_keys_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                                                    const at::Tensor& k_mean, double scale) {
  CenterKeysOutputs out = allocate_center_keys(q, k, lse, k_mean);
  check_launchable(q, "q");
  check_launchable(k, "k");
  const c10::cuda::CUDAGuard guard(q.device());
  CenterKeysParams p;
  p.k = make_view(k);
  p.q = make_view(q);
  p.k_mean = k_mean.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.k_centered = out.k_centered.data_ptr();
  p.lse_centered = out.lse_centered.data_ptr<float>();
  p.scale = static_cast<float>(scale);
  while (p.lanes_per_row * kElemsPerVector < p.k.head_dim) p.lanes_per_row *= 2;
  C10_CUDA_CHECK(launch_center_keys(p, input_dtype(q), at::cuda::getCurrentCUDAStream()));
  return {out.k_centered, out.lse_centered};
}

}  // namespace sageattention2
