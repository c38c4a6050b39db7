// Host-side arithmetic of the kernels: group geometry (paper Eq. 8 / appendix A.6), the V key
// permutation, launch geometry and the quantizer arithmetic of docs/DESIGN.md.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <tuple>
#include <vector>

#include "geometry.h"
#include "quant_math.cuh"

using namespace sageattention2;

TEST(QGroups, AppendixA6Geometry) {
  // b_q = 128, c_w = 4: each warp owns 32 rows; rows {i, 8+i, 16+i, 24+i} share a scale.
  const QGroupGeometry g{128, 4};
  ASSERT_TRUE(g.valid());
  EXPECT_EQ(g.groups_per_block(), 32);
  for (int warp = 0; warp < 4; ++warp)
    for (int i = 0; i < 8; ++i) {
      const int expected = warp * 8 + i;
      for (int m = 0; m < 4; ++m) EXPECT_EQ(g.group_of_row(warp * 32 + 8 * m + i), expected);
    }
}

TEST(QGroups, SixteenRowWarpsGiveTwoRowGroups) {
  const QGroupGeometry g{128, 8};  // a wgmma-style geometry: 16 rows per warp
  ASSERT_TRUE(g.valid());
  std::vector<int> count(g.groups_per_block(), 0);
  for (int r = 0; r < 128; ++r) ++count[g.group_of_row(r)];
  for (int c : count) EXPECT_EQ(c, 2);
  EXPECT_EQ(g.group_of_row(3), g.group_of_row(11));
  EXPECT_NE(g.group_of_row(3), g.group_of_row(19));
}

TEST(QGroups, RejectsGeometriesThatSplitAnMmaSlab) {
  EXPECT_FALSE((QGroupGeometry{128, 3}.valid()));
  EXPECT_FALSE((QGroupGeometry{64, 8}.valid()));   // 8 rows per warp
  EXPECT_FALSE((QGroupGeometry{256, 4}.valid()));  // beyond the supported block
  EXPECT_TRUE((QGroupGeometry{64, 4}.valid()));
}

TEST(KGroups, FragmentColumnPairs) {
  // Group g = keys {8m + 2g, 8m + 2g + 1}: 16 keys of a 64-key block each.
  for (int g = 0; g < 4; ++g) {
    std::set<int> keys;
    for (int j = 0; j < 64; ++j)
      if (k_group_of_key(j) == g) keys.insert(j);
    std::set<int> expected;
    for (int m = 0; m < 8; ++m) expected.insert({8 * m + 2 * g, 8 * m + 2 * g + 1});
    EXPECT_EQ(keys, expected);
  }
}

TEST(VLayout, PermutationMatchesDesignAndIsABijection) {
  const int expected[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};
  for (int s = 0; s < 16; ++s) EXPECT_EQ(v_key_of_slot(s), expected[s]);
  for (int key = 0; key < 128; ++key) EXPECT_EQ(v_key_of_slot(v_slot_of_key(key)), key);
  EXPECT_EQ(v_key_of_slot(16 + 2), 24);
}

TEST(Launch, RowTilingCoversTheHeadDim) {
  for (int d = 8; d <= kMaxHeadDim; d += 8) {
    const RowTiling t = row_tiling(d);
    EXPECT_EQ(t.threads_per_row * kElemsPerVector, d);
    EXPECT_GE(t.rows_per_pass, 1);
    EXPECT_LE(t.rows_per_pass * t.threads_per_row, kPreprocessThreads);
  }
}

TEST(Launch, StatsGridCoversAllRows) {
  for (int64_t rows : {1LL, 255LL, 256LL, 4097LL, 1LL << 20})
    for (int64_t jobs : {1LL, 8LL, 384LL}) {
      const StatsGrid g = stats_grid(rows, jobs, 132);
      EXPECT_GE(g.chunks, 1);
      EXPECT_LE(g.chunks, 64);
      EXPECT_GE(g.chunks * g.rows_per_chunk, rows);
      EXPECT_LT((g.chunks - 1) * g.rows_per_chunk, rows);  // no chunk is entirely empty
    }
}

TEST(Padding, RoundUp) {
  EXPECT_EQ(round_up(1, 64), 64);
  EXPECT_EQ(round_up(64, 64), 64);
  EXPECT_EQ(round_up(4097, 128), 4224);
  EXPECT_EQ(ceil_div(4097, 128), 33);
}

