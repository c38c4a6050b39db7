// Calling sageattention2 from C++ through the PyTorch dispatcher, as a LibTorch user would:
// link libsageattention2_ops (its TORCH_LIBRARY block registers the ops), look an op up by
// name, call it. Runs on any machine: with Meta tensors it exercises shapes and checks; with a
// CUDA device it also runs the kernels and checks the K codes dequantize back to K.
#include <torch/torch.h>

#include <cstdio>

int main() {
  using torch::Tensor;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const char* name : {"sageattention2::smoothing_stats", "sageattention2::quantize_kv"})
    std::printf("%s\n", toString(dispatcher.findSchemaOrThrow(name, "").schema()).c_str());

  auto stats = dispatcher.findSchemaOrThrow("sageattention2::smoothing_stats", "")
                   .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
                       const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&, bool)>();
  auto quantize_kv = dispatcher.findSchemaOrThrow("sageattention2::quantize_kv", "")
                         .typed<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
                             const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, int64_t, const std::string&, double)>();

  const bool cuda = torch::cuda::is_available();
  auto opts = torch::TensorOptions().dtype(torch::kHalf).device(cuda ? torch::kCUDA : torch::kMeta);
  Tensor k = cuda ? torch::randn({1, 2, 300, 128}, opts) : torch::empty({1, 2, 300, 128}, opts);
  auto [q_mean, k_mean, v_mean, v_scale] = stats.call(std::nullopt, k, k, false);
  auto [k_codes, k_scale, v_fp8, delta_s, v_tile_scale] =
      quantize_kv.call(k, k, k_mean, std::nullopt, v_scale, std::nullopt, 64, "int8", 1.0);
  std::printf("device=%s k_codes=%s k_scale=%s v_fp8=%s\n", cuda ? "cuda" : "meta",
              c10::str(k_codes.sizes()).c_str(), c10::str(k_scale.sizes()).c_str(),
              c10::str(v_fp8.sizes()).c_str());
  if (!cuda) {
    std::printf("no CUDA device: shapes only\n");
    return 0;
  }
  auto key = torch::arange(k_codes.size(2), torch::TensorOptions().device(torch::kCUDA));
  auto scale = k_scale.index({torch::indexing::Slice(), torch::indexing::Slice(), key.div(64, "floor"),
                              key.remainder(8).div(2, "floor")});
  auto k_hat = k_codes.to(torch::kFloat) * scale.unsqueeze(-1) + k_mean.unsqueeze(2);
  auto err = (k_hat.narrow(2, 0, 300) - k.to(torch::kFloat)).abs().max().item<float>();
  auto half_step = scale.max().item<float>() / 2;
  std::printf("max |dequant(K) - K| = %g (half a step: %g)\n", err, half_step);
  return err <= half_step * 1.0001f ? 0 : 1;
}
