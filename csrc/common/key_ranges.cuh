// The rows of a key-ranges tensor ([batch][3] int32 on the device: each batch item's first key,
// end key and smoothing-sample stride; docs/DESIGN.md#key-ranges), as every kernel that takes
// one reads them (the preprocessing's item views, the Hopper kernel's work items).
#pragma once

namespace sageattention2 {

__device__ __forceinline__ int key_range_first(const int* ranges, int b) { return __ldg(ranges + 3 * b); }
__device__ __forceinline__ int key_range_end(const int* ranges, int b) { return __ldg(ranges + 3 * b + 1); }
__device__ __forceinline__ int key_range_stride(const int* ranges, int b) { return __ldg(ranges + 3 * b + 2); }

}  // namespace sageattention2
