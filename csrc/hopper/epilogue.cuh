// The Hopper kernel's epilogue: O * s / l (+ V's mean, with smooth V) in the caller's dtype and
// layout, written through shared memory as 16-byte row segments; the natural-log LSE.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/convert.cuh"
#include "common/opaque.cuh"
#include "common/quant_math.cuh"  // kLog2Fp8Max
#include "common/v_channels.cuh"
#include "hopper/geometry.cuh"
#include "hopper/params.h"
#include "hopper/q_quantizer.cuh"  // WgmmaQRows
#include "hopper/tile_scheduler.cuh"

namespace sageattention2 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename T, int kHeadDim, bool kCausal, bool kFp8Pv, bool kPacked = false>
struct WgmmaEpilogue {
  static constexpr float kLog2PScale = kFp8Pv ? kLog2Fp8Max : 0.0f;  // P's scale (hopper/softmax.cuh)
  using Geometry = WgmmaGeometry<kHeadDim, kFp8Pv>;
  static constexpr int kORegs = Geometry::kORegs;
  // V's channel means (smooth V only; none are loaded without), all loads in flight together.
  // At head_dim 64 they load while the item's last PV product computes (the kernel calls
  // load_v_means before it); at 128 their 32 registers would push the item's own state out of
  // registers, so they load after the last fold (docs/DECISIONS.md#d8).
  static constexpr bool kEarlyVMeans = kHeadDim == 64;
  // The staging writes of store_output land where the Q quantizer wrote the item's codes: at
  // head_dim 128 their addresses are the same values, which the compiler computes once before
  // the item loop and keeps across it. At head_dim 128 causal, the loop that needs the most
  // registers, ptxas then kept two of them in an 8-byte stack frame (reloaded once per item).
  // There the byte offset of the writes is hidden from the optimiser, so the addresses are
  // computed where they are written, and nothing spills: the KV loop keeps its instructions
  // (another register allocation), and the item's code its length (ptxas moves O's registers once
  // per item instead). Elsewhere the shared values cost nothing, and the code stays as it was.
  static constexpr bool kStagingAddressesPerItem = kHeadDim == 128 && kCausal;

  // kPacked (packed items, hopper/params.h): the item's rows end at its end query, and out and
  // lse hold every item's rows (lse [Hq, total rows]).
  __device__ static int64_t query_end(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
    return item_query_end<kPacked>(p, w);
  }
  __device__ static int64_t lse_row(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
    if constexpr (kPacked) return w.h * p.lse_rows;
    return (static_cast<int64_t>(w.b) * p.q_heads + w.h) * p.q_len;
  }

  VChannelMeans<kHeadDim / 8> v_means;
  float inv[2];  // o_scale / l of the rows g and g + 8

  __device__ void load_v_means(const AttentionWgmmaParams& p, const WgmmaWorkItem& w) {
    const int t = threadIdx.x % 4;
    const int64_t bhk = static_cast<int64_t>(w.b) * p.kv_heads + w.hk;
    v_means.load(p.v_mean != nullptr ? p.v_mean + bhk * kHeadDim : nullptr, t);
  }

