// Calling sageattention2 from C++ through the PyTorch dispatcher, as a LibTorch user would:
// link libsageattention2_ops (its TORCH_LIBRARY block registers the ops), look an op up by
// name, call it. Runs on any machine and checks what it can there (exit status 1 on any
// failed check, so ctest fails):
// - everywhere, with Meta tensors: the output shapes and dtypes of smoothing_stats, quantize_kv
//   and the two composite attention ops against docs/DESIGN.md's contract (K padded to block_k,
//   one K scale per group of 4, V's codes transposed and E4M3, absent outputs as empty [0]
//   float32 tensors), and that a bad argument raises an error that names it;
// - with a CUDA device, also the kernels: the K codes dequantize back to K within half a step.
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

using torch::Tensor;

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// The output ``t`` has the contract's sizes and dtype.
void check_output(const char* name, const Tensor& t, std::vector<int64_t> sizes, c10::ScalarType dtype) {
  const bool ok = t.sizes() == c10::IntArrayRef(sizes) && t.scalar_type() == dtype;
  check(ok, c10::str(name, ": ", t.sizes(), " ", t.scalar_type(), " (contract: ", c10::IntArrayRef(sizes), " ",
                     dtype, ")"));
}

// The message of the c10::Error that ``fn`` raises, or "" when it raises none.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