TEST(Quantizer, RoundsHalfToEvenAndClamps) {
  const float inv = quant_inverse(quant_scale(127.0f, kInt8Max));  // scale 1
  EXPECT_EQ(quantize_to_int(2.5f, inv, 127), 2);
  EXPECT_EQ(quantize_to_int(3.5f, inv, 127), 4);
  EXPECT_EQ(quantize_to_int(-2.5f, inv, 127), -2);
  EXPECT_EQ(quantize_to_int(200.0f, inv, 127), 127);
  EXPECT_EQ(quantize_to_int(-9.0f, 1.0f, 7), -7);
}

TEST(Quantizer, ZeroGroupGivesZeroScaleAndCodes) {
  const float scale = quant_scale(0.0f, kInt4Max);
  EXPECT_EQ(scale, 0.0f);
  EXPECT_EQ(quant_inverse(scale), 0.0f);
  EXPECT_EQ(quantize_to_int(0.0f, quant_inverse(scale), 7), 0);
}

TEST(Quantizer, GroupMaximumMapsToQmax) {
  for (float amax : {1e-3f, 0.37f, 1.0f, 3.3f, 65504.0f})
    for (float qmax : {kInt4Max, kInt8Max}) {
      const float inv = quant_inverse(quant_scale(amax, qmax));
      EXPECT_EQ(quantize_to_int(amax, inv, static_cast<int>(qmax)), static_cast<int>(qmax));
      EXPECT_EQ(quantize_to_int(-amax, inv, static_cast<int>(qmax)), -static_cast<int>(qmax));
    }
}

TEST(Quantizer, VTileScaleIsAFlooredPowerOfTwo) {
  EXPECT_EQ(v_tile_scale(448.0f), 1.0f);          // max / 448 already a power of two
  EXPECT_EQ(v_tile_scale(449.0f), 2.0f);          // else the next one up: codes stay <= 448
  EXPECT_EQ(v_tile_scale(3.0f), 0.0078125f);      // 3 / 448 = 0.0067 -> 2^-7
  EXPECT_EQ(v_tile_scale(0.0f), kVTileScaleMin);  // an all-zero tile: the floor, 2^-30
  EXPECT_EQ(v_tile_scale(1e-12f), kVTileScaleMin);
  EXPECT_EQ(kVTileScaleMin, std::ldexp(1.0f, -30));
}

TEST(Quantizer, InverseOfAPowerOfTwoIsExact) {
  // Every scale v_tile_scale can give (2^-30 .. 2^119 for bf16 inputs) and beyond.
  for (int k = -126; k <= 126; ++k) EXPECT_EQ(inverse_of_power_of_two(std::ldexp(1.0f, k)), std::ldexp(1.0f, -k)) << k;
  EXPECT_EQ(inverse_of_power_of_two(v_tile_scale(3.0f)), 128.0f);
}

TEST(Int4Packing, RoundTripsAllPairs) {
  for (int lo = -7; lo <= 7; ++lo)
    for (int hi = -7; hi <= 7; ++hi) {
      const uint8_t b = pack_int4x2(lo, hi);
      EXPECT_EQ(unpack_int4_low(b), lo);
      EXPECT_EQ(unpack_int4_high(b), hi);
    }
  EXPECT_EQ(pack_int4x2(1, -1), 0xF1);
}

TEST(PrepareKV, EveryKeyBlockOnceInTheOrderTheKernelNeedsThem) {
  // 7 heads of 5 key blocks in waves of 3 heads (the last wave has 1), and waves of 1 and 7.
  const int heads = 7, tiles = 5;
  for (int per_wave : {3, 1, 7, 9}) {
    std::set<std::pair<int, int>> seen;
    int last_wave = -1, last_tile = -1;
    for (int item = 0; item < heads * tiles; ++item) {
      const PrepareItem w = prepare_item(item, heads, tiles, per_wave);
      ASSERT_GE(w.head, 0);
      ASSERT_LT(w.head, heads);
      ASSERT_GE(w.tile, 0);
      ASSERT_LT(w.tile, tiles);
      EXPECT_TRUE(seen.insert({w.head, w.tile}).second) << "item " << item << " repeats a key block";
      // Waves of heads in order; inside a wave, key blocks in order (all of the wave's heads
      // for block j before block j + 1): the attention CTAs of a wave walk their tiles in step.
      const int wave = w.head / per_wave;
      EXPECT_GE(wave, last_wave);
      if (wave == last_wave) EXPECT_GE(w.tile, last_tile);
      if (wave != last_wave) EXPECT_EQ(w.tile, 0);
      last_wave = wave;
      last_tile = w.tile;
    }
    EXPECT_EQ(static_cast<int>(seen.size()), heads * tiles);
  }
}
