// Operator schemas (defined once, here) and the argument checks every backend
// shares.
#include "norm_ops.h"

#include <c10/util/irange.h>

#include <limits>
#include <sstream>

namespace torch_ln {

namespace {

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// weight and bias must have the input's dtype, or float32 with a half or
// bfloat16 input (mixed precision).
void check_parameter(const char* op, const char* name, const at::Tensor& p, const at::Tensor& input,
                     at::IntArrayRef normalized_shape) {
  TORCH_CHECK_VALUE(p.sizes() == normalized_shape, "torch_ln.", op, ": expected ", name,
                    " to have shape normalized_shape=", normalized_shape, ", but got ", name, ".shape=", p.sizes());
  const bool reduced = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE(p.scalar_type() == input.scalar_type() || (reduced && p.scalar_type() == at::kFloat), "torch_ln.",
                   op, ": expected ", name, " to have the input's dtype (", input.scalar_type(), ")",
                   reduced ? " or float32" : "", ", but got ", name, ".dtype=", p.scalar_type());
  TORCH_CHECK_VALUE(p.device() == input.device(), "torch_ln.", op, ": expected ", name, " on the input's device (",
                    input.device(), "), but got ", name, ".device=", p.device());
}

}  // namespace

RowShape check_forward_inputs(const char* op, const at::Tensor& input, at::IntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_TYPE(
      is_supported_dtype(input.scalar_type()), "torch_ln.", op,
      ": expected input of dtype float32, float64, float16 or bfloat16, but got input.dtype=", input.scalar_type());
  const int64_t norm_ndim = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK_VALUE(
      norm_ndim >= 1, "torch_ln.", op,
      ": expected normalized_shape to have at least one dimension, but got normalized_shape=", normalized_shape);
  for (const auto d : normalized_shape) {
    TORCH_CHECK_VALUE(d > 0, "torch_ln.", op, ": expected every entry of normalized_shape to be positive, but got ",
                      "normalized_shape=", normalized_shape);
  }
  const int64_t axis = input.dim() - norm_ndim;
  TORCH_CHECK_VALUE(axis >= 0 && input.sizes().slice(axis) == normalized_shape, "torch_ln.", op,
                    ": expected normalized_shape to equal the trailing dimensions of input, but got normalized_shape=",
                    normalized_shape, " and input.shape=", input.sizes());
  if (weight.has_value()) check_parameter(op, "weight", *weight, input, normalized_shape);
  if (bias.has_value()) check_parameter(op, "bias", *bias, input, normalized_shape);
  if (weight.has_value() && bias.has_value()) {
    TORCH_CHECK_TYPE(weight->scalar_type() == bias->scalar_type(), "torch_ln.", op,
                     ": expected weight and bias to have the same dtype, but got weight.dtype=", weight->scalar_type(),
                     " and bias.dtype=", bias->scalar_type());
  }
  int64_t cols = 1;
  for (const auto d : normalized_shape) cols *= d;
  return {input.numel() / cols, cols, axis};
}

void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& input, const RowShape& shape,
                           const at::Tensor& rstd, const std::optional<at::Tensor>& mean, int64_t stats_per_row) {
  TORCH_CHECK_VALUE(grad_out.sizes() == input.sizes(), "torch_ln.", op,
                    ": expected grad_out to have the input's shape ", input.sizes(),
                    ", but got grad_out.shape=", grad_out.sizes());
  TORCH_CHECK_TYPE(grad_out.scalar_type() == input.scalar_type(), "torch_ln.", op,
                   ": expected grad_out to have the input's dtype (", input.scalar_type(),
                   "), but got grad_out.dtype=", grad_out.scalar_type());
  TORCH_CHECK_VALUE(grad_out.device() == input.device(), "torch_ln.", op, ": expected grad_out on the input's device (",
                    input.device(), "), but got grad_out.device=", grad_out.device());
  const auto acc = accumulation_dtype(input.scalar_type());
  auto check_stat = [&](const char* name, const at::Tensor& s) {
    TORCH_CHECK_VALUE(s.numel() == shape.rows * stats_per_row, "torch_ln.", op, ": expected ", name, " to have ",
                      stats_per_row == 1 ? "one entry per row" : "an entry per row and group", " (",
                      shape.rows * stats_per_row, "), but got ", name, ".numel()=", s.numel());
    TORCH_CHECK_TYPE(s.scalar_type() == acc, "torch_ln.", op, ": expected ", name, " of dtype ", acc, ", but got ",
                     name, ".dtype=", s.scalar_type());
    TORCH_CHECK_VALUE(s.device() == input.device(), "torch_ln.", op, ": expected ", name, " on the input's device (",
                      input.device(), "), but got ", name, ".device=", s.device());
  };
  check_stat("rstd", rstd);
  if (mean.has_value()) check_stat("mean", *mean);
}

