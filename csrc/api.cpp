// The public C++ API (torch_ln/include/torch_ln/torch_ln.h). Each function calls its operator through
// the dispatcher, which picks the CPU or CUDA kernel and runs any autograd or autocast layer.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch_ln/torch_ln.h>

namespace torch_ln {

namespace {

// The schemas take SymInt[] normalized_shape; these are the C++ types the dispatcher calls them with.
using Shape = c10::SymIntArrayRef;
using OptTensor = std::optional<at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_operator(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

Tensor3 layer_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                       const OptTensor& bias, double eps, double weight_offset, bool memory_efficient) {
  static const auto op =
      find_operator<Tensor3(const at::Tensor&, Shape, const OptTensor&, const OptTensor&, double, double, bool)>(
          "torch_ln::layer_norm_fwd");
  return op.call(input, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps, weight_offset, memory_efficient);
}

Tensor2 gated_rms_norm_fwd(const at::Tensor& input, const OptTensor& gate, at::IntArrayRef normalized_shape,
                           const OptTensor& weight, std::optional<double> eps, std::string_view gate_position,
                           std::string_view activation, std::optional<int64_t> group_size, bool round_normalized) {
  static const auto op =
      find_operator<Tensor2(const at::Tensor&, const OptTensor&, Shape, const OptTensor&, std::optional<double>,
                            c10::string_view, c10::string_view, std::optional<int64_t>, bool)>(
          "torch_ln::gated_rms_norm_fwd");
  return op.call(input, gate, c10::fromIntArrayRefSlow(normalized_shape), weight, eps, gate_position, activation,
                 group_size, round_normalized);
}

Tensor3 gated_rms_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input, const OptTensor& gate,
                           at::IntArrayRef normalized_shape, const at::Tensor& rstd, const OptTensor& weight,
                           std::array<bool, 3> output_mask, std::string_view gate_position, std::string_view activation,
                           std::optional<int64_t> group_size, bool round_normalized) {
  static const auto op =
      find_operator<Tensor3(const at::Tensor&, const at::Tensor&, const OptTensor&, Shape, const at::Tensor&,
                            const OptTensor&, std::array<bool, 3>, c10::string_view, c10::string_view,
                            std::optional<int64_t>, bool)>("torch_ln::gated_rms_norm_bwd");
  return op.call(grad_out, input, gate, c10::fromIntArrayRefSlow(normalized_shape), rstd, weight, output_mask,
                 gate_position, activation, group_size, round_normalized);
}

Tensor3 layer_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
                       const at::Tensor& mean, const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias,
                       std::array<bool, 3> output_mask, double weight_offset, bool from_output) {
  static const auto op =
      find_operator<Tensor3(const at::Tensor&, const at::Tensor&, Shape, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, const OptTensor&, std::array<bool, 3>, double, bool)>(
          "torch_ln::layer_norm_bwd");
  return op.call(grad_out, input, c10::fromIntArrayRefSlow(normalized_shape), mean, rstd, weight, bias, output_mask,
                 weight_offset, from_output);
}

Tensor2 rms_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                     std::optional<double> eps, double weight_offset, bool round_normalized, bool memory_efficient) {
  static const auto op =
      find_operator<Tensor2(const at::Tensor&, Shape, const OptTensor&, std::optional<double>, double, bool, bool)>(
          "torch_ln::rms_norm_fwd");
  return op.call(input, c10::fromIntArrayRefSlow(normalized_shape), weight, eps, weight_offset, round_normalized,
                 memory_efficient);
}

Tensor2 rms_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
                     const at::Tensor& rstd, const OptTensor& weight, std::array<bool, 2> output_mask,
                     double weight_offset, bool round_normalized, bool from_output) {
  static const auto op =
      find_operator<Tensor2(const at::Tensor&, const at::Tensor&, Shape, const at::Tensor&, const OptTensor&,
                            std::array<bool, 2>, double, bool, bool)>("torch_ln::rms_norm_bwd");
  return op.call(grad_out, input, c10::fromIntArrayRefSlow(normalized_shape), rstd, weight, output_mask, weight_offset,
                 round_normalized, from_output);
}

using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using OptDtype = std::optional<at::ScalarType>;

