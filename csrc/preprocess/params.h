// Parameters of the preprocessing kernels and their launch functions.
//
// Plain structs with no CUDA device code and no ATen, so the torch-facing code (compiled by the
// host compiler) and the kernels (compiled by nvcc, with no ATen headers) share them. Keeping
// ATen out of nvcc's translation units matters: nvcc's host pass over ATen headers emitted weak
// copies of libstdc++ stream templates into the extension, which crashed when formatting an
// integer on a toolchain with another libstdc++ (seen with g++ 13 on the H100 image).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/geometry.h"
#include "common/input_dtype.h"

namespace sageattention2 {

// A [B, H, N, D] view with arbitrary element strides on B, H, N and a contiguous last dim.
struct BhndView {
  const void* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_n = 0;
  int batch = 0, heads = 0;
  int64_t tokens = 0;
  int head_dim = 0;
  // Key ranges (a key-padding mask run in one launch: docs/DECISIONS.md#d43): [batch][3] int32,
  // each batch item's first and end token and the stride of its smoothing sample, or null
  // (every token). The view's rows are then the item's range, or with `sampled` every
  // stride-th token of it, counted from its first (item_view in preprocess/rows.cuh).
  const int* ranges = nullptr;
  bool sampled = false;
};

struct StatsSource {
  BhndView view;
  int first_job = 0;         // jobs of this source: [first_job, first_job + batch * heads)
  bool track_range = false;  // V: also per-channel max and min (for the FP8 scale)
  bool smooth = false;       // V: subtract the mean before taking the range
  float* mean_out = nullptr;   // [B, H, D], written when non-null
  float* scale_out = nullptr;  // V only: [B, H, D] max |V - mean| / 448
};

inline constexpr int kMaxStatsSources = 3;

struct StatsParams {
  StatsSource sources[kMaxStatsSources];
  int num_sources = 0;
  int jobs_per_source = 0;  // > 0: every source has this many jobs, interleaved in the grid
  int chunks = 1;
  int64_t rows_per_chunk = 1;
  float* partial_sum = nullptr;  // [jobs][chunks][kMaxHeadDim]; null with one chunk (no fold launch)
  float* partial_max = nullptr;
  float* partial_min = nullptr;
};

struct QuantizeKVParams {
  BhndView k, v;
  bool has_v = false;
  const float* k_mean = nullptr;   // [B, Hkv, D] or null
  const float* v_mean = nullptr;   // [B, Hkv, D] or null
  const float* v_scale = nullptr;  // [B, Hkv, D] per-channel scale, or null: one scale per tile
  const float* q_mean = nullptr;   // [B, Hq, D] or null
  int q_heads = 0;
  float delta_s_multiplier = 1.0f;
  int block_k = 64;
  int64_t padded_tokens = 0;
  int8_t* k_codes = nullptr;       // [B, Hkv, padded_tokens, D or D/2]
  float* k_scales = nullptr;       // [B, Hkv, blocks, 4]
  uint8_t* v_codes = nullptr;      // [B, Hkv, D, padded_tokens] E4M3
  float* delta_s = nullptr;        // [B, Hq, padded_tokens] or null
  float* v_tile_scale = nullptr;   // [B, Hkv, blocks]: written when V comes without v_scale
  // Launched as a programmatic dependent of smoothing_stats by a caller that keeps that launch's
  // inputs and outputs alive until this launch (launch_quantize_kv): V tiles that read none of
  // its outputs (no v_mean, no v_scale) then run without waiting for it, since no output of
  // this launch can share memory with a tensor it still touches.
  bool v_overlaps_prior_grid = false;
  // The INT4 guard (docs/DECISIONS.md#d38): [B, Hkv], 1 where a head's K is coded INT8 because
  // INT4 cannot represent its Q or K, or null. The guarded call launches quantize_kv twice, INT4
  // K over the heads flagged 0 (and V), INT8 K over those flagged 1; a K CTA of a head flagged
  // otherwise than `int8_heads_run` exits at once.
  const uint8_t* int8_heads = nullptr;
  uint8_t int8_heads_run = 0;
  // Packed sequences (docs/DESIGN.md#packed-sequences): [batch][3] int32 (first query, end query,
  // first code row of each item; common/key_ranges.cuh), with k.ranges and v.ranges the items'
  // keys, or null. The items' codes then lie back to back in one slab of padded_tokens rows per
  // head ([1, Hkv, padded_tokens, D], the scales and V alike), item b's from its code row, and
  // the grid covers item_padded_tokens, the longest item's keys rounded up to whole blocks.
  const int* packed_items = nullptr;
  int64_t item_padded_tokens = 0;
};

// A key-padding mask read on the GPU (preprocess/key_ranges.cu): a [mask_batch, 1, rows, keys]
// view (mask_batch 1 or the call's batch, rows 1 or the call's queries; element strides) of a
// bool mask (True: attend) or an additive one (0: attend; -inf or `lowest`: masked).
enum class KeyMaskDtype { kBool, kFloat16, kBFloat16, kFloat32 };
struct KeyMaskParams {
  const void* mask = nullptr;
  int64_t stride_b = 0, stride_r = 0, stride_k = 1;
  int mask_batch = 1, batch = 0, rows = 1, keys = 0;
  // The rows are read in 16-byte vectors: keys contiguous, every row 16-byte aligned (the keys
  // past the last whole vector one by one).
  bool vector_rows = false;
  float lowest = 0.0f;
  int sample_tokens = 1;  // the smoothing sample's most keys (the stride: ceil(count / this) | 1)
  int rows_per_chunk = 1, chunks = 1;  // the rows of each CTA (blockIdx.y) of an item
  int* ranges = nullptr;  // out: [batch][3] first key, end key, sample stride
  int* valid = nullptr;   // out: [batch][1 + chunks] 1 where the first row / each chunk's rows qualify
};

// The output rows of the items whose `valid` is 0 set to NaN.
struct PoisonParams {
  void* out = nullptr;  // [batch, heads, tokens, head_dim], element strides
  int64_t stride_b = 0, stride_h = 0, stride_n = 0;
  float* lse = nullptr;  // [batch, heads, tokens] contiguous, or null
  const int* valid = nullptr;  // [batch][valid_per_item]: an item is valid where all are 1
  int valid_per_item = 1;
  int batch = 0, heads = 0, head_dim = 0;
  int64_t tokens = 0;
};

// The exact backward's inputs from PyTorch's kernels (center_keys, _backward): K minus its mean
// over tokens, each element rounded once, and the forward's LSE shifted to the scores on those
// keys, in one pass over K and Q.
struct CenterKeysParams {
  BhndView k;                     // [B, Hkv, Nk, D]
  BhndView q;                     // [B, Hq, Nq, D], Hkv dividing Hq (GQA)
  const float* k_mean = nullptr;  // [B, Hkv, D]
  const float* lse = nullptr;     // [B, Hq, Nq], natural log
  void* k_centered = nullptr;     // out: [B, Hkv, Nk, D] contiguous, K's dtype
  float* lse_centered = nullptr;  // out: [B, Hq, Nq]
  float scale = 1.0f;             // the softmax scale of the scores
  int lanes_per_row = 1;          // a power of two >= D / 8: one 16-byte vector per lane
};

// quantize_kv quantizes K from registers (quantize_k_block_in_registers) for the head_dims it has
// compiled in and the attention kernels' 128-key blocks, when no Delta-S is asked for; otherwise
// from a tile staged in shared memory.
inline constexpr int kRegisterKBlock = 128;
constexpr bool k_block_in_registers(const QuantizeKVParams& p) {
  return p.block_k == kRegisterKBlock && p.q_mean == nullptr &&
         (p.k.head_dim == 64 || p.k.head_dim == 128 || p.k.head_dim == 256);
}

// Shared-memory rows are padded by one 16-byte vector so that threads reading 16 bytes of
// consecutive rows (the Delta-S dot products) fall in different banks.
constexpr int kv_tile_pitch(int head_dim) { return head_dim + kElemsPerVector; }

// Each returns the launch status (cudaGetLastError after the launch).
cudaError_t launch_smoothing_stats(const StatsParams& p, int jobs, InputDtype dtype, cudaStream_t stream);
// after_smoothing_stats: as a programmatic dependent of smoothing_stats, launched just before it
// by the same call (quantize_kv_kernel); p.v_overlaps_prior_grid says what else the caller
// guarantees.
cudaError_t launch_key_ranges_of_mask(const KeyMaskParams& p, KeyMaskDtype dtype, cudaStream_t stream);
cudaError_t launch_poison_invalid_items(const PoisonParams& p, InputDtype dtype, cudaStream_t stream);
cudaError_t launch_quantize_kv(const QuantizeKVParams& p, InputDtype dtype, bool int4, cudaStream_t stream,
                               bool after_smoothing_stats = false);
cudaError_t launch_center_keys(const CenterKeysParams& p, InputDtype dtype, cudaStream_t stream);

}  // namespace sageattention2
