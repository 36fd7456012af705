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

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias, double eps) {
  const RowShape s = check_forward_inputs("layer_norm", input, normalized_shape, weight, bias);
  const auto stat_opts = input.options().dtype(accumulation_dtype(input.scalar_type()));
  ForwardArgs a{input.contiguous(),
                contiguous_or_undefined(weight),
                contiguous_or_undefined(bias),
                eps,
                at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous)),
                at::empty({s.rows}, stat_opts),
                at::empty({s.rows}, stat_opts),
                s.rows,
                s.cols};
  if (s.rows > 0) Backend::kernels.forward(NormKind::LayerNorm, a);
  const auto stat_shape = statistics_shape(input, s.axis);
  return {a.y, a.mean.view(stat_shape), a.rstd.view(stat_shape)};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                              at::IntArrayRef normalized_shape, const at::Tensor& mean,
                                                              const at::Tensor& rstd,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias,
                                                              std::array<bool, 3> output_mask) {
  const RowShape s = check_forward_inputs("layer_norm_backward", input, normalized_shape, weight, bias);
  check_backward_inputs("layer_norm_backward", grad_out, input, s, rstd, mean);
  BackwardArgs a{grad_out.contiguous(),
                 input.contiguous(),
                 mean.contiguous().view({s.rows}),
                 rstd.contiguous().view({s.rows}),
                 contiguous_or_undefined(weight),
                 {},
                 {},
                 {},
                 s.rows,
                 s.cols};
  if (output_mask[0]) a.dx = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  const bool want_dweight = output_mask[1] && weight.has_value();
  const bool want_dbias = output_mask[2] && bias.has_value();
  if (want_dweight) a.dweight = at::empty_like(a.weight);
  if (want_dbias) a.dbias = at::empty({s.cols}, bias->options().memory_format(at::MemoryFormat::Contiguous));
  if (s.rows > 0) {
    Backend::kernels.backward(NormKind::LayerNorm, a);
  } else {  // a sum over no rows
    if (want_dweight) a.dweight.zero_();
    if (want_dbias) a.dbias.zero_();
  }
  return {a.dx.defined() ? a.dx : unrequested_grad(input),
          want_dweight ? a.dweight.view(weight->sizes()) : unrequested_grad(input),
          want_dbias ? a.dbias.view(bias->sizes()) : unrequested_grad(input)};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  const RowShape s = check_forward_inputs("rms_norm", input, normalized_shape, weight, std::nullopt);
  const auto stat_opts = input.options().dtype(accumulation_dtype(input.scalar_type()));
  ForwardArgs a{input.contiguous(),
                contiguous_or_undefined(weight),
                {},
                eps.value_or(default_rms_eps(input.scalar_type())),
                at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous)),
                {},
                at::empty({s.rows}, stat_opts),
                s.rows,
                s.cols};
  if (s.rows > 0) Backend::kernels.forward(NormKind::RMSNorm, a);
  return {a.y, a.rstd.view(statistics_shape(input, s.axis))};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                const std::optional<at::Tensor>& weight,
                                                std::array<bool, 2> output_mask) {
  const RowShape s = check_forward_inputs("rms_norm_backward", input, normalized_shape, weight, std::nullopt);
  check_backward_inputs("rms_norm_backward", grad_out, input, s, rstd, std::nullopt);
  BackwardArgs a{grad_out.contiguous(),
                 input.contiguous(),
                 {},
                 rstd.contiguous().view({s.rows}),
                 contiguous_or_undefined(weight),
                 {},
                 {},
                 {},
                 s.rows,
                 s.cols};
  if (output_mask[0]) a.dx = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  const bool want_dweight = output_mask[1] && weight.has_value();
  if (want_dweight) a.dweight = at::empty_like(a.weight);
  if (s.rows > 0) {
    Backend::kernels.backward(NormKind::RMSNorm, a);
  } else if (want_dweight) {  // a sum over no rows
    a.dweight.zero_();
  }
  return {a.dx.defined() ? a.dx : unrequested_grad(input),
          want_dweight ? a.dweight.view(weight->sizes()) : unrequested_grad(input)};
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
