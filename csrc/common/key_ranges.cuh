// The rows of a key-ranges tensor ([batch][3] int32 on the device: each batch item's first key,
// end key and smoothing-sample stride; docs/DESIGN.md#key-ranges), and of a packed-items tensor
// ([batch][3] int32: each item's first and end query and its first code row, packed sequences,
// docs/DESIGN.md#packed-sequences), as every kernel that takes them reads them (the
// preprocessing's item views and code rows, the Hopper kernel's work items).
#pragma once

#include <cstdint>

namespace sageattention2 {

__device__ __forceinline__ int key_range_first(const int* ranges, int b) { return __ldg(ranges + 3 * b); }
__device__ __forceinline__ int key_range_end(const int* ranges, int b) { return __ldg(ranges + 3 * b + 1); }
__device__ __forceinline__ int key_range_stride(const int* ranges, int b) { return __ldg(ranges + 3 * b + 2); }

__device__ __forceinline__ int packed_q_first(const int* items, int b) { return __ldg(items + 3 * b); }
__device__ __forceinline__ int packed_q_end(const int* items, int b) { return __ldg(items + 3 * b + 1); }
__device__ __forceinline__ int packed_code_row(const int* items, int b) { return __ldg(items + 3 * b + 2); }

// Where item b's codes of head h are: head slab code_head of the codes, from row code_row0 of it.
// Without packed items each (item, head) has its own slab (b * heads + h), from row 0; with them
// the items' codes lie back to back in one slab per head, each padded to whole blocks, item b's
// from row packed_code_row(b).
__device__ __forceinline__ int64_t code_head(const int* packed_items, int b, int h, int heads) {
  return packed_items == nullptr ? static_cast<int64_t>(b) * heads + h : h;
}
__device__ __forceinline__ int code_row0(const int* packed_items, int b) {
  return packed_items == nullptr ? 0 : packed_code_row(packed_items, b);
}

}  // namespace sageattention2
