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

// The statistics hold `stats_per_row` values a row (a grouped gated norm's groups).
void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& input, const RowShape& shape,
                           const at::Tensor& rstd, const std::optional<at::Tensor>& mean, int64_t stats_per_row = 1);

// A weight offset needs a weight to offset.
void check_rounding(const char* op, const RoundingOptions& rounding, const std::optional<at::Tensor>& weight);
// The dtype of the residual stream (residual_out) of a fused residual add: `dtype` (the argument `name`), or the
// dtype of `like` (the argument `like_name`) when none is given. It must be like's, or float32 when like is half or
// bfloat16.
at::ScalarType residual_stream_dtype(const char* op, const char* name, std::optional<at::ScalarType> dtype,
                                     const char* like_name, const at::Tensor& like);

// `tensor` (named `name`) must have the shape and device of `like`, and one of the dtypes `dtype` or `other_dtype`.
void check_like(const char* op, const char* name, const at::Tensor& tensor, const char* like_name,
                const at::Tensor& like, at::ScalarType dtype, at::ScalarType other_dtype);

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
// An output a call did not produce, for the same reason: `t` where defined, else an empty tensor like `like`.
at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like);

// The rows of `input` (normalized from dimension `axis` on, `cols` elements a row) as the kernels read them: the
// input itself where each row's elements are contiguous and its leading dimensions, flattened, are at most two
// strides deep (a column slice, a chunk, the heads of a packed QKV projection, transposed leading dimensions, a
// broadcast row), with where each row starts; any other layout as a contiguous copy. With `groups` > 1 (a grouped gated
// norm: the CUDA kernels read its groups as rows a level below the input's, csrc/cuda/launch_common.h kernel_rows),
// one level at most, 32-bit row indices for the groups' rows where the rows are not contiguous.
std::pair<at::Tensor, RowStrides> strided_rows(const at::Tensor& input, int64_t axis, int64_t cols, int64_t groups = 1);

// memory_efficient's backward recovers xhat = y / (weight + offset): a norm with a bias is refused (y - bias cancels,
// see norm_ops.cpp).
void check_memory_efficient(const char* op, const std::optional<at::Tensor>& bias);
// 1 / (weight + offset) in `acc` ([D] contiguous; undefined without a weight), by which the backward multiplies y
// (no division in the kernels: float64's slow-path call spilled a register kernel at its cap). Every weight + offset
// must be nonzero: checked here, on the host (on CUDA, a reduction over the weight and one host synchronization), or,
// where `capturing` (a CUDA graph records the call, which forbids synchronizing), by an assertion on the device.
at::Tensor inverse_weight(const char* op, const std::optional<at::Tensor>& weight, const RoundingOptions& rounding,
                          at::ScalarType acc, bool capturing);

// The forward's optional residual add: the residual and the dtype of residual_out.
struct ResidualAdd {
  const at::Tensor& residual;
  std::optional<at::ScalarType> residual_dtype;
};

// The *_quant operators' request: the output format and how its scales come (QuantSpec).
struct QuantRequest {
  at::ScalarType out_dtype;
  const std::optional<at::Tensor>& scale;  // static: the one given scale
  std::optional<int64_t> group_size;       // dynamic per group; neither: dynamic per token
  std::optional<double> scale_ub;
  bool scale_ue8m0, scales_column_major, return_unquantized;
};

// Checks a request against the input (named arguments in the errors) and allocates q and, dynamic, the scales (in
// the input's leading shape, then one per group: [..., D / group], in the layout asked for).
QuantArgs prepare_quant(const char* op, const QuantRequest& request, const at::Tensor& input, int64_t axis,
                        int64_t rows, int64_t cols);

// Checks a gated RMSNorm's gate (`gate` like the input, or None: the plain norm, grouped or not), gate_position
// ("before" / "after"), activation ("silu" / "sigmoid") and group_size (a positive divisor of the row length `cols`).
GateArgs prepare_gate(const char* op, const std::optional<at::Tensor>& gate, const at::Tensor& input, int64_t cols,
                      c10::string_view gate_position, c10::string_view activation, std::optional<int64_t> group_size);

// Statistics per row: one, or a grouped gated norm's D / group_size.
inline int64_t stats_per_row(const GateArgs& gate, int64_t cols) {
  return gate.group_size > 0 ? cols / gate.group_size : 1;
}

