// The torch_ln operators, written once over a kernel backend. Each backend
// (csrc/cpu, csrc/cuda, the emulated CUDA test build) instantiates
// register_norm_ops<Backend> with a type holding its NormKernels.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <tuple>
#include <vector>

#include "norm.h"

namespace torch_ln {

// The validated shape of a call: M rows of D elements; `axis` is the first
// normalized dimension of the input.
struct RowShape {
  int64_t rows, cols, axis;
};

RowShape check_forward_inputs(const char* op, const at::Tensor& input, at::IntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias);

void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& input, const RowShape& shape,
                           const at::Tensor& rstd, const std::optional<at::Tensor>& mean);

// A weight offset needs a weight to offset.
void check_rounding(const char* op, const RoundingOptions& rounding, const std::optional<at::Tensor>& weight);

// float32 for float32/float16/bfloat16 input, float64 for float64 input.
at::ScalarType accumulation_dtype(at::ScalarType input);

// The statistics' shape, as aten's: the batch dimensions, then a 1 for each
// normalized dimension.
std::vector<int64_t> statistics_shape(const at::Tensor& input, int64_t axis);

// The epsilon RMSNorm uses when none is given, as torch does: the machine
// epsilon of the accumulation dtype (float32's for half and bfloat16 input).
double default_rms_eps(at::ScalarType input);

// A defined optional tensor made contiguous, or an undefined tensor.
at::Tensor contiguous_or_undefined(const std::optional<at::Tensor>& t);

// Gradients nobody asked for come back as empty tensors (custom operators
// cannot return None); the Python layer maps them to None.
at::Tensor unrequested_grad(const at::Tensor& like);

// One forward call of either kind: checks, allocates, runs the kernels. Returns (y, mean, rstd) with the
// statistics in aten's shape; mean is undefined for RMSNorm.
template <typename Backend>
std::array<at::Tensor, 3> run_forward(NormKind kind, const char* op, const at::Tensor& input,
                                      at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, double eps,
                                      RoundingOptions rounding = {}) {
  const RowShape s = check_forward_inputs(op, input, normalized_shape, weight, bias);
  check_rounding(op, rounding, weight);
  const auto stat_opts = input.options().dtype(accumulation_dtype(input.scalar_type()));
  ForwardArgs a{input.contiguous(),
                contiguous_or_undefined(weight),
                contiguous_or_undefined(bias),
                eps,
                at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous)),
                kind == NormKind::LayerNorm ? at::empty({s.rows}, stat_opts) : at::Tensor(),
                at::empty({s.rows}, stat_opts),
                s.rows,
                s.cols,
                rounding};
  if (s.rows > 0) Backend::kernels.forward(kind, a);
  const auto stat_shape = statistics_shape(input, s.axis);
  return {a.y, a.mean.defined() ? a.mean.view(stat_shape) : at::Tensor(), a.rstd.view(stat_shape)};
}

// One backward call of either kind. Returns (dx, dweight, dbias); each one not requested (or without its
// parameter) is an empty tensor.
template <typename Backend>
std::array<at::Tensor, 3> run_backward(NormKind kind, const char* op, const at::Tensor& grad_out,
                                       const at::Tensor& input, at::IntArrayRef normalized_shape,
                                       const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                       const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                       std::array<bool, 3> output_mask, RoundingOptions rounding = {}) {
  const RowShape s = check_forward_inputs(op, input, normalized_shape, weight, bias);
  check_backward_inputs(op, grad_out, input, s, rstd, mean);
  check_rounding(op, rounding, weight);
  BackwardArgs a{grad_out.contiguous(),
                 input.contiguous(),
                 mean.has_value() ? mean->contiguous().view({s.rows}) : at::Tensor(),
                 rstd.contiguous().view({s.rows}),
                 contiguous_or_undefined(weight),
                 {},
                 {},
                 {},
                 s.rows,
                 s.cols,
                 rounding};
  if (output_mask[0]) a.dx = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  const bool want_dweight = output_mask[1] && weight.has_value();
  const bool want_dbias = output_mask[2] && bias.has_value();
  if (want_dweight) a.dweight = at::empty_like(a.weight);
  if (want_dbias) a.dbias = at::empty({s.cols}, bias->options().memory_format(at::MemoryFormat::Contiguous));
  if (s.rows > 0) {
    Backend::kernels.backward(kind, a);
  } else {  // a sum over no rows
    if (want_dweight) a.dweight.zero_();
    if (want_dbias) a.dbias.zero_();
  }
  return {a.dx.defined() ? a.dx : unrequested_grad(input),
          want_dweight ? a.dweight.view(weight->sizes()) : unrequested_grad(input),
          want_dbias ? a.dbias.view(bias->sizes()) : unrequested_grad(input)};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias, double eps) {
  const auto [y, mean, rstd] =
      run_forward<Backend>(NormKind::LayerNorm, "layer_norm", input, normalized_shape, weight, bias, eps);
  return {y, mean, rstd};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                              at::IntArrayRef normalized_shape, const at::Tensor& mean,
                                                              const at::Tensor& rstd,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias,
                                                              std::array<bool, 3> output_mask) {
  const auto [dx, dweight, dbias] = run_backward<Backend>(NormKind::LayerNorm, "layer_norm_backward", grad_out, input,
                                                          normalized_shape, mean, rstd, weight, bias, output_mask);
  return {dx, dweight, dbias};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                const std::optional<at::Tensor>& weight, std::optional<double> eps,
                                                double weight_offset, bool round_normalized) {
  const auto out =
      run_forward<Backend>(NormKind::RMSNorm, "rms_norm", input, normalized_shape, weight, std::nullopt,
                           eps.value_or(default_rms_eps(input.scalar_type())), {weight_offset, round_normalized});
  return {out[0], out[2]};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                const std::optional<at::Tensor>& weight,
                                                std::array<bool, 2> output_mask, double weight_offset,
                                                bool round_normalized) {
  const auto grads = run_backward<Backend>(NormKind::RMSNorm, "rms_norm_backward", grad_out, input, normalized_shape,
                                           std::nullopt, rstd, weight, std::nullopt,
                                           {output_mask[0], output_mask[1], false}, {weight_offset, round_normalized});
  return {grads[0], grads[1]};
}

// Registers the four operators of one backend under `m` (a TORCH_LIBRARY_IMPL
// block for the backend's dispatch key).
template <typename Backend>
void register_norm_ops(torch::Library& m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd<Backend>);
  m.impl("layer_norm_bwd", &layer_norm_bwd<Backend>);
  m.impl("rms_norm_fwd", &rms_norm_fwd<Backend>);
  m.impl("rms_norm_bwd", &rms_norm_bwd<Backend>);
}

}  // namespace torch_ln