int main() {
  using torch::kFloat;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const char* name : {"sageattention2::smoothing_stats", "sageattention2::quantize_kv",
                           "sageattention2::sageattn_mma", "sageattention2::sageattn_wgmma"})
    std::printf("%s\n", toString(dispatcher.findSchemaOrThrow(name, "").schema()).c_str());

  auto stats = dispatcher.findSchemaOrThrow("sageattention2::smoothing_stats", "")
                   .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
                       const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&, bool)>();
  auto quantize_kv = dispatcher.findSchemaOrThrow("sageattention2::quantize_kv", "")
                         .typed<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
                             const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, const std::optional<Tensor>&,
                             const std::optional<Tensor>&, int64_t, const std::string&, double)>();
  auto sageattn_mma = dispatcher.findSchemaOrThrow("sageattention2::sageattn_mma", "")
                          .typed<std::tuple<Tensor, Tensor>(
                              const Tensor&, const Tensor&, const Tensor&, const std::string&, const std::string&,
                              bool, bool, bool, int64_t, double, bool, bool, bool, double)>();
  auto sageattn_wgmma = dispatcher.findSchemaOrThrow("sageattention2::sageattn_wgmma", "")
                            .typed<std::tuple<Tensor, Tensor>(
                                const Tensor&, const Tensor&, const Tensor&, const std::string&, bool, bool, int64_t,
                                double, bool, bool, bool, const std::optional<Tensor>&,
                                const std::optional<Tensor>&, int64_t)>();

  // The contract's shapes, with Meta tensors (the shape functions the CUDA ops run before
  // launching): K and V of 300 tokens, 2 heads, head_dim 128; Q of 4 heads (GQA 2:1).
  const auto meta = torch::TensorOptions().dtype(torch::kHalf).device(torch::kMeta);
  {
    Tensor q = torch::empty({1, 4, 200, 128}, meta), k = torch::empty({1, 2, 300, 128}, meta);
    auto [q_mean, k_mean, v_mean, v_scale] = stats.call(q, k, k, true);
    check_output("smoothing_stats q_mean", q_mean, {1, 4, 128}, kFloat);
    check_output("smoothing_stats k_mean", k_mean, {1, 2, 128}, kFloat);
    check_output("smoothing_stats v_mean", v_mean, {1, 2, 128}, kFloat);
    check_output("smoothing_stats v_scale", v_scale, {1, 2, 128}, kFloat);
    auto [no_q_mean, k_mean2, no_v_mean, v_scale2] = stats.call(std::nullopt, k, k, false);
    check_output("smoothing_stats q_mean (no q: absent)", no_q_mean, {0}, kFloat);
    check_output("smoothing_stats v_mean (no smooth_v: absent)", no_v_mean, {0}, kFloat);

    // Per-channel V scales given: no per-tile scales; Delta-S for the 4 query heads.
    auto [k_codes, k_scale, v_fp8, delta_s, v_tile_scale] =
        quantize_kv.call(k, k, k_mean, v_mean, v_scale, q_mean, 64, "int8", 0.125);
    check_output("quantize_kv k_codes (int8, N padded to 64)", k_codes, {1, 2, 320, 128}, torch::kChar);
    check_output("quantize_kv k_scale (4 groups per block)", k_scale, {1, 2, 5, 4}, kFloat);
    check_output("quantize_kv v_fp8 (transposed)", v_fp8, {1, 2, 128, 320}, torch::kFloat8_e4m3fn);
    check_output("quantize_kv delta_s", delta_s, {1, 4, 320}, kFloat);
    check_output("quantize_kv v_tile_scale (v_scale given: absent)", v_tile_scale, {0}, kFloat);
    // INT4 codes packed two per byte; one V scale per 128-key tile when v_scale is absent.
    auto [k_int4, k_scale4, v_fp8_tiles, no_delta_s, tile_scale] =
        quantize_kv.call(k, k, k_mean, std::nullopt, std::nullopt, std::nullopt, 128, "int4", 1.0);
    check_output("quantize_kv k_codes (int4, packed)", k_int4, {1, 2, 384, 64}, torch::kChar);
    check_output("quantize_kv k_scale (block_k 128)", k_scale4, {1, 2, 3, 4}, kFloat);
    check_output("quantize_kv v_fp8 (block_k 128)", v_fp8_tiles, {1, 2, 128, 384}, torch::kFloat8_e4m3fn);
    check_output("quantize_kv delta_s (no q_mean: absent)", no_delta_s, {0}, kFloat);
    check_output("quantize_kv v_tile_scale", tile_scale, {1, 2, 3}, kFloat);

    // The composite ops: out in q's shape and dtype, the LSE [B, Hq, Nq] float32 when asked.
    auto [out, lse] = sageattn_mma.call(q, k, k, "int8", "input", false, true, false, 1, 0.088, true, false, true, 0.0);
    check_output("sageattn_mma out", out, {1, 4, 200, 128}, torch::kHalf);
    check_output("sageattn_mma lse", lse, {1, 4, 200}, kFloat);
    auto [out_w, no_lse] = sageattn_wgmma.call(q, k, k, "fp8", true, false, 3, 0.088, false, false, false,
                                               std::nullopt, std::nullopt, 0);
    check_output("sageattn_wgmma out", out_w, {1, 4, 200, 128}, torch::kHalf);
    check_output("sageattn_wgmma lse (not asked: absent)", no_lse, {0}, kFloat);

    // Bad arguments raise errors that name them, through the dispatcher as from Python.
    const auto block_k_error = error_of(
        [&] { quantize_kv.call(k, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 96, "int8", 1.0); });
    check(block_k_error.find("block_k") != std::string::npos,
          "quantize_kv(block_k=96) raises an error naming block_k: \"" + block_k_error.substr(0, 120) + "\"");
    const auto pv_error = error_of(
        [&] { sageattn_mma.call(q, k, k, "int8", "e5m2", false, true, false, 1, 0.088, false, false, false, 0.0); });
    check(pv_error.find("pv_dtype") != std::string::npos,
          "sageattn_mma(pv_dtype=\"e5m2\") raises an error naming pv_dtype: \"" + pv_error.substr(0, 120) + "\"");
  }

  if (!torch::cuda::is_available()) {
    std::printf("no CUDA device: the contract's shapes and checks only (%d failed)\n", failures);
    return failures == 0 ? 0 : 1;
  }
  // The kernels: K's INT8 codes times their group's scale, plus K's mean, give back K to half a
  // quantization step.
  auto opts = torch::TensorOptions().dtype(torch::kHalf).device(torch::kCUDA);
  Tensor k = torch::randn({1, 2, 300, 128}, opts);
  auto [q_mean, k_mean, v_mean, v_scale] = stats.call(std::nullopt, k, k, false);
  auto [k_codes, k_scale, v_fp8, delta_s, v_tile_scale] =
      quantize_kv.call(k, k, k_mean, std::nullopt, v_scale, std::nullopt, 64, "int8", 1.0);
  auto key = torch::arange(k_codes.size(2), torch::TensorOptions().device(torch::kCUDA));
  auto scale = k_scale.index({torch::indexing::Slice(), torch::indexing::Slice(), key.div(64, "floor"),
                              key.remainder(8).div(2, "floor")});
  auto k_hat = k_codes.to(kFloat) * scale.unsqueeze(-1) + k_mean.unsqueeze(2);
  auto err = (k_hat.narrow(2, 0, 300) - k.to(kFloat)).abs().max().item<float>();
  auto half_step = scale.max().item<float>() / 2;
  check(err <= half_step * 1.0001f, c10::str("CUDA: max |dequant(K) - K| = ", err, " (half a step: ", half_step, ")"));
  std::printf("%d failed\n", failures);
  return failures == 0 ? 0 : 1;
}