// The statistics' shape: aten's (statistics_shape), or for a grouped norm the batch dimensions, then the groups.
std::vector<int64_t> statistics_shape(const at::Tensor& input, int64_t axis, int64_t groups);

// What one forward call returns: the statistics in aten's shape (mean undefined for RMSNorm), residual_out with a
// residual add, q and the scales with a quantized output (the scales undefined for a static one), y unless only
// the quantized output was asked for.
struct ForwardOutputs {
  at::Tensor y, residual_out, mean, rstd, q, scales;
};

// One forward call of either kind, with or without a residual add, with or without a quantized output: checks,
// allocates, runs the kernels.
template <typename Backend>
ForwardOutputs run_forward(NormKind kind, const char* op, const at::Tensor& input, at::IntArrayRef normalized_shape,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
                           RoundingOptions rounding, const std::optional<ResidualAdd>& add = std::nullopt,
                           const QuantRequest* quant = nullptr, const GateArgs& gate = {}) {
  const RowShape s = check_forward_inputs(op, input, normalized_shape, weight, bias);
  check_rounding(op, rounding, weight);
  at::Tensor residual, residual_out;
  if (add.has_value()) {
    const auto stream = residual_stream_dtype(op, "residual_dtype", add->residual_dtype, "input", input);
    check_like(op, "residual", add->residual, "input", input, input.scalar_type(), stream);
    // A residual of the input's dtype under a wider stream is converted first: the kernels read one stream dtype.
    residual = add->residual.to(stream).contiguous();
    residual_out = Backend::kernels.empty_rows(input.sizes(), input.options().dtype(stream));
  }
  QuantArgs quantized;
  if (quant != nullptr) quantized = prepare_quant(op, *quant, input, s.axis, s.rows, s.cols);
  // The fused add reads x beside the contiguous residual: contiguous too.
  const auto [x, x_rows] = add.has_value() ? std::pair{input.contiguous(), RowStrides{s.cols}}
                                           : strided_rows(input, s.axis, s.cols, stats_per_row(gate, s.cols));
  const auto stat_opts = input.options().dtype(accumulation_dtype(input.scalar_type()));
  const bool want_y = quant == nullptr || quant->return_unquantized;
  const int64_t groups = stats_per_row(gate, s.cols);
  ForwardArgs a{x,
                contiguous_or_undefined(weight),
                contiguous_or_undefined(bias),
                eps,
                want_y ? Backend::kernels.empty_rows(input.sizes(), input.options()) : at::Tensor(),
                kind == NormKind::LayerNorm ? at::empty({s.rows}, stat_opts) : at::Tensor(),
                at::empty({s.rows * groups}, stat_opts),
                s.rows,
                s.cols,
                residual,
                residual_out,
                rounding,
                x_rows,
                quantized,
                gate};
  if (s.rows > 0) Backend::kernels.forward(kind, a);
  const auto stat_shape = statistics_shape(input, s.axis, groups);
  return {a.y,
          residual_out,
          a.mean.defined() ? a.mean.view(stat_shape) : at::Tensor(),
          a.rstd.view(stat_shape),
          quantized.q,
          quantized.spec.dynamic ? quantized.scales : at::Tensor()};
}

// What one backward call returns: each gradient not requested (or without its tensor) an empty tensor.
struct BackwardOutputs {
  at::Tensor dx, dweight, dbias, dgate;
};

