// Parameters and launch function of the Hopper attention kernel (wgmma). Plain structs shared by
// the torch-facing code (host compiler) and the kernel (nvcc, no ATen: see preprocess/params.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/fast_divisor.h"
#include "common/input_dtype.h"

namespace sageattention2 {

// Tile geometry of the Hopper kernel (attention_wgmma): a CTA of two consumer warpgroups owns
// 128 queries (64 per warpgroup, 16 per warp: the m64 wgmma slab), and streams 128-key tiles.
// K has the per-thread groups of the warp-level kernel: 32 keys of a 128-key tile
// (quantize_kv(block_k=128)), so one K scale per thread (paper Eq. 8, Fig. 4). Q, quantized
// inside the kernel, has one scale per row: a thread's two rows {g, g+8} each have their own,
// finer than Eq. 8's group of both at no cost in the loop (hopper/q_quantizer.cuh).
inline constexpr int kWgmmaBlockQ = 128;
inline constexpr int kWgmmaBlockK = 128;

struct AttentionWgmmaParams {
  const void* q = nullptr;           // [B, Hq, q_len, D] fp16/bf16, strides below (last dim 1)
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_n = 0;
  const int8_t* k_codes = nullptr;   // [B, Hkv, k_padded, D] per-thread INT8 (quantize_kv)
  const float* k_scale = nullptr;    // [B, Hkv, k_padded / 128, 4]
  // fp8_pv: [B, Hkv, D, k_padded] E4M3 codes, PV-MMA key order (docs/DESIGN.md#v-layout), with
  // the FP8 scale of each V tile. Otherwise (the accurate tier): the caller's [B, Hkv, kv_len, D]
  // in q's dtype, strides below (last dim 1), and no scales.
  bool fp8_pv = true;
  const void* v = nullptr;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_n = 0;
  const float* v_tile_scale = nullptr;  // [B, Hkv, k_padded / 128] (fp8_pv)
  const float* v_mean = nullptr;     // [B, Hkv, D] or null (smooth V: added to the output)
  const float* k_mean = nullptr;     // [B, Hkv, D] or null (smooth K: its row constant joins the LSE)
  void* out = nullptr;               // [B, Hq, q_len, D] in q's dtype, strides below
  int64_t out_stride_b = 0, out_stride_h = 0, out_stride_n = 0;
  float* lse = nullptr;              // [B, Hq, q_len] or null (packed items: [Hq, lse_rows])
  int batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t q_len = 0, kv_len = 0, k_padded = 0;
  // Key ranges (a key-padding mask in one launch, docs/DECISIONS.md#d43): [batch][3] int32, the
  // first and end key of each batch item (and its smoothing sample's stride), or null (every
  // item has kv_len keys). Item b's K codes (and FP8 V) start at row 0 with its first key
  // (quantize_kv over the same ranges); the caller's 16-bit V is read from its first key on.
  const int* key_ranges = nullptr;
  // Packed sequences (docs/DESIGN.md#packed-sequences; FP8 PV; causal: each item top-left): [items][3] int32,
  // each item's first and end query and first code row (common/key_ranges.cuh), or null. Item b
  // then reads its queries from those rows of q (q_stride_b 0: one tensor of all items' tokens)
  // and writes the same rows of out (out_stride_b 0) and lse ([Hq, lse_rows]), its keys are its
  // key range of the caller's K and V, and its codes lie from its code row on in one slab of
  // k_padded rows per KV head ([1, Hkv, k_padded, D], quantize_kv's packed items). The schedule
  // walks packed_blocks ([blocks][2] int32: each Q block's item and its block within the item,
  // every block of every item once) as the Q blocks of one batch entry: batch 1 and q_len the
  // blocks' count x 128. Every kernel variant has a packed instantiation
  // (hopper/tile_scheduler.cuh); the accurate tier's V is then a zero-padded copy in code rows.
  const int* packed_items = nullptr;
  const int* packed_blocks = nullptr;
  int64_t lse_rows = 0;
  float sm_scale = 1.0f;             // softmax scale (natural units)
  bool causal = false;
  int unit_items = 2;                // Q blocks per work unit (hopper/tile_scheduler.cuh; set by the launch)
  // Launched as a programmatic dependent of quantize_kv, launched just before it by the same
  // call: the CTAs start, load their first Q and set up while that launch ends, and wait for it
  // before anything it writes is read (AttentionWgmmaKernel).
  bool after_quantize_kv = false;
  // The tile scheduler's divisors (set by the launch): the units of a head, q_heads and the query
  // heads per KV head.
  FastDivisor units_per_head, q_heads_divisor, group_divisor;
};

// cudaErrorNotSupported when this build has no sm_90a code.
cudaError_t launch_attention_wgmma(const AttentionWgmmaParams& p, InputDtype dtype, cudaStream_t stream);

}  // namespace sageattention2