Tensor4 add_layer_norm_fwd(const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
                           const OptTensor& weight, const OptTensor& bias, double eps, OptDtype residual_dtype,
                           double weight_offset) {
  static const auto op =
      find_operator<Tensor4(const at::Tensor&, const at::Tensor&, Shape, const OptTensor&, const OptTensor&, double,
                            OptDtype, double)>("torch_ln::add_layer_norm_fwd");
  return op.call(input, residual, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps, residual_dtype,
                 weight_offset);
}

Tensor3 add_layer_norm_bwd(const at::Tensor& grad_out, const OptTensor& grad_residual_out,
                           const at::Tensor& residual_out, at::IntArrayRef normalized_shape, const at::Tensor& mean,
                           const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias,
                           std::array<bool, 3> output_mask, double weight_offset) {
  static const auto op =
      find_operator<Tensor3(const at::Tensor&, const OptTensor&, const at::Tensor&, Shape, const at::Tensor&,
                            const at::Tensor&, const OptTensor&, const OptTensor&, std::array<bool, 3>, double)>(
          "torch_ln::add_layer_norm_bwd");
  return op.call(grad_out, grad_residual_out, residual_out, c10::fromIntArrayRefSlow(normalized_shape), mean, rstd,
                 weight, bias, output_mask, weight_offset);
}

Tensor3 add_rms_norm_fwd(const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
                         const OptTensor& weight, std::optional<double> eps, OptDtype residual_dtype,
                         double weight_offset, bool round_normalized) {
  static const auto op =
      find_operator<Tensor3(const at::Tensor&, const at::Tensor&, Shape, const OptTensor&, std::optional<double>,
                            OptDtype, double, bool)>("torch_ln::add_rms_norm_fwd");
  return op.call(input, residual, c10::fromIntArrayRefSlow(normalized_shape), weight, eps, residual_dtype,
                 weight_offset, round_normalized);
}

Tensor2 add_rms_norm_bwd(const at::Tensor& grad_out, const OptTensor& grad_residual_out, const at::Tensor& residual_out,
                         at::IntArrayRef normalized_shape, const at::Tensor& rstd, const OptTensor& weight,
                         std::array<bool, 2> output_mask, double weight_offset, bool round_normalized) {
  static const auto op =
      find_operator<Tensor2(const at::Tensor&, const OptTensor&, const at::Tensor&, Shape, const at::Tensor&,
                            const OptTensor&, std::array<bool, 2>, double, bool)>("torch_ln::add_rms_norm_bwd");
  return op.call(grad_out, grad_residual_out, residual_out, c10::fromIntArrayRefSlow(normalized_shape), rstd, weight,
                 output_mask, weight_offset, round_normalized);
}

// The quantized forms: the operators take QuantOptions' fields as arguments and return an empty tensor for a static
// scale, and y always (empty unless return_unquantized).

namespace {

using OptInt = std::optional<int64_t>;
using OptDouble = std::optional<double>;

QuantizedNorm quantized(const QuantOptions& quant, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& y,
                        const at::Tensor& residual_out = {}) {
  return {q, quant.scale.has_value() ? *quant.scale : scales, quant.return_unquantized ? y : at::Tensor(),
          residual_out};
}

}  // namespace

QuantizedNorm rms_norm_quant(const at::Tensor& input, at::IntArrayRef normalized_shape, const QuantOptions& quant,
                             const OptTensor& weight, std::optional<double> eps, double weight_offset,
                             bool round_normalized) {
  static const auto op =
      find_operator<Tensor3(const at::Tensor&, Shape, const OptTensor&, OptDouble, at::ScalarType, const OptTensor&,
                            OptInt, OptDouble, bool, bool, bool, double, bool)>("torch_ln::rms_norm_quant");
  const auto [q, scales, y] =
      op.call(input, c10::fromIntArrayRefSlow(normalized_shape), weight, eps, quant.out_dtype, quant.scale,
              quant.group_size, quant.scale_ub, quant.scale_ue8m0, quant.scales_column_major, quant.return_unquantized,
              weight_offset, round_normalized);
  return quantized(quant, q, scales, y);
}

