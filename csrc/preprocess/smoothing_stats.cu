// Launch of the smoothing statistics (no ATen here: see preprocess/params.h).
#include "common/launch.cuh"
#include "preprocess/smoothing_stats.cuh"

namespace sageattention2 {

cudaError_t launch_smoothing_stats(const StatsParams& p, int jobs, InputDtype dtype, cudaStream_t stream) {
  dispatch_input_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    smoothing_stats_partial_kernel<T><<<dim3(p.chunks, jobs), kPreprocessThreads, 0, stream>>>(p);
  });
  if (p.chunks > 1) smoothing_stats_finalize_kernel<<<jobs, kPreprocessThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sageattention2
