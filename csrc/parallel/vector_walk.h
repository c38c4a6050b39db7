// The walk that context parallelism's memory-bound ops share (copy_many_, merge_attention_parts):
// tensors of up to four dimensions whose last is contiguous, visited as 16-byte vectors by a
// grid-stride loop, every tensor with its own strides for the three outer dimensions. Shared by
// the host (torch/parallel_ops.cpp: set up once per launch) and the kernels.
#pragma once

#include <cstdint>

#include "common/fast_divisor.h"

namespace sageattention2 {

inline constexpr int kVectorWalkThreads = 256;

struct VectorWalk {
  uint32_t rows[3] = {1, 1, 1};  // sizes of the outer dimensions, slowest first (1 where absent)
  uint32_t row_vectors = 0;      // 16-byte vectors in the contiguous last dimension
  uint32_t vectors = 0;          // rows[0] * rows[1] * rows[2] * row_vectors, < 2^31
  FastDivisor by_row_vectors, by_rows2, by_rows1;

  static VectorWalk of(uint32_t rows0, uint32_t rows1, uint32_t rows2, uint32_t row_vectors) {
    VectorWalk w;
    w.rows[0] = rows0;
    w.rows[1] = rows1;
    w.rows[2] = rows2;
    w.row_vectors = row_vectors;
    w.vectors = rows0 * rows1 * rows2 * row_vectors;
    if (w.vectors == 0) return w;  // (nothing to walk: no divisor of 0 is set up)
    w.by_row_vectors = FastDivisor::of(row_vectors);
    w.by_rows2 = FastDivisor::of(rows2);
    w.by_rows1 = FastDivisor::of(rows1);
    return w;
  }

  // Where vector i lies: its outer indices and its place in the row. By multiply and shift
  // (common/fast_divisor.h): three runtime divisions per 16 bytes would cost ~60 instructions
  // where HBM delivers a vector every few cycles per SM.
  struct Place {
    uint32_t index[3];
    uint32_t vector;
    // The offset of the row's start in a tensor with these strides (in the tensor's units).
    SAGE_FAST_DIVISOR_FN int64_t row(const int64_t stride[3]) const {
      return index[0] * stride[0] + index[1] * stride[1] + index[2] * stride[2];
    }
  };
  SAGE_FAST_DIVISOR_FN Place place(uint32_t i) const {
    Place at;
    const uint32_t row = by_row_vectors.quotient(i);
    at.vector = i - row * row_vectors;
    const uint32_t outer = by_rows2.quotient(row);
    at.index[2] = row - outer * rows[2];
    at.index[0] = by_rows1.quotient(outer);
    at.index[1] = outer - at.index[0] * rows[1];
    return at;
  }
};

// CTAs for a walk of `most` vectors (the longest of `sharing` walks that run side by side, one
// row of CTAs each): eight CTAs of 256 threads fill an SM, and each thread takes four vectors at
// least (fewer, larger CTAs would leave SMs idle; more would only add loop setup).
inline uint32_t vector_walk_ctas(uint32_t most, int sms, int sharing) {
  const uint32_t wanted = (most + kVectorWalkThreads * 4 - 1) / (kVectorWalkThreads * 4);
  const uint32_t room = static_cast<uint32_t>(sms * 8 / (sharing < 1 ? 1 : sharing));
  const uint32_t ctas = wanted < room ? wanted : room;
  return ctas < 1 ? 1 : ctas;
}

}  // namespace sageattention2
