// The warp-level SageAttention2 kernel (paper Algorithm 1) in FlashAttention-2 form: a CTA owns
// 128 queries (8 warps of 16 with FP8 PV, 4 warps of 32 with FP16/BF16 PV), streams tiles of K
// and V (128 or 64 keys) through a cp.async pipeline, computes S = Q K^T with integer mma.sync
// from per-thread quantized codes (Q's quantized by the CTA itself before its loop, K's by
// quantize_kv), dequantizes with one Q scale and one K scale per thread and slab (Fig. 4), adds
// the exact Delta-S of Q smoothing (a compiled variant), runs the online softmax in base 2
// (sm_scale * log2(e) is folded into the Q scales) and accumulates P V in FP32.
//
// Variants are template parameters (attention_params.h): QkCodes INT8 (m16n8k32.s8) or INT4
// (m16n8k64.s4, the 4-bit kernel: same fragments, two channels a byte), and PvOperands in the
// input dtype (m16n8k16, for GPUs without FP8) or FP8 (P~ * 448 and per-channel V in E4M3,
// m16n8k32.e4m3 into a fresh accumulator per tile folded into O: paper 3.3 and 3.4).
#pragma once

#include <cstdint>

#include "common/convert.cuh"
#include "common/opaque.cuh"
#include "common/ptx.cuh"
#include "common/quant_math.cuh"
#include "common/v_channels.cuh"
#include "mma/params.h"

namespace sageattention2 {

// Shared-memory tiles are rows of 16-byte chunks; ldmatrix reads 8 rows of one chunk column at
// once, so the chunk index is XOR-ed with the row to put those 8 rows in 8 different bank
// groups (rows of 4 chunks share a 128-byte line two by two, hence the shift).
// Rows of 2 chunks (INT4 codes at head_dim 64) share a line four by four.
template <int kChunksPerRow>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  static_assert(kChunksPerRow == 2 || kChunksPerRow == 4 || kChunksPerRow % 8 == 0,
                "rows of 32 or 64 bytes or multiples of 128");
  const int mixed = kChunksPerRow >= 8   ? chunk ^ (row & 7)
                    : kChunksPerRow == 4 ? chunk ^ ((row >> 1) & 3)
                                         : chunk ^ ((row >> 2) & 1);
  return row * kChunksPerRow * 16 + mixed * 16;
}

// int32 -> float32 for |x| < 2^22, exactly, without I2F: 2^23 + 2^22 + x has x in its low
// mantissa bits. An INT8 dot product over at most 256 channels is below 127^2 * 256 < 2^22.
// I2F issues at a quarter of the FMA rate on the unit that also runs ex2 (ncu: the kernel was
// issue-bound), so this moves 32 conversions per thread and tile to the integer and FMA pipes.
inline constexpr int32_t kSmallIntMagic = 0x4B400000;  // the bits of 1.5 * 2^23
inline constexpr float kSmallIntOffset = 12582912.0f;   // 1.5 * 2^23
// The float 1.5 * 2^23 + x, exactly (the first step of small_int_to_float). Floats of this form
// order as their x do.
__device__ __forceinline__ float small_int_plus_offset(int32_t x) { return __int_as_float(x + kSmallIntMagic); }
__device__ __forceinline__ float small_int_to_float(int32_t x) { return small_int_plus_offset(x) - kSmallIntOffset; }