void check_rounding(const char* op, const RoundingOptions& rounding, const std::optional<at::Tensor>& weight) {
  TORCH_CHECK_VALUE(weight.has_value() || rounding.weight_offset == 0, "torch_ln.", op,
                    ": expected a weight with weight_offset=", rounding.weight_offset, ", but got weight=None");
}

void check_memory_efficient(const char* op, const std::optional<at::Tensor>& bias) {
  // With a bias, xhat = (y - bias) / weight cancels where |bias| >> |xhat * weight|: y's rounding error, relative to
  // y, becomes |bias / (xhat * weight)| times larger relative to xhat. Measured (weight 1 + 0.5 N(0, 1), bias
  // N(0, 1)): weight gradients 5x (float32) to 76x (float16) further from float64 than torch's; float64 passed there
  // but failed with N(0, 1) weights, where torch's error was 0. No dtype keeps the accuracy rule for every weight.
  TORCH_CHECK_VALUE(!bias.has_value(), "torch_ln.", op,
                    ": memory_efficient=True needs a norm without bias, but got a bias: the backward would recover ",
                    "the normalized input as (y - bias) / weight, which cancels where |bias| is much larger than ",
                    "|xhat * weight| (gradients beyond the accuracy rule); use memory_efficient=False, or bias=None");
}

at::Tensor inverse_weight(const char* op, const std::optional<at::Tensor>& weight, const RoundingOptions& rounding,
                          at::ScalarType acc, bool capturing) {
  if (!weight.has_value()) return {};
  const auto scale = weight->to(acc).flatten() + rounding.weight_offset;
  if (capturing) {  // fails the graph's replay (a device-side assertion: the CUDA context with it)
    at::_assert_async(scale.ne(0).all(),
                      c10::str("torch_ln.", op, ": memory_efficient=True needs every weight + weight_offset nonzero ",
                               "(weight_offset=", rounding.weight_offset, "), but a weight the captured backward read ",
                               "had a 0; use memory_efficient=False with this weight"));
  } else {
    const int64_t zeros = scale.eq(0).sum().item<int64_t>();
    TORCH_CHECK_VALUE(zeros == 0, "torch_ln.", op, ": memory_efficient=True recovers the normalized input from the ",
                      "output as y / (weight + weight_offset), so it needs every weight + weight_offset nonzero, but ",
                      zeros, " of ", scale.numel(), " are 0 (weight_offset=", rounding.weight_offset,
                      "); use memory_efficient=False with this weight");
  }
  return scale.reciprocal().contiguous();
}

at::ScalarType residual_stream_dtype(const char* op, const char* name, std::optional<at::ScalarType> dtype,
                                     const char* like_name, const at::Tensor& like) {
  const auto in = like.scalar_type();
  if (!dtype.has_value()) return in;
  const auto r = *dtype;
  TORCH_CHECK_TYPE(at::isFloatingType(r), "torch_ln.", op, ": expected ", name,
                   " to be a floating-point dtype, but got ", name, "=", r);
  const bool reduced = in == at::kHalf || in == at::kBFloat16;
  TORCH_CHECK_TYPE(r == in || (reduced && r == at::kFloat), "torch_ln.", op, ": expected ", name, " to be ", like_name,
                   "'s dtype (", in, ")", reduced ? " or float32" : "", ", but got ", name, "=", r);
  return r;
}

