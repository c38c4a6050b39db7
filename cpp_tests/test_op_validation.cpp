// The argument checks and output shapes of the ops, through the dispatcher with Meta tensors
// (no GPU needed): the same code that the CUDA implementation runs before launching.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace {

using torch::Tensor;

c10::TensorOptions meta(torch::Dtype dtype = torch::kHalf) {
  return torch::TensorOptions().device(torch::kMeta).dtype(dtype);
}

auto op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> quantize_kv(const Tensor& k, const std::optional<Tensor>& v,
                                                       const std::optional<Tensor>& v_scale,
                                                       const std::optional<Tensor>& q_mean, int64_t block_k,
                                                       const std::string& dtype) {
  static auto handle =
      op("sageattention2::quantize_kv")
          .typed<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
              const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
              const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&, int64_t,
              const std::string&, double)>();
  return handle.call(k, v, std::nullopt, std::nullopt, v_scale, q_mean, block_k, dtype, 1.0);
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(QuantizeKV, NonContiguousViewsAreAccepted) {
  auto nhd = torch::empty({2, 300, 4, 64}, meta()).transpose(1, 2);  // [B, H, N, D] view of NHD
  auto [codes, scales, v_codes, delta_s, v_tile_scale] = quantize_kv(nhd, nhd, std::nullopt, std::nullopt, 64, "int8");
  EXPECT_EQ(codes.sizes(), (c10::IntArrayRef{2, 4, 320, 64}));
  EXPECT_EQ(v_tile_scale.sizes(), (c10::IntArrayRef{2, 4, 5}));
}

TEST(QuantizeKV, TensorErrorsNameTheArgument) {
  const auto error = [](const Tensor& k) {
    return error_of([&] { quantize_kv(k, std::nullopt, std::nullopt, std::nullopt, 64, "int8"); });
  };
  EXPECT_NE(error(torch::empty({1, 2, 64, 100}, meta())).find("head_dim"), std::string::npos);
  EXPECT_NE(error(torch::empty({2, 64, 128}, meta())).find("4-D"), std::string::npos);
  EXPECT_NE(error(torch::empty({1, 2, 64, 128}, meta(torch::kFloat))).find("float16 or bfloat16"), std::string::npos);
  EXPECT_NE(error(torch::empty({1, 2, 0, 128}, meta())).find("at least one token"), std::string::npos);
  auto k = torch::empty({1, 2, 64, 128}, meta());
  EXPECT_NE(error_of([&] { quantize_kv(k, std::nullopt, std::nullopt, std::nullopt, 64, "fp8"); }).find("qk_dtype"),
            std::string::npos);
}

TEST(QuantizeKV, ShapesWithGqaDeltaS) {
  auto k = torch::empty({2, 2, 777, 128}, meta());
  auto v_scale = torch::empty({2, 2, 128}, meta(torch::kFloat));
  auto q_mean = torch::empty({2, 8, 128}, meta(torch::kFloat));
  auto [kc, ks, vc, ds, vts] = quantize_kv(k, k, v_scale, q_mean, 64, "int4");
  EXPECT_EQ(kc.sizes(), (c10::IntArrayRef{2, 2, 832, 64}));
  EXPECT_EQ(ks.sizes(), (c10::IntArrayRef{2, 2, 13, 4}));
  EXPECT_EQ(vc.sizes(), (c10::IntArrayRef{2, 2, 128, 832}));
  EXPECT_EQ(vc.scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_EQ(ds.sizes(), (c10::IntArrayRef{2, 8, 832}));
  EXPECT_EQ(vts.numel(), 0);  // V came with per-channel scales
  // Without v_scale: one V scale per tile, returned.
  auto [kc2, ks2, vc2, ds2, vts2] = quantize_kv(k, k, std::nullopt, std::nullopt, 128, "int8");
  EXPECT_EQ(vc2.sizes(), (c10::IntArrayRef{2, 2, 128, 896}));
  EXPECT_EQ(vts2.sizes(), (c10::IntArrayRef{2, 2, 7}));
  EXPECT_EQ(vts2.scalar_type(), torch::kFloat);
}

TEST(QuantizeKV, ErrorsNameTheArgument) {
  auto k = torch::empty({1, 2, 100, 64}, meta());
  auto v_scale = torch::empty({1, 2, 64}, meta(torch::kFloat));
  EXPECT_NE(error_of([&] { quantize_kv(k, k, torch::empty({1, 2, 32}, meta(torch::kFloat)), std::nullopt, 64, "int8"); })
                .find("v_scale"),
            std::string::npos);
  EXPECT_NE(error_of([&] { quantize_kv(k, k, v_scale, std::nullopt, 48, "int8"); }).find("block_k"),
            std::string::npos);
  auto bad_q_mean = torch::empty({1, 3, 64}, meta(torch::kFloat));
  EXPECT_NE(error_of([&] { quantize_kv(k, k, v_scale, bad_q_mean, 64, "int8"); }).find("multiple"),
            std::string::npos);
  auto v_other = torch::empty({1, 2, 99, 64}, meta());
  EXPECT_NE(error_of([&] { quantize_kv(k, v_other, v_scale, std::nullopt, 64, "int8"); }).find("shape of k"),
            std::string::npos);
  auto k_bf16 = torch::empty({1, 2, 100, 64}, meta(torch::kBFloat16));
  EXPECT_NE(error_of([&] { quantize_kv(k, k_bf16, v_scale, std::nullopt, 64, "int8"); }).find("same dtype"),
            std::string::npos);
}

TEST(SmoothingStats, Shapes) {
  static auto handle = op("sageattention2::smoothing_stats")
                           .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(
                               const std::optional<Tensor>&, const std::optional<Tensor>&,
                               const std::optional<Tensor>&, bool)>();
  auto q = torch::empty({2, 8, 50, 64}, meta());
  auto k = torch::empty({2, 2, 70, 64}, meta());
  auto [qm, km, vm, vs] = handle.call(q, k, k, false);
  EXPECT_EQ(qm.sizes(), (c10::IntArrayRef{2, 8, 64}));
  EXPECT_EQ(km.sizes(), (c10::IntArrayRef{2, 2, 64}));
  EXPECT_EQ(vm.numel(), 0);
  EXPECT_EQ(vs.sizes(), (c10::IntArrayRef{2, 2, 64}));
  // With no tensor at all the dispatcher has no device to dispatch on and refuses first.
  EXPECT_FALSE(error_of([&] { handle.call(std::nullopt, std::nullopt, std::nullopt, false); }).empty());
}

}  // namespace