template <typename T, int kHeadDim, bool kCausal, bool kSmoothQ, QkCodes kQk, PvOperands kPv>
struct AttentionMmaKernel {
  static constexpr bool kFp8Pv = kPv == PvOperands::kFp8;
  // The dequantization folded into the exponent (the KV loop says how): for P~ in the input
  // dtype without Delta-S (sageattn's INT8 default on sm_80/sm_90), whose lazy running max
  // already lets P~ exceed 1 (up to 256), so the max may be rounded up to an integer. At head_dim
  // 64 only: +4-7 % there on the H100; at 128, whose loop runs at 255 registers, it measured
  // within 1 % and kept a value in local memory (benchmarks/RESULTS.md, session 24).
  static constexpr bool kFoldedExponent = !kFp8Pv && !kSmoothQ && kHeadDim == 64;
  // The folded exponent's least scale: only all-zero Q or K groups (codes 0) have a smaller one
  // (0); fp16/bf16 inputs give at least ~1e-20. A power of two, so 1.5 * 2^23 * s stays exact.
  static constexpr float kMinFoldedScale = 0x1p-100f;
  static constexpr int kBlockQ = kMmaBlockQ;
  // Execution geometry. The FP8 variants (Ada's fast path, registers tight): 8 warps of one
  // 16-row MMA slab, 128-key tiles. INT8 + FP16 PV: 4 warps of two slabs and 64-key tiles, as
  // FlashAttention-2: every K/V fragment a warp reads from shared memory feeds both slabs'
  // MMAs, which halves the shared-memory traffic per MMA (8 warps of one slab read 384 KB per
  // 128 x 128 tile, more than half the tile's time at 365 TOPS on the H100), and the CTA fits
  // in 91 KB, so two run per SM (and one on a 99 KB Ada/Ampere SM). The per-thread groups are
  // the same either way: Q groups of 16-row slabs (reference.quantize_q_reference(warps=kMmaWarps)), K groups of
  // kMmaBlockK-key blocks, of which a 64-key tile is half (its keys 8i + 2t + {0,1} are still
  // group t).
  static constexpr int kWarps = kFp8Pv ? kMmaWarps : kMmaInputPvWarps;
  static constexpr int kBlockK = kFp8Pv ? kMmaBlockK : kMmaInputPvTileK;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockQ / kWarps;  // 16 or 32: one or two MMA slabs
  static constexpr int kSlabs = kRowsPerWarp / 16;
  static constexpr int kKeyTiles = kBlockK / 8;          // n8 tiles of S per KV tile
  static constexpr int kDimTiles = kHeadDim / 8;         // n8 tiles of O
  // A QK k-step reads 32 bytes of a code row: 32 INT8 or 64 INT4 channels.
  static constexpr int kQkRowBytes = kQk == QkCodes::kInt8 ? kHeadDim : kHeadDim / 2;
  static constexpr int kQkSteps = kQkRowBytes / 32;
  static constexpr int kQkChunks = kQkRowBytes / 16;     // 16-byte chunks of a code row
  // The V tile: kBlockK key rows of D input-dtype values, or (FP8, transposed by quantize_kv) D
  // channel rows of kBlockK E4M3 keys, the K-major B operand of the FP8 MMA.
  static constexpr int kVRows = kFp8Pv ? kHeadDim : kBlockK;
  static constexpr int kVRowBytes = kFp8Pv ? kBlockK : kHeadDim * 2;
  static constexpr int kVChunks = kVRowBytes / 16;
  static constexpr int kPvSteps = kBlockK / 32;          // k-steps of the FP8 PV MMA per tile
  static constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448): P~ * 448 in the exponent
  static_assert(kMmaBlockQ % kWarps == 0 && kMmaBlockK % kBlockK == 0 && kBlockK % 32 == 0, "geometry");
  static constexpr int kQBytes = kBlockQ * kQkRowBytes;
  static constexpr int kRowConstantBytes = kBlockQ * 4;  // q . k_mean per query (LSE only)
  static constexpr int kKBytes = kBlockK * kQkRowBytes;
  static constexpr int kVBytes = kVRows * kVRowBytes;
  static constexpr int kDeltaBytes = kBlockK * 4;
  static constexpr int kKScaleBytes = 16;  // the 4 K group scales of the tile
  static constexpr int kStageBytes = kKBytes + kVBytes + kDeltaBytes + kKScaleBytes;
  // Three stages: a K/V tile is requested two tiles ahead of its use. The FP8 variants must fit
  // the 99 KB a block may have on Ada (sm_89), where they are the fast path: INT8 + FP8 at
  // head_dim 128 takes 81 KB with two stages (114 KB with three). INT8 + FP16 at head_dim 128
  // takes 91 KB (64-key tiles): two CTAs per SM on sm_80/sm_90, one on sm_86/sm_89.
  static constexpr int kStages = kFp8Pv && kQk == QkCodes::kInt8 && kHeadDim == 128 ? 2 : 3;
  static constexpr int kSmemBytes = kQBytes + kRowConstantBytes + kStages * kStageBytes;
  // Q's fragments stay in registers for the whole KV loop (INT8 + FP16 PV at head_dim 64) or are
  // re-read from shared memory every tile (head_dim 128, and FP8 PV: 16 or 32 registers fewer,
  // which there is the difference between spilling and not).
  static constexpr bool kResidentQ = !kFp8Pv && kHeadDim == 64;
  static constexpr bool kHeadPerTile = !kFp8Pv && kHeadDim == 128;
  static_assert(!kFp8Pv || kSmemBytes <= 99 * 1024, "the FP8 variants must fit an Ada SM");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(127 * 127 * kHeadDim < (1 << 22), "small_int_to_float needs |QK int32| < 2^22");
  static_assert(kQk == QkCodes::kInt8 || kFp8Pv, "INT4 QK is built with FP8 PV only (the 4-bit kernel)");

  // Shared memory: the Q codes, the row constants of the LSE, then kStages pipeline stages of
  // {K codes, V, Delta-S}. Stage addresses are computed, not indexed from an array, so nothing
  // lands in local memory.
  struct Smem {
    unsigned char* base;
    __device__ unsigned char* q() const { return base; }
    __device__ float* row_constant() const { return reinterpret_cast<float*>(base + kQBytes); }
    __device__ unsigned char* stage(int i) const { return base + kQBytes + kRowConstantBytes + i * kStageBytes; }
    __device__ unsigned char* k(int i) const { return stage(i); }
    __device__ unsigned char* v(int i) const { return stage(i) + kKBytes; }
    __device__ float* delta(int i) const { return reinterpret_cast<float*>(stage(i) + kKBytes + kVBytes); }
    __device__ float* k_scale(int i) const { return delta(i) + kBlockK; }
  };

  // One KV tile into one pipeline stage. Keys past kv_len read nothing and land as zeros (the
  // K codes and Delta-S are padded by quantize_kv; V is the caller's unpadded tensor).
  //
  // With kThreads a multiple of a row's chunk count, a thread copies one fixed chunk column of
  // rows r, r + step, r + 2*step, ... with step a multiple of 8 (so the swizzle, which only sees
  // row & 7, (row >> 1) & 3 or (row >> 2) & 1, is the same for all of them): its addresses are
  // affine in the unrolled index. Written as a generic strided loop, the address arithmetic of
  // these copies was most of the kernel's integer work (SASS: ~400 instructions per tile, ncu:
  // ALU the top pipe).
  template <int kChunks, int kRows>
  struct TileCopy {
    static constexpr int kRowStep = kThreads / kChunks;
    static constexpr int kPasses = kRows / kRowStep;
    static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0, "copy geometry");
    __device__ static int row() { return threadIdx.x / kChunks; }
    __device__ static int chunk() { return threadIdx.x % kChunks; }
    __device__ static int smem_offset() { return swizzled_offset<kChunks>(row(), chunk()); }
  };
  using KCopy = TileCopy<kQkChunks, kBlockK>;
  using VCopy = TileCopy<kVChunks, kVRows>;

  // Per-(batch, head) base pointers of everything a KV tile reads, held through the KV loop, or
  // derived from the block index again at every tile where their 8 registers would spill
  // (kHeadPerTile: INT8 + FP16 PV at head_dim 128, whose loop runs at 255 registers; at head_dim
  // 64 holding them measured 10 % faster on the H100, benchmarks/RESULTS.md session 10).
  struct KvHead {
    const int8_t* k;
    const float* k_scale;
    const void* v;       // the head's V rows (kInput) or its transposed E4M3 V (kFp8)
    const float* delta;  // kSmoothQ only

    __device__ static KvHead of(const AttentionMmaParams& p) {
      const int h = blockIdx.y, b = blockIdx.z;
      const int hk = h / (p.q_heads / p.kv_heads);
      const int64_t bhk = static_cast<int64_t>(b) * p.kv_heads + hk;
      KvHead head;
      head.k = p.k_codes + bhk * p.k_padded * kQkRowBytes;
      head.k_scale = p.k_scale + bhk * (p.k_padded / kMmaBlockK) * 4;
      head.v = kFp8Pv ? static_cast<const void*>(static_cast<const uint8_t*>(p.v) + bhk * kHeadDim * p.k_padded)
                      : static_cast<const void*>(static_cast<const T*>(p.v) + b * p.v_stride_b + hk * p.v_stride_h);
      head.delta = kSmoothQ ? p.delta_s + (static_cast<int64_t>(b) * p.q_heads + h) * p.k_padded : nullptr;
      return head;
    }
  };

  __device__ static void load_kv_tile(const AttentionMmaParams& p, const Smem& s, int stage, const KvHead& head,
                                      int64_t k0) {
    const int8_t* kg = head.k + (k0 + KCopy::row()) * kQkRowBytes + KCopy::chunk() * 16;
    unsigned char* ks = s.k(stage) + KCopy::smem_offset();
#pragma unroll
    for (int j = 0; j < KCopy::kPasses; ++j)
      ptx::cp_async_16(ks + j * KCopy::kRowStep * kQkRowBytes, kg + j * KCopy::kRowStep * kQkRowBytes, true);

    unsigned char* vs = s.v(stage) + VCopy::smem_offset();
    if constexpr (kFp8Pv) {
      // Channel rows of k_padded keys, zero-padded by quantize_kv: no tail to mask.
      const uint8_t* vg = static_cast<const uint8_t*>(head.v) + VCopy::row() * p.k_padded + k0 + VCopy::chunk() * 16;
#pragma unroll
      for (int j = 0; j < VCopy::kPasses; ++j)
        ptx::cp_async_16(vs + j * VCopy::kRowStep * kVRowBytes, vg + j * VCopy::kRowStep * p.k_padded, true);
    } else {
      const T* v_head = static_cast<const T*>(head.v);
      const int64_t v_row = k0 + VCopy::row();
      const T* vg = v_head + v_row * p.v_stride_n + VCopy::chunk() * 8;
#pragma unroll
      for (int j = 0; j < VCopy::kPasses; ++j) {
        const bool valid = v_row + j * VCopy::kRowStep < p.kv_len;
        ptx::cp_async_16(vs + j * VCopy::kRowStep * kVRowBytes,
                         valid ? vg + j * VCopy::kRowStep * p.v_stride_n : v_head, valid);
      }
    }
    // The tile's K scales travel with it: read from global memory between the QK MMAs and the
    // softmax, their latency stalled every warp once per tile.
    if (threadIdx.x == kThreads - 1) ptx::cp_async_16(s.k_scale(stage), head.k_scale + k0 / kMmaBlockK * 4, true);
    if (kSmoothQ && threadIdx.x < kBlockK / 4)
      ptx::cp_async_16(s.delta(stage) + threadIdx.x * 4, head.delta + k0 + threadIdx.x * 4, true);
  }

  // O += P V in the input dtype (FP32 accumulation). The S fragment of two n8 tiles is the A
  // fragment of m16n8k16, so P goes from registers straight into the MMA.
  __device__ static void accumulate_pv_input(const Smem& s, int stage, int lane, const float (&sc)[kSlabs][kKeyTiles][4],
                                             float (&o)[kSlabs][kDimTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      uint32_t pa[kSlabs][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl) {
        pa[sl][0] = HalfPair<T>::pack(sc[sl][2 * kk][0], sc[sl][2 * kk][1]);
        pa[sl][1] = HalfPair<T>::pack(sc[sl][2 * kk][2], sc[sl][2 * kk][3]);
        pa[sl][2] = HalfPair<T>::pack(sc[sl][2 * kk + 1][0], sc[sl][2 * kk + 1][1]);
        pa[sl][3] = HalfPair<T>::pack(sc[sl][2 * kk + 1][2], sc[sl][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDimTiles / 2; ++dp) {
        uint32_t bv[4];
        const int key = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
        ptx::ldmatrix_x4_trans(bv, s.v(stage) + swizzled_offset<kVChunks>(key, dp * 2 + lane / 16));
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          ptx::mma_m16n8k16_f32<HalfPair<T>::kBf16>(o[sl][2 * dp], pa[sl], bv[0], bv[1]);
          ptx::mma_m16n8k16_f32<HalfPair<T>::kBf16>(o[sl][2 * dp + 1], pa[sl], bv[2], bv[3]);
        }
      }
    }
  }

  // O += P~ V with FP8 operands (paper 3.3, 3.4). With V's keys stored in the order of DESIGN.md,
  // the S fragment of n8 tiles 4c .. 4c+3 is, packed to E4M3, the A fragment of k-step c. Each
  // pair of n8 channel tiles gets a fresh accumulator over the tile's kPvSteps k-steps, then
  // folded into O (already rescaled by alpha): the two-level accumulation, which on Ada keeps
  // the FP22 accumulator of the FP8 MMA to 128 products of a row.
  __device__ static void accumulate_pv_fp8(const Smem& s, int stage, int lane, const float (&sc)[kSlabs][kKeyTiles][4],
                                           float (&o)[kSlabs][kDimTiles][4]) {
    uint32_t pa[kSlabs][kPvSteps][4];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int c = 0; c < kPvSteps; ++c)
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
          const int r = reg & 1, n = 4 * c + 2 * (reg >> 1);
          pa[sl][c][reg] = pack_e4m3x4(sc[sl][n][2 * r], sc[sl][n][2 * r + 1], sc[sl][n + 1][2 * r],
                                       sc[sl][n + 1][2 * r + 1]);
        }
