// Launch geometry and layout arithmetic of the preprocessing kernels.
//
// Pure C++ (no CUDA, no torch) so that GoogleTest checks it on machines without a GPU.
#pragma once

#include <cstdint>

namespace sageattention2 {

// Every preprocessing kernel moves 16-byte vectors: 8 fp16/bf16 elements per thread per row.
inline constexpr int kElemsPerVector = 8;
inline constexpr int kPreprocessThreads = 256;
// Head dims the preprocessing supports: multiples of 8 (one 16-byte vector) up to 256.
inline constexpr int kMaxHeadDim = 256;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// How a CTA of `threads` threads covers rows of `head_dim` elements with 16-byte vectors.
struct RowTiling {
  int threads_per_row;  // head_dim / 8
  int rows_per_pass;    // rows a CTA covers at once; threads beyond rows_per_pass*threads_per_row idle
};

constexpr RowTiling row_tiling(int head_dim, int threads = kPreprocessThreads) {
  const int per_row = head_dim / kElemsPerVector;
  return RowTiling{per_row, threads / per_row};
}

inline constexpr int kKGroupsPerBlock = 4;
// Lane l of an m16n8 accumulator fragment holds columns 2*(l%4) and 2*(l%4)+1 of every
// 8-column slab, so key j shares its lane (and scale) with the keys of equal (j % 8) / 2.
constexpr int k_group_of_key(int key_in_block) { return (key_in_block % 8) / 2; }
constexpr bool valid_block_k(int block_k) {
  return block_k == 32 || block_k == 64 || block_k == 128;
}

// V is stored transposed with the keys of every 16 permuted so that the accumulator fragment
// of S (keys {2t, 2t+1, 8+2t, 9+2t} in lane t%4) is the A fragment of mma.m16n8k32.e4m3
// (4 consecutive K elements per lane): stored slot 4t+i holds key 2t + (i&1) + 8*(i>>1).
constexpr int v_key_of_slot(int slot) {
  const int base = slot & ~15, s = slot & 15, t = s / 4, i = s % 4;
  return base + 2 * t + (i & 1) + 8 * (i >> 1);
}
constexpr int v_slot_of_key(int key) {
  const int base = key & ~15, j = key & 15;
  return base + 4 * ((j % 8) / 2) + (j & 1) + 2 * (j / 8);
}

// The reduction over tokens (means, V's channel range) is split in chunks of rows so that
// enough CTAs are in flight; partial results are combined in a fixed order (deterministic).
struct StatsGrid {
  int chunks;          // CTAs per (tensor, batch, head)
  int64_t rows_per_chunk;
};

// Up to this many rows a job is one CTA's, which writes the results itself: no second launch
// (the Hopper path's sampled means read at most 256 rows per head: api.smoothing_sample_stride).
inline constexpr int64_t kStatsSingleChunkRows = 256;

constexpr StatsGrid stats_grid(int64_t max_rows, int64_t jobs, int sm_count,
                               int64_t min_rows_per_chunk = 64, int max_chunks = 64) {
  if (max_rows <= kStatsSingleChunkRows) return StatsGrid{1, max_rows > 1 ? max_rows : 1};
  // Aim for about 16 CTAs per SM over all jobs: about 3 waves at the 5 resident CTAs an SM holds,
  // so the last, partial wave costs little (with 4 per SM, a second wave of a few CTAs doubled
  // the launch's time: 52 % of DRAM bandwidth at B4 H32 N1024, ncu).
  int64_t want = jobs > 0 ? ceil_div(16LL * sm_count, jobs) : 1;
  int64_t by_rows = ceil_div(max_rows, min_rows_per_chunk);
  int64_t chunks = want < by_rows ? want : by_rows;
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks < 1) chunks = 1;
  return StatsGrid{static_cast<int>(chunks), ceil_div(max_rows, chunks)};
}

}  // namespace sageattention2