  // The item's output rows of this thread (consumer warpgroup `consumer`) from the KV loop's O
  // (in units of the V scale o_scale), row maxima m (base 2) and sums l of P~ * 448, through the
  // warpgroup's Q code tile q_tile; and their LSE.
  __device__ void store(const AttentionWgmmaParams& p, const WgmmaWorkItem& w, const WgmmaQRows& q,
                        const float (&o)[kORegs], const float (&m)[2], const float (&l)[2], float o_scale,
                        uint8_t* q_tile, int consumer) {
    const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int row_in_item = consumer * 64 + warp_in_group * 16 + g;  // the thread's rows: this and + 8
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = l[r];  // the whole row's: every thread of the quad holds it
      inv[r] = sum > 0.0f ? o_scale / sum : 0.0f;
      const int64_t query = w.q0 + row_in_item + 8 * r;
      if (p.lse != nullptr && t == 0 && query < query_end(p, w)) {
        constexpr float kLn2 = 0.6931471805599453f;
        // sum holds sum_j P~_j * 448 (16-bit P: x1) relative to the base-2 max m; K smoothing
        // dropped the row constant sm_scale * q . k_mean, which the LSE of the true scores includes.
        p.lse[lse_row(p, w) + query] =
            sum > 0.0f ? (m[r] + __log2f(sum) - kLog2PScale) * kLn2 + p.sm_scale * q.k_mean_dot[r] : -INFINITY;
      }
    }
    if constexpr (!kEarlyVMeans) load_v_means(p, w);
    store_output(p, w, o, inv, v_means, q_tile + warp_in_group * 16 * Geometry::kSpanRowBytes,
                 consumer * 64 + warp_in_group * 16, lane);
  }

  // Writes a warp's 16 rows of O through its own 16 rows of the Q code tile (free once the item's
  // last QK product completed; the next item's codes are written after this): the accumulator
  // layout gives each thread 4-byte pieces of 8 rows per store, which cost 8 memory transactions
  // per instruction (~0.9 tile's time per item, docs/DECISIONS.md#d8), and the round
  // trip through shared memory turns them into 16-byte stores of whole row segments. The tile
  // holds half the columns at a time (head_dim 256: a quarter, in the warp's rows of the first
  // 128-byte span, hopper/geometry.cuh; the rows of the second belong to the same warp too, but
  // 16 rows x 128 bytes are what the first holds).
  __device__ static void store_output(const AttentionWgmmaParams& p, const WgmmaWorkItem& w, const float (&o)[kORegs],
                                      const float (&inv)[2], const VChannelMeans<kHeadDim / 8>& v_means,
                                      uint8_t* staging, int warp_row0, int lane) {
    constexpr int kChunks = kHeadDim / 16 < 8 ? kHeadDim / 16 : 8;  // 16-byte chunks of a staged row
    constexpr int kPasses = kHeadDim / (8 * kChunks);                // (2: half the columns each)
    const int g = lane / 4, t = lane % 4;
    [[maybe_unused]] const int hidden_byte = kStagingAddressesPerItem ? opaque(4 * t) : 0;
    // XOR swizzle of the chunks so that both the 4-byte writes (8 rows, one chunk) and the 16-byte
    // reads (whole rows) are free of bank conflicts.
    auto chunk_at = [](int row, int chunk) {
      return row * kChunks * 16 + (chunk ^ (kChunks == 8 ? row & 7 : (row >> 1) & 3)) * 16;
    };
    T* out = static_cast<T*>(p.out) + w.b * p.out_stride_b + w.h * p.out_stride_h;
#pragma unroll
    for (int half = 0; half < kPasses; ++half) {
      if (half > 0) __syncwarp();  // the pass before has been read
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int n = half * kChunks + c;  // the accumulator's n8 tile: columns 8n .. 8n + 7
          const float2 x = v_means.apply(o[4 * n + 2 * r] * inv[r], o[4 * n + 2 * r + 1] * inv[r], n);
          uint8_t* dst = staging + chunk_at(g + 8 * r, c) + (kStagingAddressesPerItem ? hidden_byte : 4 * t);
          *reinterpret_cast<uint32_t*>(dst) = HalfPair<T>::pack(x.x, x.y);
        }
      __syncwarp();
#pragma unroll
      for (int k = 0; k < kChunks / 2; ++k) {  // 16 rows x kChunks chunks over 32 lanes
        const int idx = k * 32 + lane, row = idx / kChunks, chunk = idx % kChunks;
        const int64_t query = w.q0 + warp_row0 + row;
        const uint4 v = *reinterpret_cast<const uint4*>(staging + chunk_at(row, chunk));
        if (query < query_end(p, w))
          *reinterpret_cast<uint4*>(out + query * p.out_stride_n + (half * kChunks + chunk) * 8) = v;
      }
    }
    __syncwarp();  // every lane has read the staging rows before the next item's Q codes land there
  }
};
#endif  // sm_90a

}  // namespace sageattention2