void check_like(const char* op, const char* name, const at::Tensor& tensor, const char* like_name,
                const at::Tensor& like, at::ScalarType dtype, at::ScalarType other_dtype) {
  TORCH_CHECK_VALUE(tensor.sizes() == like.sizes(), "torch_ln.", op, ": expected ", name, " to have ", like_name,
                    "'s shape ", like.sizes(), ", but got ", name, ".shape=", tensor.sizes());
  const auto t = tensor.scalar_type();
  TORCH_CHECK_TYPE(t == dtype || t == other_dtype, "torch_ln.", op, ": expected ", name, " of dtype ", dtype,
                   other_dtype != dtype ? " or " : "", other_dtype != dtype ? c10::toString(other_dtype) : "",
                   ", but got ", name, ".dtype=", t);
  TORCH_CHECK_VALUE(tensor.device() == like.device(), "torch_ln.", op, ": expected ", name, " on ", like_name,
                    "'s device (", like.device(), "), but got ", name, ".device=", tensor.device());
}

at::ScalarType accumulation_dtype(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

std::vector<int64_t> statistics_shape(const at::Tensor& input, int64_t axis) {
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  for (const auto i : c10::irange(axis, input.dim())) shape[i] = 1;
  return shape;
}

std::vector<int64_t> statistics_shape(const at::Tensor& input, int64_t axis, int64_t groups) {
  if (groups == 1) return statistics_shape(input, axis);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().begin() + axis);
  shape.push_back(groups);
  return shape;
}

GateArgs prepare_gate(const char* op, const std::optional<at::Tensor>& gate, const at::Tensor& input, int64_t cols,
                      c10::string_view gate_position, c10::string_view activation, std::optional<int64_t> group_size) {
  TORCH_CHECK_VALUE(gate_position == "before" || gate_position == "after", "torch_ln.", op,
                    ": expected gate_position 'before' or 'after', but got gate_position='", gate_position, "'");
  TORCH_CHECK_VALUE(activation == "silu" || activation == "sigmoid", "torch_ln.", op,
                    ": expected activation 'silu' or 'sigmoid', but got activation='", activation, "'");
  GateArgs g;
  if (gate.has_value()) {
    check_like(op, "gate", *gate, "input", input, input.scalar_type(), input.scalar_type());
    g.z = gate->contiguous();
  }
  g.before = gate_position == "before";
  g.activation = activation == "silu" ? GateActivation::Silu : GateActivation::Sigmoid;
  if (group_size.has_value()) {
    TORCH_CHECK_VALUE(*group_size > 0 && cols % *group_size == 0, "torch_ln.", op,
                      ": expected group_size to be a positive divisor of the normalized size ", cols,
                      ", but got group_size=", *group_size);
    g.group_size = *group_size == cols ? 0 : *group_size;
  }
  return g;
}

double default_rms_eps(at::ScalarType input) {
  return input == at::kDouble ? std::numeric_limits<double>::epsilon() : std::numeric_limits<float>::epsilon();
}

at::Tensor contiguous_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

at::Tensor unrequested_grad(const at::Tensor& like) { return at::empty({0}, like.options()); }

at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like) { return t.defined() ? t : unrequested_grad(like); }

std::pair<at::Tensor, RowStrides> strided_rows(const at::Tensor& input, int64_t axis, int64_t cols, int64_t groups) {
  const auto copy = [&] { return std::pair{input.contiguous(), RowStrides{cols}}; };
  // Each row's elements contiguous: the normalized dimensions, size-1 ones aside, strided as a contiguous block.
  int64_t expected = 1;
  for (int64_t d = input.dim() - 1; d >= axis; --d) {
    if (input.size(d) == 1) continue;
    if (input.stride(d) != expected) return copy();
    expected *= input.size(d);
  }
  // The leading dimensions, size-1 ones aside, innermost first, merged where one continues the next: at most two
  // levels (size, stride) remain to be read in place.
  std::array<std::pair<int64_t, int64_t>, 2> levels{};
  int depth = 0;
  for (int64_t d = axis - 1; d >= 0; --d) {
    const int64_t size = input.size(d), stride = input.stride(d);
    if (size == 1) continue;
    if (depth > 0 && stride == levels[depth - 1].second * levels[depth - 1].first) {
      levels[depth - 1].first *= size;
    } else if (depth == 2) {
      return copy();
    } else {
      levels[depth++] = {size, stride};
    }
  }
  // RowStrides' second level: 32-bit row indices (a grouped norm's kernels' rows: a row per group).
  const bool narrow = cols == 0 || input.numel() / cols * groups <= std::numeric_limits<uint32_t>::max();
  if (depth == 0) return {input, RowStrides{cols}};
  if (depth == 1) {
    if (groups > 1 && levels[0].second != cols && !narrow) return copy();
    return {input, RowStrides{levels[0].second}};
  }
  if (groups > 1 || !narrow) return copy();
  return {input, RowStrides{levels[0].second, levels[0].first, levels[1].second}};
}

