// The torch_ln C++ API against LibTorch's own layer_norm and rms_norm, on the CPU and on a GPU when there is one.
//   cpp_api                        the checks; exits 1 on a mismatch
//   cpp_api INPUTS.pt OUTPUTS.pt   also runs layer_norm and rms_norm on [x, weight, bias] saved by torch.save
//                                  and saves [layer_norm, rms_norm] for Python to compare with torch_ln's
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>
#include <torch_ln/torch_ln.h>

#include <iostream>

#include "tensor_io.h"

namespace {

bool report(const std::string& what, const at::Tensor& got, const at::Tensor& expected, double tolerance) {
  const double difference = (got.to(at::kDouble) - expected.to(at::kDouble)).abs().max().item<double>();
  const bool ok = at::allclose(got, expected, tolerance, tolerance);
  std::cout << what << ": max |difference| " << difference << (ok ? " ok" : " MISMATCH") << std::endl;
  return ok;
}

bool check_on(const at::Device device) {
  const std::string on = " (" + device.str() + ")";
  at::manual_seed(0);
  const auto options = at::TensorOptions().device(device);
  // D = 257, prime: neither the vector width nor a thread count divides it, so the tails run.
  const int64_t D = 257;
  const auto x = at::randn({4, 33, D}, options), dy = at::randn({4, 33, D}, options);
  const auto weight = at::randn({D}, options), bias = at::randn({D}, options);
  // float32 both sides, statistics accumulated in float32 in different orders: a few ulps of the O(1) outputs.
  const double output_tolerance = 1e-5;
  // The weight and bias gradients are sums over 132 rows, whose rounding grows with the count.
  const double sum_tolerance = 1e-4;
  bool ok = true;

  ok &= report("layer_norm" + on, torch_ln::layer_norm(x, {D}, weight, bias, 1e-5),
               at::layer_norm(x, {D}, weight, bias, 1e-5), output_tolerance);
  ok &= report("rms_norm" + on, torch_ln::rms_norm(x, {D}, weight), at::rms_norm(x, {D}, weight), output_tolerance);

  const auto [y, mean, rstd] = torch_ln::layer_norm_fwd(x, {D}, weight, bias, 1e-5);
  const auto [y_ref, mean_ref, rstd_ref] = at::native_layer_norm(x, {D}, weight, bias, 1e-5);
  ok &= report("layer_norm_fwd mean" + on, mean, mean_ref, output_tolerance);
  ok &= report("layer_norm_fwd rstd" + on, rstd, rstd_ref, output_tolerance);
  const auto [dx, dweight, dbias] = torch_ln::layer_norm_bwd(dy, x, {D}, mean, rstd, weight, bias, {true, true, true});
  const auto [dx_ref, dweight_ref, dbias_ref] =
      at::native_layer_norm_backward(dy, x, {D}, mean_ref, rstd_ref, weight, bias, {true, true, true});
  ok &= report("layer_norm_bwd grad_input" + on, dx, dx_ref, output_tolerance);
  ok &= report("layer_norm_bwd grad_weight" + on, dweight, dweight_ref, sum_tolerance);
  ok &= report("layer_norm_bwd grad_bias" + on, dbias, dbias_ref, sum_tolerance);

  // RMSNorm's reference gradients: LibTorch's autograd through at::rms_norm.
  const auto [z, z_rstd] = torch_ln::rms_norm_fwd(x, {D}, weight, std::nullopt);
  const auto [dxr, dweightr] = torch_ln::rms_norm_bwd(dy, x, {D}, z_rstd, weight, {true, true});
  const auto x_leaf = x.detach().requires_grad_(), weight_leaf = weight.detach().requires_grad_();
  const auto grads = torch::autograd::grad({at::rms_norm(x_leaf, {D}, weight_leaf)}, {x_leaf, weight_leaf}, {dy});
  ok &= report("rms_norm_bwd grad_input" + on, dxr, grads[0], output_tolerance);
  ok &= report("rms_norm_bwd grad_weight" + on, dweightr, grads[1], sum_tolerance);

  // Training in C++: autograd through torch_ln::layer_norm and add_rms_norm against LibTorch's composites.
  const auto bias_leaf = bias.detach().requires_grad_();
  const std::vector<at::Tensor> leaves{x_leaf, weight_leaf, bias_leaf};
  const auto ours = torch::autograd::grad({torch_ln::layer_norm(x_leaf, {D}, weight_leaf, bias_leaf)}, leaves, {dy});
  const auto theirs = torch::autograd::grad({at::layer_norm(x_leaf, {D}, weight_leaf, bias_leaf)}, leaves, {dy});
  ok &= report("layer_norm autograd grad_input" + on, ours[0], theirs[0], output_tolerance);
  ok &= report("layer_norm autograd grad_weight" + on, ours[1], theirs[1], sum_tolerance);
  ok &= report("layer_norm autograd grad_bias" + on, ours[2], theirs[2], sum_tolerance);
  const auto residual = at::randn_like(x).requires_grad_();
  const auto [fused, fused_residual_out] = torch_ln::add_rms_norm(x_leaf, residual, {D}, weight_leaf);
  const auto h = x_leaf + residual;
  const std::vector<at::Tensor> add_leaves{x_leaf, residual, weight_leaf};
  const auto add_ours = torch::autograd::grad({fused, fused_residual_out}, add_leaves, {dy, dy});
  const auto add_theirs = torch::autograd::grad({at::rms_norm(h, {D}, weight_leaf), h}, add_leaves, {dy, dy});
  ok &= report("add_rms_norm autograd grad_input" + on, add_ours[0], add_theirs[0], output_tolerance);
  ok &= report("add_rms_norm autograd grad_residual" + on, add_ours[1], add_theirs[1], output_tolerance);
  ok &= report("add_rms_norm autograd grad_weight" + on, add_ours[2], add_theirs[2], sum_tolerance);

  // A quantized output (float8 e4m3, per-token scales), exactly as torch_ln.reference.quantize: each row's scale is
  // max |y| / 448 (at least 1 / (448 * 512)), q is y times its float32 reciprocal, saturated and cast.
  torch_ln::QuantOptions fp8;
  fp8.return_unquantized = true;
  const auto quant = torch_ln::add_rms_norm_quant(x, residual.detach(), {D}, fp8, weight);
  const auto y_rows = quant.y.to(at::kFloat);
  const auto scales = at::clamp_min(y_rows.abs().amax({-1}, true) / 448.0, 1.0 / (448.0 * 512.0));
  const auto q = at::clamp(y_rows * at::reciprocal(scales), -448.0, 448.0).to(at::kFloat8_e4m3fn);
  const auto y_plain =
      std::get<0>(torch_ln::add_rms_norm_fwd(x, residual.detach(), {D}, weight, std::nullopt, std::nullopt));
  ok &= report("add_rms_norm_quant y" + on, quant.y, y_plain, 0);
  ok &= report("add_rms_norm_quant scales" + on, quant.scale, scales, 0);
  ok &= report("add_rms_norm_quant q" + on, quant.q.to(at::kFloat), q.to(at::kFloat), 0);

  // A gated RMSNorm (CPU kernels only, so far): Mamba2's form, rms_norm(x * silu(gate)) in groups of 64, against
  // LibTorch's composite of it, and its three gradients against LibTorch's autograd of the composite.
  if (device.is_cpu()) {
    const int64_t G = 64, W = 3 * G;
    const auto gx = at::randn({132, W}, options).requires_grad_(), gate = at::randn({132, W}, options).requires_grad_();
    const auto gweight = weight.narrow(0, 0, W).detach().requires_grad_(), gdy = dy.reshape({-1}).narrow(0, 0, 132 * W);
    const auto [gated, gated_rstd] = torch_ln::gated_rms_norm_fwd(gx, gate, {W}, gweight, 1e-6, "before", "silu", G);
    const auto [dgx, dgate, dgweight] = torch_ln::gated_rms_norm_bwd(gdy.view({132, W}), gx, gate, {W}, gated_rstd,
                                                                     gweight, {true, true, true}, "before", "silu", G);
    const auto groups = (gx * at::silu(gate)).view({132, 3, G});
    const auto composite = (groups * at::rsqrt(groups.pow(2).mean(-1, true) + 1e-6)).view({132, W}) * gweight;
    const auto gated_grads = torch::autograd::grad({composite}, {gx, gate, gweight}, {gdy.view({132, W})});
    ok &= report("gated_rms_norm_fwd" + on, gated, composite, output_tolerance);
    ok &= report("gated_rms_norm_bwd grad_input" + on, dgx, gated_grads[0], output_tolerance);
    ok &= report("gated_rms_norm_bwd grad_gate" + on, dgate, gated_grads[1], output_tolerance);
    ok &= report("gated_rms_norm_bwd grad_weight" + on, dgweight, gated_grads[2], sum_tolerance);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool ok = check_on(at::kCPU);
  if (torch::cuda::is_available()) ok &= check_on(at::kCUDA);
  if (argc == 3) {
    const auto inputs = load_tensors(argv[1]);
    const auto &x = inputs.at(0), &weight = inputs.at(1), &bias = inputs.at(2);
    const auto shape = weight.sizes();
    save_tensors(argv[2], {torch_ln::layer_norm(x, shape, weight, bias, 1e-5), torch_ln::rms_norm(x, shape, weight)});
  }
  std::cout << (ok ? "all match" : "MISMATCH") << std::endl;
  return ok ? 0 : 1;
}