#pragma unroll
    for (int dp = 0; dp < kDimTiles / 2; ++dp) {
      float racc[kSlabs][2][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int e = 0; e < 4; ++e) racc[sl][0][e] = racc[sl][1][e] = 0.0f;
#pragma unroll
      for (int c = 0; c < kPvSteps; ++c) {
        // Matrices: channels 16dp + 0..7 and + 8..15, keys 32c + 0..15 and + 16..31.
        uint32_t bv[4];
        const int channel = dp * 16 + (lane % 8) + 8 * (lane / 16);
        ptx::ldmatrix_x4(bv, s.v(stage) + swizzled_offset<kVChunks>(channel, c * 2 + (lane / 8) % 2));
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl) {
          ptx::mma_m16n8k32_e4m3(racc[sl][0], pa[sl][c], bv[0], bv[1]);
          ptx::mma_m16n8k32_e4m3(racc[sl][1], pa[sl][c], bv[2], bv[3]);
        }
      }
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[sl][2 * dp][e] += racc[sl][0][e];
          o[sl][2 * dp + 1][e] += racc[sl][1][e];
        }
    }
  }

  // The CTA's Q block to per-thread codes in shared memory (paper Eq. 8, the groups and the
  // arithmetic of reference.quantize_q_reference(block_q=128, warps=8): the same codes and scales, bit for bit), so
  // Q costs no pass before the kernel. The quad that shares rows {g, g+8} of a 16-row slab
  // holds one group: thread t reads the rows' 16-byte vectors t, t + 4, ... (a warp's load
  // covers 64 contiguous bytes of 8 rows), takes the group max over the quad and writes its
  // codes where the ldmatrix of the QK product reads them. Rows past q_len are zero codes and
  // stay out of the max. Returns the thread's Q scale of each slab, times sm_scale * log2(e).
  // With the LSE and K smoothing, q . k_mean of each row (raw q: the row constant K smoothing
  // drops from every score) goes to shared memory for the epilogue.
  __device__ static void quantize_q_block(const AttentionMmaParams& p, const Smem& s, int b, int h, int64_t q0,
                                          int warp_row0, int g, int t, float (&q_scale)[kSlabs]) {
    constexpr int kVecs = kHeadDim / 8 / 4;  // 16-byte vectors of a row per quad thread
    using Codes = IntCodes<kQk == QkCodes::kInt4>;
    const T* q_head = static_cast<const T*>(p.q) + b * p.q_stride_b + h * p.q_stride_h;
    const int64_t bh = static_cast<int64_t>(b) * p.q_heads + h;
    const float* mean = kSmoothQ ? p.q_mean + bh * kHeadDim : nullptr;
    const float* k_mean = p.lse != nullptr && p.k_mean != nullptr
                              ? p.k_mean + (static_cast<int64_t>(b) * p.kv_heads + h / (p.q_heads / p.kv_heads)) * kHeadDim
                              : nullptr;
#pragma unroll 1
    for (int sl = 0; sl < kSlabs; ++sl) {
      uint4 raw[2][kVecs];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * r;
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
          raw[r][j] = query < p.q_len ? ptx::ld_global_nc_v4(q_head + query * p.q_stride_n + (4 * j + t) * 8)
                                      : make_uint4(0, 0, 0, 0);
      }
      // Launched after quantize_kv (after_quantize_kv), the kernel may read only the caller's Q
      // before this, and write nothing: the means, K, V and Delta-S come from the launches
      // before it. Q's loads are in flight while it waits. (The next slab's wait returns at
      // once, as does every wait of a grid launched the ordinary way.)
      ptx::griddepcontrol_wait();
      float x[2][kVecs][8];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool valid = q0 + warp_row0 + sl * 16 + g + 8 * r < p.q_len;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          widen8<T>(raw[r][j], x[r][j]);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int channel = (4 * j + t) * 8 + e;
            if (k_mean != nullptr) dot = fmaf(x[r][j][e], __ldg(k_mean + channel), dot);
            // Rows past q_len read as zeros and stay zeros (the mean is not subtracted there).
            if (kSmoothQ && valid) x[r][j][e] -= __ldg(mean + channel);
          }
        }
        if (k_mean != nullptr) {
          dot = quad_sum(dot);
          if (t == 0) s.row_constant()[warp_row0 + sl * 16 + g + 8 * r] = dot;
        }
      }
      float amax = 0.0f;
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kVecs; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(x[r][j][e]));
      const float scale = quant_scale(quad_max(amax), static_cast<float>(Codes::kQmax));
      const float inv = quant_inverse(scale);
      // A runtime slab index must not index the register array (it would go to local memory).