QuantizedNorm layer_norm_quant(const at::Tensor& input, at::IntArrayRef normalized_shape, const QuantOptions& quant,
                               const OptTensor& weight, const OptTensor& bias, double eps, double weight_offset) {
  static const auto op =
      find_operator<Tensor3(const at::Tensor&, Shape, const OptTensor&, const OptTensor&, double, at::ScalarType,
                            const OptTensor&, OptInt, OptDouble, bool, bool, bool, double)>(
          "torch_ln::layer_norm_quant");
  const auto [q, scales, y] = op.call(input, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps,
                                      quant.out_dtype, quant.scale, quant.group_size, quant.scale_ub, quant.scale_ue8m0,
                                      quant.scales_column_major, quant.return_unquantized, weight_offset);
  return quantized(quant, q, scales, y);
}

QuantizedNorm add_rms_norm_quant(const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
                                 const QuantOptions& quant, const OptTensor& weight, std::optional<double> eps,
                                 OptDtype residual_dtype, double weight_offset, bool round_normalized) {
  static const auto op =
      find_operator<Tensor4(const at::Tensor&, const at::Tensor&, Shape, const OptTensor&, OptDouble, OptDtype,
                            at::ScalarType, const OptTensor&, OptInt, OptDouble, bool, bool, bool, double, bool)>(
          "torch_ln::add_rms_norm_quant");
  const auto [q, scales, y, residual_out] =
      op.call(input, residual, c10::fromIntArrayRefSlow(normalized_shape), weight, eps, residual_dtype, quant.out_dtype,
              quant.scale, quant.group_size, quant.scale_ub, quant.scale_ue8m0, quant.scales_column_major,
              quant.return_unquantized, weight_offset, round_normalized);
  return quantized(quant, q, scales, y, residual_out);
}

QuantizedNorm add_layer_norm_quant(const at::Tensor& input, const at::Tensor& residual,
                                   at::IntArrayRef normalized_shape, const QuantOptions& quant, const OptTensor& weight,
                                   const OptTensor& bias, double eps, OptDtype residual_dtype, double weight_offset) {
  static const auto op =
      find_operator<Tensor4(const at::Tensor&, const at::Tensor&, Shape, const OptTensor&, const OptTensor&, double,
                            OptDtype, at::ScalarType, const OptTensor&, OptInt, OptDouble, bool, bool, bool, double)>(
          "torch_ln::add_layer_norm_quant");
  const auto [q, scales, y, residual_out] =
      op.call(input, residual, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps, residual_dtype,
              quant.out_dtype, quant.scale, quant.group_size, quant.scale_ub, quant.scale_ue8m0,
              quant.scales_column_major, quant.return_unquantized, weight_offset);
  return quantized(quant, q, scales, y, residual_out);
}

// The differentiable entry points: the operators of csrc/autograd.cpp.

at::Tensor layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                      const OptTensor& bias, double eps, double weight_offset) {
  static const auto op =
      find_operator<at::Tensor(const at::Tensor&, at::IntArrayRef, const OptTensor&, const OptTensor&, double, double)>(
          "torch_ln::layer_norm");
  return op.call(input, normalized_shape, weight, bias, eps, weight_offset);
}

at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                    std::optional<double> eps, double weight_offset, bool round_normalized) {
  static const auto op = find_operator<at::Tensor(const at::Tensor&, at::IntArrayRef, const OptTensor&,
                                                  std::optional<double>, double, bool)>("torch_ln::rms_norm");
  return op.call(input, normalized_shape, weight, eps, weight_offset, round_normalized);
}

Tensor2 add_layer_norm(const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
                       const OptTensor& weight, const OptTensor& bias, double eps, OptDtype residual_dtype,
                       double weight_offset) {
  static const auto op =
      find_operator<Tensor2(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const OptTensor&, const OptTensor&,
                            double, OptDtype, double)>("torch_ln::add_layer_norm");
  return op.call(input, residual, normalized_shape, weight, bias, eps, residual_dtype, weight_offset);
}

Tensor2 add_rms_norm(const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
                     const OptTensor& weight, std::optional<double> eps, OptDtype residual_dtype,
                     double weight_offset, bool round_normalized) {
  static const auto op =
      find_operator<Tensor2(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const OptTensor&,
                            std::optional<double>, OptDtype, double, bool)>("torch_ln::add_rms_norm");
  return op.call(input, residual, normalized_shape, weight, eps, residual_dtype, weight_offset, round_normalized);
}

}  // namespace torch_ln