// One backward call of either kind. After a residual add (`fused`), `input` is residual_out, which may have a wider
// dtype than grad_out, and grad_residual_out, if any, is added to dx. A gated norm's gate comes as the forward's,
// its gradient computed when `want_dgate`.
template <typename Backend>
BackwardOutputs run_backward(NormKind kind, const char* op, const at::Tensor& grad_out, const at::Tensor& input,
                             at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& mean,
                             const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                             const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask,
                             RoundingOptions rounding, bool fused = false,
                             const std::optional<at::Tensor>& grad_residual_out = std::nullopt,
                             bool from_output = false, const GateArgs& gate = {}, bool want_dgate = false) {
  // The parameters' dtypes are checked against the norm's output dtype, which is grad_out's.
  const RowShape s = check_forward_inputs(op, fused ? grad_out : input, normalized_shape, weight, bias);
  check_rounding(op, rounding, weight);
  if (fused) {
    const auto stream = residual_stream_dtype(op, "residual_out.dtype", input.scalar_type(), "grad_out", grad_out);
    check_like(op, "residual_out", input, "grad_out", grad_out, stream, stream);
    check_backward_inputs(op, grad_out, grad_out, s, rstd, mean);
    if (grad_residual_out.has_value()) {
      check_like(op, "grad_residual_out", *grad_residual_out, "residual_out", input, stream, stream);
    }
  } else {
    check_backward_inputs(op, grad_out, input, s, rstd, mean, stats_per_row(gate, s.cols));
  }
  const auto [x, x_rows] = fused ? std::pair{input.contiguous(), RowStrides{s.cols}}
                                 : strided_rows(input, s.axis, s.cols, stats_per_row(gate, s.cols));
  BackwardArgs a{grad_out.contiguous(),
                 x,
                 mean.has_value() ? mean->contiguous().view({s.rows}) : at::Tensor(),
                 rstd.contiguous().view({s.rows * stats_per_row(gate, s.cols)}),
                 contiguous_or_undefined(weight),
                 {},
                 {},
                 {},
                 s.rows,
                 s.cols,
                 output_mask[0] ? contiguous_or_undefined(grad_residual_out) : at::Tensor(),
                 rounding,
                 x_rows};
  a.gate = gate;
  if (want_dgate && gate.z.defined()) a.dgate = Backend::kernels.empty_rows(input.sizes(), input.options());
  if (from_output) {
    check_memory_efficient(op, bias);
    a.from_output = true;
    a.inverse_weight = inverse_weight(op, weight, rounding, a.rstd.scalar_type(),
                                      weight.has_value() && Backend::kernels.capturing(*weight));
  }
  if (output_mask[0]) a.dx = Backend::kernels.empty_rows(input.sizes(), input.options());
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
          want_dbias ? a.dbias.view(bias->sizes()) : unrequested_grad(input),
          a.dgate.defined() ? a.dgate : unrequested_grad(input)};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                              const std::optional<at::Tensor>& weight,
                                                              const std::optional<at::Tensor>& bias, double eps,
                                                              double weight_offset, bool memory_efficient) {
  if (memory_efficient) check_memory_efficient("layer_norm", bias);
  const auto out = run_forward<Backend>(NormKind::LayerNorm, "layer_norm", input, normalized_shape, weight, bias, eps,
                                        {weight_offset, false});
  return {out.y, out.mean, out.rstd};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape, const at::Tensor& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> output_mask, double weight_offset, bool from_output) {
  const auto g =
      run_backward<Backend>(NormKind::LayerNorm, "layer_norm_backward", grad_out, input, normalized_shape, mean, rstd,
                            weight, bias, output_mask, {weight_offset, false}, false, std::nullopt, from_output);
  return {g.dx, g.dweight, g.dbias};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                const std::optional<at::Tensor>& weight, std::optional<double> eps,
                                                double weight_offset, bool round_normalized,
                                                bool /*memory_efficient*/) {
  const auto out =
      run_forward<Backend>(NormKind::RMSNorm, "rms_norm", input, normalized_shape, weight, std::nullopt,
                           eps.value_or(default_rms_eps(input.scalar_type())), {weight_offset, round_normalized});
  return {out.y, out.rstd};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                const std::optional<at::Tensor>& weight,
                                                std::array<bool, 2> output_mask, double weight_offset,
                                                bool round_normalized, bool from_output) {
  const auto grads =
      run_backward<Backend>(NormKind::RMSNorm, "rms_norm_backward", grad_out, input, normalized_shape, std::nullopt,
                            rstd, weight, std::nullopt, {output_mask[0], output_mask[1], false},
                            {weight_offset, round_normalized}, false, std::nullopt, from_output);
  return {grads.dx, grads.dweight};
}