QuantArgs prepare_quant(const char* op, const QuantRequest& request, const at::Tensor& input, int64_t axis,
                        int64_t rows, int64_t cols) {
  QuantArgs out;
  QuantSpec& spec = out.spec;
  switch (request.out_dtype) {
    case at::kFloat8_e4m3fn:
      spec.format = QuantFormat::Float8E4M3;
      break;
    case at::kFloat8_e5m2:
      spec.format = QuantFormat::Float8E5M2;
      break;
    case at::kChar:
      spec.format = QuantFormat::Int8;
      break;
    default:
      TORCH_CHECK_TYPE(false, "torch_ln.", op,
                       ": expected out_dtype torch.float8_e4m3fn, torch.float8_e5m2 or torch.int8, but got out_dtype=",
                       request.out_dtype);
  }
  out.q =
      at::empty(input.sizes(), input.options().dtype(request.out_dtype).memory_format(at::MemoryFormat::Contiguous));
  spec.dynamic = !request.scale.has_value();
  if (!spec.dynamic) {
    const at::Tensor& scale = *request.scale;
    TORCH_CHECK_VALUE(
        !request.group_size.has_value(), "torch_ln.", op,
        ": expected either scale (a static scale) or group_size (dynamic per-group scales), but got both");
    TORCH_CHECK_VALUE(!request.scale_ub.has_value() && !request.scale_ue8m0 && !request.scales_column_major,
                      "torch_ln.", op,
                      ": scale_ub, scale_ue8m0 and scales_column_major apply to dynamic scales, but a static scale "
                      "was given");
    TORCH_CHECK_VALUE(scale.numel() == 1, "torch_ln.", op,
                      ": expected scale to have one element (a per-tensor scale), but got scale.shape=", scale.sizes());
    TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, "torch_ln.", op,
                     ": expected scale of dtype float32, but got scale.dtype=", scale.scalar_type());
    TORCH_CHECK_VALUE(scale.device() == input.device(), "torch_ln.", op, ": expected scale on the input's device (",
                      input.device(), "), but got scale.device=", scale.device());
    out.scales = scale.reshape({1}).contiguous();
    return out;
  }
  spec.group = request.group_size.value_or(cols);
  TORCH_CHECK_VALUE(spec.group > 0 && cols % spec.group == 0, "torch_ln.", op,
                    ": expected group_size to be a positive divisor of the normalized size ", cols,
                    ", but got group_size=", spec.group);
  if (request.scale_ub.has_value()) {
    TORCH_CHECK_VALUE(*request.scale_ub > 0, "torch_ln.", op,
                      ": expected scale_ub > 0, but got scale_ub=", *request.scale_ub);
    spec.scale_ub = static_cast<float>(*request.scale_ub);
  }
  spec.ue8m0 = request.scale_ue8m0;
  const int64_t groups = cols / spec.group;
  const auto scale_opts = input.options().dtype(at::kFloat);
  // Column-major: each group's scales for all rows contiguous ([groups, M] transposed), as DeepGEMM-style GEMMs read.
  const at::Tensor flat =
      request.scales_column_major ? at::empty({groups, rows}, scale_opts).t() : at::empty({rows, groups}, scale_opts);
  spec.scale_row_stride = flat.stride(0);
  spec.scale_group_stride = flat.stride(1);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().begin() + axis);
  shape.push_back(groups);
  out.scales = flat.view(shape);
  return out;
}

at::Tensor empty_contiguous(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options.memory_format(at::MemoryFormat::Contiguous));
}

