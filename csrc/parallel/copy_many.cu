// copy_many_ (parallel/copy_many.h). Context parallelism's Ulysses exchange writes this rank's
// tokens of every rank's heads into that rank's buffer (PyTorch's symmetric memory: the other
// ranks' buffers are mapped here, written over NVLink). As one copy per pair, the local pairs
// (HBM) and the remote ones (NVLink) ran one after another, each a launch the host paid for: on
// 2 H200s 0.27 ms a Wan block for q, k and v, of which the remote bytes alone need ~0.2, and the
// first block of a forward, which finds the GPU idle, waited on the host between the copies
// (session 46). One launch runs every pair at once: a row of CTAs per pair.
#include "common/ptx.cuh"
#include "common/launch.cuh"
#include "parallel/copy_many.h"

namespace sageattention2 {
namespace {

__global__ void __launch_bounds__(kCopyManyThreads) copy_many_kernel(const __grid_constant__ CopyManyParams p) {
  const CopyPair& pair = p.pairs[blockIdx.y];
  const uint4* src = static_cast<const uint4*>(pair.src);
  uint4* dst = static_cast<uint4*>(pair.dst);
  const uint32_t step = gridDim.x * kCopyManyThreads;  // (i + step < 2^32: both are < 2^31)
  for (uint32_t i = blockIdx.x * kCopyManyThreads + threadIdx.x; i < pair.words; i += step) {
    // A word's place by multiply and shift (common/fast_divisor.h): three runtime divisions per
    // 16 bytes would cost ~60 instructions where HBM delivers a word every few cycles per SM.
    const uint32_t row = pair.by_row_words.quotient(i), word = i - row * pair.row_words;
    const uint32_t outer = pair.by_rows2.quotient(row), i2 = row - outer * pair.rows[2];
    const uint32_t i0 = pair.by_rows1.quotient(outer), i1 = outer - i0 * pair.rows[1];
    const int64_t from = i0 * pair.src_stride[0] + i1 * pair.src_stride[1] + i2 * pair.src_stride[2] + word;
    const int64_t to = i0 * pair.dst_stride[0] + i1 * pair.dst_stride[1] + i2 * pair.dst_stride[2] + word;
    dst[to] = ptx::ld_global_nc_v4(src + from);
  }
}

}  // namespace

cudaError_t launch_copy_many(const CopyManyParams& p, int device, cudaStream_t stream) {
  if (p.num_pairs <= 0) return cudaSuccess;
  uint32_t most = 0;
  for (int i = 0; i < p.num_pairs; ++i) most = p.pairs[i].words > most ? p.pairs[i].words : most;
  int sms = 0;
  if (const cudaError_t status = device_attribute(cudaDevAttrMultiProcessorCount, device, &sms);
      status != cudaSuccess) {
    return status;
  }
  // Eight CTAs of 256 threads fill an SM; the pairs share the GPU, four words a thread at least.
  const uint32_t wanted = (most + kCopyManyThreads * 4 - 1) / (kCopyManyThreads * 4);
  const uint32_t room = static_cast<uint32_t>(sms * 8 / p.num_pairs);
  const dim3 grid(wanted < 1 ? 1 : (wanted < room ? wanted : (room < 1 ? 1 : room)), p.num_pairs);
  return launch_kernel(copy_many_kernel, grid, dim3(kCopyManyThreads), 0, stream, false, p);
}

}  // namespace sageattention2
