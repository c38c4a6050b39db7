// Division by an integer fixed for a whole launch as one multiply and one shift (T. Granlund and
// P. L. Montgomery, "Division by invariant integers using multiplication", PLDI 1994), set up on
// the host. A kernel's division by a runtime value is a ~20-instruction sequence (32-bit) or a
// subroutine call (64-bit); the Hopper kernel's tile scheduler divided the work unit's index
// three times per item in every consumer thread, about 7 % of its warps' samples at 512-token
// calls (ncu, session 37).
//
// For 1 <= d < 2^31 and l = ceil(log2 d): m = ceil(2^(31 + l) / d) < 2^32, and for every
// 0 <= n < 2^31, floor(n m / 2^(31 + l)) = floor(n / d): with m d = 2^(31 + l) + e, 0 <= e < d,
// n m / 2^(31 + l) = n / d + n e / (d 2^(31 + l)), and the second term is below n / 2^(31 + l)
// <= n / (2^31 d) < 1 / d, too little to reach the next integer.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SAGE_FAST_DIVISOR_FN __host__ __device__ __forceinline__
#else
#define SAGE_FAST_DIVISOR_FN inline
#endif

namespace sageattention2 {

struct FastDivisor {
  uint32_t multiplier = 1u << 31;  // (divisor 1: l = 0)
  uint32_t shift = 31;

  // d in [1, 2^31).
  static FastDivisor of(uint32_t d) {
    FastDivisor f;
    uint32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    f.shift = 31 + l;
    f.multiplier = static_cast<uint32_t>(((uint64_t{1} << f.shift) + d - 1) / d);
    return f;
  }
  // n in [0, 2^31).
  SAGE_FAST_DIVISOR_FN uint32_t quotient(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> shift);
  }
};

}  // namespace sageattention2