#pragma unroll
      for (int i = 0; i < kSlabs; ++i)
        if (i == sl) q_scale[i] = scale * p.q_scale_multiplier;
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int byte = (4 * j + t) * Codes::kBytesPer8;  // of the code row
          Codes::store(reinterpret_cast<int8_t*>(s.q() + swizzled_offset<kQkChunks>(warp_row0 + sl * 16 + g + 8 * r,
                                                                                  byte / 16) + byte % 16),
                       x[r][j], inv);
        }
    }
  }

  __device__ static void run(const AttentionMmaParams& p, unsigned char* smem_base) {
    const Smem s{smem_base};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;  // accumulator fragment: rows g, g+8; columns 2t, 2t+1
    const int q_blocks = static_cast<int>(gridDim.x);
    // Causal: the heaviest query blocks (most keys) are scheduled first.
    const int qb = kCausal ? q_blocks - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.q_heads / p.kv_heads);
    const int64_t q0 = static_cast<int64_t>(qb) * kBlockQ;

    int64_t tiles = (p.kv_len + kBlockK - 1) / kBlockK;
    if constexpr (kCausal) {
      const int64_t last_query = (q0 + kBlockQ < p.q_len ? q0 + kBlockQ : p.q_len) - 1;
      const int64_t needed = last_query / kBlockK + 1;
      tiles = needed < tiles ? needed : tiles;
    }
    const int kv_tiles = static_cast<int>(tiles);  // 32-bit loop counters: registers are short
    const int64_t bhk = static_cast<int64_t>(b) * p.kv_heads + hk;
    const int warp_row0 = warp * kRowsPerWarp;
    // One Q scale per thread and slab: its rows g and g+8 of slab j are both in group 8j + g (Eq. 8).
    float q_scale[kSlabs];
    quantize_q_block(p, s, b, h, q0, warp_row0, g, t, q_scale);
    const KvHead head = KvHead::of(p);
    // Prologue: tiles 0 .. kStages-2 one cp.async group each.
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < kv_tiles) load_kv_tile(p, s, i, head, static_cast<int64_t>(i) * kBlockK);
      ptx::cp_async_commit();
    }

    float o[kSlabs][kDimTiles][4];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[sl][n][e] = 0.0f;
    float row_max[kSlabs][2], row_sum[kSlabs][2];
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) row_max[sl][r] = -INFINITY, row_sum[sl][r] = 0.0f;

    // The warp's rows that are queries (< q_len): its row j is one iff j < warp_queries.
    const int64_t queries_left = p.q_len - q0 - warp_row0;
    const int warp_queries = static_cast<int>(queries_left < kRowsPerWarp ? queries_left : kRowsPerWarp);
    // The warp's Q fragments (A operands, one per 32 bytes of codes).
    uint32_t qa[kSlabs][kQkSteps][4];
    for (int it = 0; it < kv_tiles; ++it) {
      const int stage = it % kStages;
      const int64_t k0 = static_cast<int64_t>(it) * kBlockK;
      ptx::cp_async_wait<kStages - 2>();  // tile `it` has landed
      __syncthreads();                    // ... for every thread (and, first time round, Q's codes); and
                                          // stage it-1 is free again
      // kHeadPerTile: the tile index passes through opaque(), so the tile's global addresses are
      // computed here from it and the block index rather than carried across the loop as
      // pointers (which spilled at 255 registers).
      const int ahead = kHeadPerTile ? opaque(it + kStages - 1) : it + kStages - 1;
      if (ahead < kv_tiles)
        load_kv_tile(p, s, ahead % kStages, kHeadPerTile ? KvHead::of(p) : head, static_cast<int64_t>(ahead) * kBlockK);
      ptx::cp_async_commit();
      // ---- S = Q K^T (INT8 or INT4, exact int32 accumulation) ----
      int32_t acc[kSlabs][kKeyTiles][4];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[sl][n][e] = 0;
#pragma unroll
      for (int kc = 0; kc < kQkSteps; ++kc) {
        if (!kResidentQ || it == 0) {
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl) {
            const int row = warp_row0 + sl * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
            ptx::ldmatrix_x4(qa[sl][kc], s.q() + swizzled_offset<kQkChunks>(row, kc * 2 + lane / 16));
          }
        }
#pragma unroll
        for (int np = 0; np < kKeyTiles / 2; ++np) {
          uint32_t bk[4];
          const int key = np * 16 + (lane % 8) + 8 * (lane / 16);
          ptx::ldmatrix_x4(bk, s.k(stage) + swizzled_offset<kQkChunks>(key, kc * 2 + (lane / 8) % 2));
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl) {
            if constexpr (kQk == QkCodes::kInt8) {
              ptx::mma_m16n8k32_s8(acc[sl][2 * np], qa[sl][kc], bk[0], bk[1]);
              ptx::mma_m16n8k32_s8(acc[sl][2 * np + 1], qa[sl][kc], bk[2], bk[3]);
            } else {
              ptx::mma_m16n8k64_s4(acc[sl][2 * np], qa[sl][kc], bk[0], bk[1]);
              ptx::mma_m16n8k64_s4(acc[sl][2 * np + 1], qa[sl][kc], bk[2], bk[3]);
            }
          }
        }
      }

      // ---- dequantize (one scale per thread), Delta-S, masks ----
      // Keys 2t and 2t+1 of every 8 are K group t (Eq. 8), so one K scale per thread too.
      // kFoldedExponent: each score stays f = 1.5 * 2^23 + x (x its integer dot product) until
      // its exponent, which is then one FFMA, f * s - (1.5 * 2^23 * s + m) = x * s - m rounded
      // once, where dequantizing and then subtracting the row max m took FADD, FMUL, FADD (two
      // instructions per score fewer: a tenth of the loop's). A thread takes its max on its f
      // (they order as x does). The constant is exact: s keeps 20 significant bits (a relative
      // change below 1e-6), so 1.5 * 2^23 * s has at most 22, and m is an integer (the row max
      // rounded up), both on the grid of their sum while s < 0.67 (|q| and |k| of ~250 at
      // head_dim 64); above, the constant's rounding moves an exponent by at most a third of a
      // unit of s, far below the quantization error. With FP8 P~ or Delta-S, scores are
      // dequantized first.
      const float k_scale = s.k_scale(stage)[t];
      float qk_scale[kSlabs];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl) {
        if constexpr (kFoldedExponent)  // (an all-zero group's scale 0 would give -inf * 0 for masked keys)
          qk_scale[sl] = fmaxf(__uint_as_float(__float_as_uint(q_scale[sl] * k_scale) & 0xFFFFFFF0u), kMinFoldedScale);
        else
          qk_scale[sl] = q_scale[sl] * k_scale;
      }
      const bool needs_mask = k0 + kBlockK > p.kv_len || (kCausal && k0 + kBlockK - 1 > q0 + warp_row0);
      float sc[kSlabs][kKeyTiles][4];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        const float2 ds = kSmoothQ ? *reinterpret_cast<const float2*>(s.delta(stage) + n * 8 + 2 * t)
                                    : make_float2(0.0f, 0.0f);
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sc[sl][n][e] = kFoldedExponent ? small_int_plus_offset(acc[sl][n][e])
                                           : small_int_to_float(acc[sl][n][e]) * qk_scale[sl] + ((e & 1) ? ds.y : ds.x);
      }
      if (needs_mask) {
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // The row's last visible key as an offset into the tile, in [-1, kBlockK - 1] (int32
            // compares: the int64 ones cost the registers that spilled at head_dim 128): the
            // tail of kv_len and, causal, the query's own position.
            int64_t last = p.kv_len - 1 - k0;
            if (kCausal) {
              const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * r;
              last = query - k0 < last ? query - k0 : last;
            }
            const int last_key = static_cast<int>(last < -1 ? -1 : (last > kBlockK - 1 ? kBlockK - 1 : last));
#pragma unroll
            for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
              for (int c = 0; c < 2; ++c)
                if (n * 8 + 2 * t + c > last_key) sc[sl][n][2 * r + c] = -INFINITY;
          }
      }

      // ---- online softmax (base 2). With FP8 PV, x448 of P's E4M3 scale joins the exponent:
      // P~ * 448 in [0, 448] comes out of exp2 directly (and so does its row sum). ----
      float tile_max[kSlabs][2];
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) mx = fmaxf(mx, fmaxf(sc[sl][n][2 * r], sc[sl][n][2 * r + 1]));
          // Folded: dequantized before the quad's reduction, since its threads' K scales differ
          // (K groups 2t, 2t + 1 of every 8 keys).
          if constexpr (kFoldedExponent) mx = (mx - kSmallIntOffset) * qk_scale[sl];  // -inf stays -inf
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          tile_max[sl][r] = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        }
      // FP16/BF16 PV: the running max moves, and O and l are rescaled, only when a tile's max
      // passes it by more than 2^kMmaLazyRescaleLog2 in some row of the warp (rows past q_len do
      // not count, so the emulation can follow). P~ then stays below 256, far inside both types'
      // range, whose relative rounding does not depend on the magnitude. Past the first tiles a
      // rescale is rare, and a tile skips kSlabs * 2 * kDimTiles * 2 FMULs on O (+4-8 % on the
      // H100, benchmarks/RESULTS.md). FP8 P~ * 448 must stay within E4M3's 448: exact max there.
      bool rescale = true;
      if constexpr (!kFp8Pv) {
        bool grows = false;
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            grows |= sl * 16 + 8 * r + g < warp_queries && tile_max[sl][r] > row_max[sl][r] + kMmaLazyRescaleLog2;
        rescale = __any_sync(0xffffffffu, grows);
      }
      if (rescale) {
#pragma unroll
        for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float mx = kFoldedExponent ? ceilf(fmaxf(row_max[sl][r], tile_max[sl][r]))
                                             : fmaxf(row_max[sl][r], tile_max[sl][r]);
            // A row that has seen only masked keys keeps max -inf; exp2 against 0 keeps it at 0.
            const float alpha = ptx::exp2_approx(row_max[sl][r] - (mx == -INFINITY ? 0.0f : mx));
            row_max[sl][r] = mx;
            row_sum[sl][r] *= alpha;
#pragma unroll
            for (int n = 0; n < kDimTiles; ++n) {
              o[sl][n][2 * r] *= alpha;
              o[sl][n][2 * r + 1] *= alpha;
            }
          }
      }
