// Host-side arithmetic of the kernels: group geometry (paper Eq. 8 / appendix A.6), the V key
// permutation, launch geometry, the quantizer arithmetic of docs/DESIGN.md#quantizer-arithmetic
// and the tile scheduler's division by multiply and shift.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "common/fast_divisor.h"
#include "common/geometry.h"
#include "common/quant_math.cuh"

using namespace sageattention2;

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

TEST(FastDivisor, QuotientEqualsIntegerDivision) {
  // Every divisor up to 4096 and the largest ones, against dividends at both ends of [0, 2^31)
  // and random ones: the bound of common/fast_divisor.h is tightest at large n and d.
  std::mt19937 random(37);
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (uint32_t d : {(1u << 31) - 1, (1u << 30) + 1, (1u << 30), 3u << 29, 65537u, 1u << 16})
    divisors.push_back(d);
  for (int i = 0; i < 2000; ++i) divisors.push_back(1 + random() % ((1u << 31) - 1));
  for (uint32_t d : divisors) {
    const FastDivisor f = FastDivisor::of(d);
    std::vector<uint32_t> dividends = {0, 1, d - 1, d, (1u << 31) - 1, (1u << 31) - 2, (1u << 31) - d};
    for (int i = 0; i < 64; ++i) dividends.push_back(random() % (1u << 31));
    for (uint32_t n : dividends) ASSERT_EQ(f.quotient(n), n / d) << n << " / " << d;
  }
}