// The fused residual add + norm: (y, residual_out, mean, rstd) and (d residual_out, dweight, dbias), where
// d residual_out (the gradient of x and of residual) includes grad_residual_out.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    std::optional<at::ScalarType> residual_dtype, double weight_offset) {
  const auto out = run_forward<Backend>(NormKind::LayerNorm, "add_layer_norm", input, normalized_shape, weight, bias,
                                        eps, {weight_offset, false}, ResidualAdd{residual, residual_dtype});
  return {out.y, out.residual_out, out.mean, out.rstd};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out, const at::Tensor& residual_out,
    at::IntArrayRef normalized_shape, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask,
    double weight_offset) {
  const auto g =
      run_backward<Backend>(NormKind::LayerNorm, "add_layer_norm_backward", grad_out, residual_out, normalized_shape,
                            mean, rstd, weight, bias, output_mask, {weight_offset, false}, true, grad_residual_out);
  return {g.dx, g.dweight, g.dbias};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_fwd(const at::Tensor& input, const at::Tensor& residual,
                                                                at::IntArrayRef normalized_shape,
                                                                const std::optional<at::Tensor>& weight,
                                                                std::optional<double> eps,
                                                                std::optional<at::ScalarType> residual_dtype,
                                                                double weight_offset, bool round_normalized) {
  const auto out = run_forward<Backend>(NormKind::RMSNorm, "add_rms_norm", input, normalized_shape, weight,
                                        std::nullopt, eps.value_or(default_rms_eps(input.scalar_type())),
                                        {weight_offset, round_normalized}, ResidualAdd{residual, residual_dtype});
  return {out.y, out.residual_out, out.rstd};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_bwd(const at::Tensor& grad_out,
                                                    const std::optional<at::Tensor>& grad_residual_out,
                                                    const at::Tensor& residual_out, at::IntArrayRef normalized_shape,
                                                    const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                                                    std::array<bool, 2> output_mask, double weight_offset,
                                                    bool round_normalized) {
  const auto grads =
      run_backward<Backend>(NormKind::RMSNorm, "add_rms_norm_backward", grad_out, residual_out, normalized_shape,
                            std::nullopt, rstd, weight, std::nullopt, {output_mask[0], output_mask[1], false},
                            {weight_offset, round_normalized}, true, grad_residual_out);
  return {grads.dx, grads.dweight};
}

// The quantized forms (inference only): (q, scales, y) and, after a residual add, residual_out; the scales are an
// empty tensor for a static scale (the Python layer returns the given one), y one unless return_unquantized.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_quant(
    const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    std::optional<double> eps, at::ScalarType out_dtype, const std::optional<at::Tensor>& scale,
    std::optional<int64_t> group_size, std::optional<double> scale_ub, bool scale_ue8m0, bool scales_column_major,
    bool return_unquantized, double weight_offset, bool round_normalized) {
  const QuantRequest quant{out_dtype,         scale, group_size, scale_ub, scale_ue8m0, scales_column_major,
                           return_unquantized};
  const auto out = run_forward<Backend>(NormKind::RMSNorm, "rms_norm_quant", input, normalized_shape, weight,
                                        std::nullopt, eps.value_or(default_rms_eps(input.scalar_type())),
                                        {weight_offset, round_normalized}, std::nullopt, &quant);
  return {out.q, or_empty(out.scales, input), or_empty(out.y, input)};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_quant(
    const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, at::ScalarType out_dtype, const std::optional<at::Tensor>& scale,
    std::optional<int64_t> group_size, std::optional<double> scale_ub, bool scale_ue8m0, bool scales_column_major,
    bool return_unquantized, double weight_offset) {
  const QuantRequest quant{out_dtype,         scale, group_size, scale_ub, scale_ue8m0, scales_column_major,
                           return_unquantized};
  const auto out = run_forward<Backend>(NormKind::LayerNorm, "layer_norm_quant", input, normalized_shape, weight, bias,
                                        eps, {weight_offset, false}, std::nullopt, &quant);
  return {out.q, or_empty(out.scales, input), or_empty(out.y, input)};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_rms_norm_quant(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps, std::optional<at::ScalarType> residual_dtype,
    at::ScalarType out_dtype, const std::optional<at::Tensor>& scale, std::optional<int64_t> group_size,
    std::optional<double> scale_ub, bool scale_ue8m0, bool scales_column_major, bool return_unquantized,
    double weight_offset, bool round_normalized) {
  const QuantRequest quant{out_dtype,         scale, group_size, scale_ub, scale_ue8m0, scales_column_major,
                           return_unquantized};
  const auto out =
      run_forward<Backend>(NormKind::RMSNorm, "add_rms_norm_quant", input, normalized_shape, weight, std::nullopt,
                           eps.value_or(default_rms_eps(input.scalar_type())), {weight_offset, round_normalized},
                           ResidualAdd{residual, residual_dtype}, &quant);
  return {out.q, or_empty(out.scales, input), or_empty(out.y, input), out.residual_out};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_quant(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    std::optional<at::ScalarType> residual_dtype, at::ScalarType out_dtype, const std::optional<at::Tensor>& scale,
    std::optional<int64_t> group_size, std::optional<double> scale_ub, bool scale_ue8m0, bool scales_column_major,
    bool return_unquantized, double weight_offset) {
  const QuantRequest quant{out_dtype,         scale, group_size, scale_ub, scale_ue8m0, scales_column_major,
                           return_unquantized};
  const auto out =
      run_forward<Backend>(NormKind::LayerNorm, "add_layer_norm_quant", input, normalized_shape, weight, bias, eps,
                           {weight_offset, false}, ResidualAdd{residual, residual_dtype}, &quant);
  return {out.q, or_empty(out.scales, input), or_empty(out.y, input), out.residual_out};
}

// The gated RMSNorm (GateArgs): (y, rstd) and (dx, dgate, dweight); rstd holds a value per row and group. The
// rounding options are rms_norm's less the offset (no gated class adds one): round_normalized rounds the normalized
// value to the input's dtype before the weight multiply, and with a gate after, that product too when the weight
// has the input's dtype (Qwen3-Next's `weight * x.to(dtype)`, then times the float32 gate).
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> gated_rms_norm_fwd(const at::Tensor& input, const std::optional<at::Tensor>& gate,
                                                      at::IntArrayRef normalized_shape,
                                                      const std::optional<at::Tensor>& weight,
                                                      std::optional<double> eps, c10::string_view gate_position,
                                                      c10::string_view activation, std::optional<int64_t> group_size,
                                                      bool round_normalized) {
  constexpr const char* op = "gated_rms_norm";
  const RowShape s = check_forward_inputs(op, input, normalized_shape, weight, std::nullopt);
  const GateArgs g = prepare_gate(op, gate, input, s.cols, gate_position, activation, group_size);
  const auto out = run_forward<Backend>(NormKind::RMSNorm, op, input, normalized_shape, weight, std::nullopt,
                                        eps.value_or(default_rms_eps(input.scalar_type())), {0, round_normalized},
                                        std::nullopt, nullptr, g);
  return {out.y, out.rstd};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rms_norm_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& gate,
    at::IntArrayRef normalized_shape, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    std::array<bool, 3> output_mask, c10::string_view gate_position, c10::string_view activation,
    std::optional<int64_t> group_size, bool round_normalized) {
  constexpr const char* op = "gated_rms_norm_backward";
  const RowShape s = check_forward_inputs(op, input, normalized_shape, weight, std::nullopt);
  const GateArgs g = prepare_gate(op, gate, input, s.cols, gate_position, activation, group_size);
  const auto grads = run_backward<Backend>(NormKind::RMSNorm, op, grad_out, input, normalized_shape, std::nullopt, rstd,
                                           weight, std::nullopt, {output_mask[0], output_mask[2], false},
                                           {0, round_normalized}, false, std::nullopt, false, g, output_mask[1]);
  return {grads.dx, grads.dgate, grads.dweight};
}

// Registers the operators of one backend under `m` (a TORCH_LIBRARY_IMPL
// block for the backend's dispatch key).
template <typename Backend>
void register_norm_ops(torch::Library& m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd<Backend>);
  m.impl("layer_norm_bwd", &layer_norm_bwd<Backend>);
  m.impl("rms_norm_fwd", &rms_norm_fwd<Backend>);
  m.impl("rms_norm_bwd", &rms_norm_bwd<Backend>);
  m.impl("add_layer_norm_fwd", &add_layer_norm_fwd<Backend>);
  m.impl("add_layer_norm_bwd", &add_layer_norm_bwd<Backend>);
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd<Backend>);
  m.impl("add_rms_norm_bwd", &add_rms_norm_bwd<Backend>);
  m.impl("rms_norm_quant", &rms_norm_quant<Backend>);
  m.impl("layer_norm_quant", &layer_norm_quant<Backend>);
  m.impl("add_rms_norm_quant", &add_rms_norm_quant<Backend>);
  m.impl("add_layer_norm_quant", &add_layer_norm_quant<Backend>);
}

// The gated RMSNorm: the CPU kernels' and the CUDA kernels' GATED instances.
template <typename Backend>
void register_gated_norm_ops(torch::Library& m) {
  m.impl("gated_rms_norm_fwd", &gated_rms_norm_fwd<Backend>);
  m.impl("gated_rms_norm_bwd", &gated_rms_norm_bwd<Backend>);
}

}  // namespace torch_ln