#pragma unroll
      for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float ref = row_max[sl][r] == -INFINITY ? 0.0f : row_max[sl][r];
          const float bias = kFp8Pv ? ref - kLog2Fp8Max : ref;
          const float shift = kFoldedExponent ? fmaf(-kSmallIntOffset, qk_scale[sl], -bias) : 0.0f;
          const auto exponent = [&](float x) { return kFoldedExponent ? fmaf(x, qk_scale[sl], shift) : x - bias; };
          float sum = 0.0f;
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) {
            sc[sl][n][2 * r] = ptx::exp2_approx(exponent(sc[sl][n][2 * r]));
            sc[sl][n][2 * r + 1] = ptx::exp2_approx(exponent(sc[sl][n][2 * r + 1]));
            sum += sc[sl][n][2 * r] + sc[sl][n][2 * r + 1];
          }
          row_sum[sl][r] += sum;  // lane-partial; reduced at the end
        }

      if constexpr (kFp8Pv) accumulate_pv_fp8(s, stage, lane, sc, o);
      else accumulate_pv_input(s, stage, lane, sc, o);
    }

    // ---- epilogue: normalise (FP8: times V's channel scale, plus its mean), write O (and the
    // natural-log LSE) ----
    T* out = static_cast<T*>(p.out) + b * p.out_stride_b + h * p.out_stride_h;
    Fp8PvChannels<kFp8Pv ? kDimTiles : 1> v_channels;
    if constexpr (kFp8Pv)
      v_channels.load(p.v_scale + bhk * kHeadDim, p.v_mean != nullptr ? p.v_mean + bhk * kHeadDim : nullptr, t);
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[sl][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int64_t query = q0 + warp_row0 + sl * 16 + g + 8 * r;
        if (query >= p.q_len) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* row = out + query * p.out_stride_n;
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          const int col = n * 8 + 2 * t;
          float2 x = make_float2(o[sl][n][2 * r] * inv, o[sl][n][2 * r + 1] * inv);
          if constexpr (kFp8Pv) x = v_channels.apply(x.x, x.y, n);
          *reinterpret_cast<uint32_t*>(row + col) = HalfPair<T>::pack(x.x, x.y);
        }
        if (p.lse != nullptr && t == 0) {
          constexpr float kLn2 = 0.6931471805599453f;
          // FP8: l sums P~ * 448. K smoothing dropped the row constant sm_scale * q . k_mean,
          // which the LSE of the true scores includes (this thread wrote it, quantize_q_block).
          const float log2_l = __log2f(l) - (kFp8Pv ? kLog2Fp8Max : 0.0f);
          const float dropped = p.k_mean != nullptr ? p.sm_scale * s.row_constant()[warp_row0 + sl * 16 + g + 8 * r] : 0.0f;
          p.lse[(static_cast<int64_t>(b) * p.q_heads + h) * p.q_len + query] =
              l > 0.0f ? (row_max[sl][r] + log2_l) * kLn2 + dropped : -INFINITY;
        }
      }
  }
};

