// Parameters and launch function of the warp-level (mma.sync) attention kernel. Plain structs
// shared by the torch-facing code (host compiler) and the kernels (nvcc, no ATen: see
// preprocess/params.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/input_dtype.h"

namespace sageattention2 {

// Quantization geometry of the warp-level kernel: b_q = 128 queries in 8 slabs of 16 rows, and
// b_k = 128 keys (Eq. 8 with c_w = 8): the per-thread scale groups are those of
// reference.quantize_q_reference(block_q=128, warps=8) and quantize_kv(block_k=128), Q groups
// of 2 rows {g, g+8} of a slab, K groups of 32 keys. The FP8 variants run one slab per warp over 128-key
// tiles: that keeps O, S and the fragments in registers without spilling at head_dim 128 on
// Ada, and 128-key tiles halve the per-tile fixed costs (+10 % over 64 on the H100).
inline constexpr int kMmaBlockQ = 128;
inline constexpr int kMmaWarps = 8;
inline constexpr int kMmaBlockK = 128;
// How INT8 QK + FP16/BF16 PV runs those groups (mma/traits.cuh and mma/softmax.cuh say why): 4
// warps of two 16-row slabs, the online softmax over 64-key tiles (half a K group block), and the
// running max moved only when a tile's max passes it by more than 2^8 somewhere in a warp's 32
// rows.
inline constexpr int kMmaInputPvWarps = 4;
inline constexpr int kMmaInputPvTileK = 64;
inline constexpr int kMmaLazyRescaleLog2 = 8;

// The variants of the warp-level kernel (template parameters, docs/DESIGN.md#attention-mma): how
// Q and K are coded for the QK product, and in what type P and V enter the PV product.
enum class QkCodes : int {
  kInt8,  // per-thread INT8, mma.m16n8k32.s8
  kInt4,  // per-thread INT4, two per byte, mma.m16n8k64.s4 (paper 3.2, the 4-bit kernel)
};
enum class PvOperands : int {
  kInput,  // P and V in the input dtype (fp16/bf16 mma.m16n8k16, FP32): GPUs without FP8
  kFp8,    // P~ * 448 and per-channel V in E4M3, mma.m16n8k32.e4m3 (paper 3.3), sm_89+
};

struct AttentionMmaParams {
  // [B, Hq, q_len, D] fp16/bf16 with the strides below (last dimension contiguous): the kernel
  // quantizes each CTA's Q block itself, in reference.quantize_q_reference(block_q=128, warps=8)'s groups.
  const void* q = nullptr;
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_n = 0;
  const float* q_mean = nullptr;    // [B, Hq, D] or null (Q smoothed per head; delta_s then set)
  const float* k_mean = nullptr;    // [B, Hkv, D] or null (smooth K: its row constant joins the LSE)
  float q_scale_multiplier = 1.0f;  // sm_scale * log2(e), folded into the Q scales
  float sm_scale = 1.0f;            // softmax scale (natural units), for the LSE's row constant
  const int8_t* k_codes = nullptr;  // [B, Hkv, k_padded, D] (INT4: D / 2 bytes a row)
  const float* k_scale = nullptr;   // [B, Hkv, k_padded / 128, 4]
  const float* delta_s = nullptr;   // [B, Hq, k_padded] or null
  // kInput: [B, Hkv, kv_len, D] in the input dtype with the strides below.
  // kFp8: [B, Hkv, D, k_padded] E4M3 in the PV-MMA key order (docs/DESIGN.md#v-layout), contiguous.
  const void* v = nullptr;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_n = 0;
  const float* v_scale = nullptr;   // kFp8: [B, Hkv, D] per-channel FP8 scale of V
  const float* v_mean = nullptr;    // kFp8: [B, Hkv, D] or null (smooth V: added to the output)
  QkCodes qk = QkCodes::kInt8;
  PvOperands pv = PvOperands::kInput;
  void* out = nullptr;              // [B, Hq, q_len, D] with strides below
  int64_t out_stride_b = 0, out_stride_h = 0, out_stride_n = 0;
  float* lse = nullptr;             // [B, Hq, q_len] or null
  int batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t q_len = 0, kv_len = 0, k_padded = 0;
  bool causal = false;
  // Launched as a programmatic dependent of quantize_kv, launched just before it by the same call
  // (sageattn_mma): the CTAs are placed and load their Q while that launch ends, and wait for it
  // before reading anything else (MmaQQuantizer::quantize_block).
  bool after_quantize_kv = false;
  // The INT4 guard (docs/DECISIONS.md#d38; QuantizeKVParams says what the flags are): the
  // guarded call launches the INT4 kernel over the heads flagged 0 and the INT8 one over those
  // flagged 1, into one output; a CTA of a head flagged otherwise than `int8_heads_run` exits.
  const uint8_t* int8_heads = nullptr;
  uint8_t int8_heads_run = 0;
  // Packed sequences (docs/DESIGN.md#packed-sequences; INT8 QK without Q smoothing): [S][3]
  // int32 key_ranges (each sequence's first and end row of v, and its sample stride) and
  // packed_items (its first and end row of q, out and lse, and its first code row), and
  // packed_blocks [n][2] (sequence, block of 128 queries): one CTA per entry and head
  // (mma/item.cuh); null otherwise. q, out and lse are then one batch item of q_len rows in
  // all; the K codes, K scales and FP8 V one slab per KV head of k_padded code rows; k_mean,
  // v_scale and v_mean per sequence, [S, Hkv, D].
  const int* key_ranges = nullptr;
  const int* packed_items = nullptr;
  const int* packed_blocks = nullptr;
  int packed_entries = 0;
};

// dtype is q's and the output's (and, for PvOperands::kInput, V's). cudaErrorNotSupported for an FP8
// variant on a GPU whose code in this build predates sm_89, or a variant whose shared memory
// exceeds the GPU's per-block limit (none does on sm_80+: the largest takes 114 KB on sm_90, and
// at most 91 KB on the 99 KB SMs of sm_86/sm_89; a safety net).
cudaError_t launch_attention_mma(const AttentionMmaParams& p, InputDtype dtype, cudaStream_t stream);

}  // namespace sageattention2
