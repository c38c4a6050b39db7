// The quantize_kv kernel (paper Fig. 3, steps 2-3): per-thread quantization of K, the Delta-S
// vector, and FP8 V in the layout of the PV MMA. The data contract it implements is
// docs/DESIGN.md#quantize_kv.
//
// K and V: two CTAs per (KV block, kv head, batch), one per tensor (one tile of shared memory
// each, so an SM holds twice as many CTAs as with both tiles in one: more loads in flight while
// other CTAs quantize). The K CTA smooths K by its token mean, quantizes per thread (4 groups per
// block) and takes the key's exact Delta-S = q_mean . (K_j - k_mean) from the same tile; the V
// CTA smooths V (optional), quantizes it to FP8 per channel (smoothing_stats' scales: the
// warp-level kernels) or with one scale per tile (its own: the Hopper kernel) and writes it
// transposed in the key order of the PV MMA (docs/DESIGN.md#v-layout).
#pragma once

#include "common/geometry.h"
#include "common/ptx.cuh"
#include "preprocess/kv_tile.cuh"
#include "preprocess/params.h"
#include "preprocess/quantize_k.cuh"
#include "preprocess/quantize_v.cuh"

namespace sageattention2 {

// Grid: x = KV blocks (times 2 with V: K and V CTAs of a block adjacent), y = kv heads, z = batch.
// kHeadDim: the head_dim at compile time (64, 128, 256) or 0 (any other, read from the views).
// sageattn's Hopper path launches it as a programmatic dependent of smoothing_stats, and the
// attention kernel as one of it, so that each launch's start and first loads overlap the tail
// of the one before (launch_quantize_kv). Before griddepcontrol.wait a tile function only
// starts loading the caller's K or V, which were complete before smoothing_stats started; the
// means that launch writes, and every write of this one (into memory that may have been freed
// while that launch ran), come after it. Except (v_overlaps_prior_grid) a V tile that needs no
// mean or scale from it, in a call that keeps that launch's tensors alive: it runs whole beside
// smoothing_stats.
template <typename T, bool kInt4, int kHeadDim>
__global__ void __launch_bounds__(kPreprocessThreads)
    quantize_kv_kernel(const __grid_constant__ QuantizeKVParams p) {
  ptx::griddepcontrol_launch_dependents();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* tile = reinterpret_cast<T*>(smem_raw);  // [block_k][pitch]
  __shared__ KVTileSmem sm;
  // Blocks run in the reverse order of smoothing_stats' reads, so the first K/V tiles read here
  // are the ones that launch read last, still in L2 (50 MB on the H100: most of K and V at 1K).
  const int per_block = p.has_v ? 2 : 1;
  const int x = gridDim.x - 1 - blockIdx.x;
  const int kb = x / per_block, h = gridDim.y - 1 - blockIdx.y, b = gridDim.z - 1 - blockIdx.z;
  // Key ranges: an item's blocks past its keys are never read (the attention kernel runs its
  // ceil(keys / 128) tiles), so they are not written either.
  if (p.k.ranges != nullptr && static_cast<int64_t>(kb) * p.block_k >= item_tokens(p.k, b)) return;
  if (x % per_block != 0) {
    quantize_v_tile<T, kHeadDim>(p, tile, sm, kb, h, b);
  } else if (p.int8_heads != nullptr && p.int8_heads[b * static_cast<int>(gridDim.y) + h] != p.int8_heads_run) {
    return;  // the other launch of the INT4 guard codes this head's K
  } else if constexpr (kHeadDim != 0) {
    if (k_block_in_registers(p)) quantize_k_block_in_registers<T, kInt4, kHeadDim>(p, sm, kb, h, b);
    else quantize_k_tile<T, kInt4, kHeadDim>(p, tile, sm, kb, h, b);
  } else {
    quantize_k_tile<T, kInt4, 0>(p, tile, sm, kb, h, b);
  }
}

}  // namespace sageattention2