// Archs before sm_89 have no FP8 MMA: their code for the FP8 variants is a stub (the launch
// refuses them there, see attention_mma.cu).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
inline constexpr bool kCompilingFp8Mma = false;
#else
inline constexpr bool kCompilingFp8Mma = true;
#endif

// INT8 + FP16 PV (4 warps of 128 threads, 91 KB at head_dim 128) runs two CTAs per SM: at most
// 255 registers per thread, no cap in practice. The FP8 variants run where they are native, Ada,
// whose 100 KB SM holds one CTA of INT8 + FP8 at either head_dim anyway: they take the
// registers they need.
template <PvOperands kPv>
inline constexpr int kMmaMinBlocksPerSm = kPv == PvOperands::kInput ? 2 : 1;

template <typename T, int kHeadDim, bool kCausal, bool kSmoothQ, QkCodes kQk, PvOperands kPv>
__global__ void __launch_bounds__(AttentionMmaKernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv>::kThreads,
                                  kMmaMinBlocksPerSm<kPv>) attention_mma_kernel(const __grid_constant__ AttentionMmaParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  if constexpr (kPv == PvOperands::kFp8 && !kCompilingFp8Mma) {
    __trap();
  } else {
    AttentionMmaKernel<T, kHeadDim, kCausal, kSmoothQ, kQk, kPv>::run(p, smem);
  }
}

}  // namespace sageattention2
