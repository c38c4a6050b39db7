// A value hidden from the optimiser.
#pragma once

namespace sageattention2 {

// The value, hidden from the optimiser: what is derived from it is computed where it is used,
// not hoisted out of a loop into registers held across it.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

}  // namespace sageattention2