void define_norm_schemas(torch::Library& m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // weight_offset and round_normalized: see RoundingOptions (csrc/norm.h); the defaults are torch's arithmetic.
  // LayerNorm takes the offset only (zero-centred weights: y = xhat * (1 + w) + b); round_normalized reproduces the
  // Llama family's RMSNorm, and no LayerNorm class rounds that way. memory_efficient changes no result: the autograd
  // registered in Python saves the output y instead of the input, and its backward passes it with from_output
  // (BackwardArgs::from_output).
  m.def(
      "layer_norm_fwd(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps,"
      " float weight_offset=0., bool memory_efficient=False) -> (Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor input, SymInt[] normalized_shape, Tensor mean, Tensor rstd,"
      " Tensor? weight, Tensor? bias, bool[3] output_mask, float weight_offset=0., bool from_output=False)"
      " -> (Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "rms_norm_fwd(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps, float weight_offset=0.,"
      " bool round_normalized=False, bool memory_efficient=False) -> (Tensor, Tensor)",
      tags);
  m.def(
      "rms_norm_bwd(Tensor grad_out, Tensor input, SymInt[] normalized_shape, Tensor rstd, Tensor? weight,"
      " bool[2] output_mask, float weight_offset=0., bool round_normalized=False, bool from_output=False)"
      " -> (Tensor, Tensor)",
      tags);
  // Residual add + norm: (y, residual_out, statistics); the backward's first output is the gradient of
  // residual_out, which is that of both input and residual. The rounding options are the plain norms'.
  m.def(
      "add_layer_norm_fwd(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight, Tensor? bias,"
      " float eps, ScalarType? residual_dtype, float weight_offset=0.) -> (Tensor, Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "add_layer_norm_bwd(Tensor grad_out, Tensor? grad_residual_out, Tensor residual_out, SymInt[] normalized_shape,"
      " Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias, bool[3] output_mask, float weight_offset=0.)"
      " -> (Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "add_rms_norm_fwd(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight, float? eps,"
      " ScalarType? residual_dtype, float weight_offset=0., bool round_normalized=False) -> (Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "add_rms_norm_bwd(Tensor grad_out, Tensor? grad_residual_out, Tensor residual_out, SymInt[] normalized_shape,"
      " Tensor rstd, Tensor? weight, bool[2] output_mask, float weight_offset=0., bool round_normalized=False)"
      " -> (Tensor, Tensor)",
      tags);
  // Gated RMSNorm (hybrid SSM and linear-attention models): y = rmsnorm(x * act(gate)) or rmsnorm(x) * act(gate),
  // the RMS of each group of group_size elements apart; rstd has a value per row and group. See GateArgs.
  m.def(
      "gated_rms_norm_fwd(Tensor input, Tensor? gate, SymInt[] normalized_shape, Tensor? weight, float? eps,"
      " str gate_position='after', str activation='silu', int? group_size=None, bool round_normalized=False)"
      " -> (Tensor, Tensor)",
      tags);
  m.def(
      "gated_rms_norm_bwd(Tensor grad_out, Tensor input, Tensor? gate, SymInt[] normalized_shape, Tensor rstd,"
      " Tensor? weight, bool[3] output_mask, str gate_position='after', str activation='silu', int? group_size=None,"
      " bool round_normalized=False) -> (Tensor, Tensor, Tensor)",
      tags);
  // Norms with a quantized output, inference only (no autograd): q = y quantized to out_dtype (float8_e4m3fn,
  // float8_e5m2, int8) with a static scale (`scale`, one float32 element), or dynamic scales per token (neither
  // scale nor group_size) or per group of group_size elements. Returns (q, scales, y) (+ residual_out after a
  // residual add): scales empty for a static scale, y empty unless return_unquantized. See QuantSpec.
  const std::string quant_args =
      " ScalarType out_dtype, Tensor? scale=None, int? group_size=None, float? scale_ub=None, bool scale_ue8m0=False,"
      " bool scales_column_major=False, bool return_unquantized=False";
  m.def(("rms_norm_quant(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps," + quant_args +
         ", float weight_offset=0., bool round_normalized=False) -> (Tensor, Tensor, Tensor)")
            .c_str(),
        tags);
  m.def(("layer_norm_quant(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps," +
         quant_args + ", float weight_offset=0.) -> (Tensor, Tensor, Tensor)")
            .c_str(),
        tags);
  m.def(("add_rms_norm_quant(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight, float? eps,"
         " ScalarType? residual_dtype," +
         quant_args + ", float weight_offset=0., bool round_normalized=False) -> (Tensor, Tensor, Tensor, Tensor)")
            .c_str(),
        tags);
  m.def(("add_layer_norm_quant(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight,"
         " Tensor? bias, float eps, ScalarType? residual_dtype," +
         quant_args + ", float weight_offset=0.) -> (Tensor, Tensor, Tensor, Tensor)")
            .c_str(),
        tags);
}

}  // namespace torch_ln
