// The attention backward kernel's parameters (hopper/backward/kernel.cuh) and
// its launch (hopper/backward/launch.cu), host-visible: no device code here.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

namespace sageattention2 {

struct AttentionBackwardParams {
  // [B, H, N, 128] contiguous, the caller's dtype; K and V (and dK, dV) [B, Hkv, N, 128].
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  const float* k_mean;    // [B, Hkv, 128]: K's mean over its tokens, float32
  const float* lse;       // [B, H, q_len]: the forward's LSE (natural log)
  float* lse_log2;        // [B, H, q_padded]: (LSE - scale q . k_mean) log2(e), the LSE of the scores
                          // on K - k_mean; +inf past q_len and where the LSE is -inf (prepare kernel)
  float* delta;           // [B, H, q_padded]: rowsum(dO * O), 0 past q_len (prepare kernel)
  float* dq_accum;        // [B, H, Q blocks of 64, 2, 4096], zeroed: dS K summed over the key blocks,
                          // each warpgroup's 64 x 64 tile in its warps' fragment order
  void* dq;               // [B, H, q_len, 128]: scale dS K, from dq_accum by the finalize kernel
  void* dk;               // [B, H, kv_len, 128]: scale dS^T Q
  void* dv;               // [B, H, kv_len, 128]: P^T dO
  int heads;
  int kv_heads;  // divides heads
  int q_len;
  int q_padded;  // q_len rounded up to the Q block (64)
  int kv_len;
  float scale_log2;  // softmax scale times log2(e)
  float scale;       // softmax scale
};

// The copy engine's views (hopper/backward/launch.cu), as bytes: q and dout [B*H][q_len][256] in
// boxes of 128 bytes (64 channels) x 64 queries, k and v [B*Hkv][kv_len][256] in boxes of 128
// bytes x 128 keys, 128-byte swizzle; rows past the length land as zeros.
struct AttentionBackwardMaps {
  CUtensorMap q, dout, k, v;
};

cudaError_t launch_attention_backward_wgmma(const AttentionBackwardParams& p, bool bf16, bool causal, int batch,
                                            cudaStream_t stream);

}  // namespace sageattention2
