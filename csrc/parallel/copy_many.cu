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

__global__ void __launch_bounds__(kVectorWalkThreads) copy_many_kernel(const __grid_constant__ CopyManyParams p) {
  const CopyPair& pair = p.pairs[blockIdx.y];
  const uint4* src = static_cast<const uint4*>(pair.src);
  uint4* dst = static_cast<uint4*>(pair.dst);
  const uint32_t step = gridDim.x * kVectorWalkThreads;  // (i + step < 2^32: both are < 2^31)
  for (uint32_t i = blockIdx.x * kVectorWalkThreads + threadIdx.x; i < pair.walk.vectors; i += step) {
    const VectorWalk::Place at = pair.walk.place(i);
    dst[at.row(pair.dst_stride) + at.vector] = ptx::ld_global_nc_v4(src + at.row(pair.src_stride) + at.vector);
  }
}

}  // namespace

cudaError_t launch_copy_many(const CopyManyParams& p, int device, cudaStream_t stream) {
  if (p.num_pairs <= 0) return cudaSuccess;
  uint32_t most = 0;
  for (int i = 0; i < p.num_pairs; ++i) most = p.pairs[i].walk.vectors > most ? p.pairs[i].walk.vectors : most;
  int sms = 0;
  if (const cudaError_t status = device_attribute(cudaDevAttrMultiProcessorCount, device, &sms);
      status != cudaSuccess) {
    return status;
  }
  const dim3 grid(vector_walk_ctas(most, sms, p.num_pairs), p.num_pairs);  // (the pairs share the GPU)
  return launch_kernel(copy_many_kernel, grid, dim3(kVectorWalkThreads), 0, stream, false, p);
}

}  // namespace sageattention2
