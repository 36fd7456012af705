// Autograd in C++ for eager calls: the operators torch_ln::layer_norm, rms_norm, add_layer_norm and add_rms_norm
// apply a torch::autograd::Function around the *_fwd operator, which saves the statistics, and call the *_bwd
// operator in the backward. On the 2-core dev VM a Python autograd.Function cost ~30 us a call (a third of a 1 MiB
// float32 norm); this node ~10 us (torch's generated one ~3 us). It is also what makes the C++ API trainable.
// torch.compile, torch.func and forward-mode AD keep the *_fwd operators and their Python registration: a C++
// Function has no jvp, no vmap rule and is not traceable. torch_ln.ops picks one or the other per call.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <torch_ln/torch_ln.h>

#include <algorithm>
#include <numeric>

#include "norm_ops.h"

namespace torch_ln {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;
using OptDtype = std::optional<at::ScalarType>;
// Gradients of (the norm's input, weight, bias). The norm's input is the input, or residual_out for the fused ops.
using Grads = std::array<at::Tensor, 3>;

// The kernels run below autograd (the Function records instead) and below autocast: autocast callers take the
// *_fwd operators, whose autocast rule Python registers.
struct BelowAutogradAndAutocast {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

OptTensor optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

template <typename... T>
Grads as_grads(const std::tuple<T...>& grads) {
  return std::apply([](const auto&... g) { return Grads{g...}; }, grads);
}

bool records(std::initializer_list<OptTensor> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  return std::any_of(tensors.begin(), tensors.end(),
                     [](const OptTensor& t) { return t && t->defined() && t->requires_grad(); });
}

// Autograd edges are numbered over the defined tensor arguments only: where weight and bias sit after `first`.
std::array<int64_t, 2> parameter_edges(int64_t first, const at::Tensor& weight, const at::Tensor& bias) {
  return {weight.defined() ? first : -1, bias.defined() ? first + weight.defined() : -1};
}

bool wants(AutogradContext* ctx, int64_t edge) { return edge >= 0 && ctx->needs_input_grad(edge); }

// Saved: the norm's input and statistics (only when the gradient of the input or the weight is wanted: the bias
// gradient alone needs none of them, and they are not kept alive for it), then weight and bias; the shape and eps
// in saved_data.
enum Saved { kNormInput, kMean, kRstd, kWeight, kBias };

void save(AutogradContext* ctx, bool keep_rows, const at::Tensor& norm_input, const at::Tensor& mean,
          const at::Tensor& rstd, const OptTensor& weight, const OptTensor& bias, at::IntArrayRef normalized_shape,
          const c10::IValue& eps) {
  const at::Tensor none;
  ctx->save_for_backward({keep_rows ? norm_input : none, keep_rows ? mean : none, keep_rows ? rstd : none,
                          weight.value_or(none), bias.value_or(none)});
  ctx->saved_data["normalized_shape"] = normalized_shape.vec();
  ctx->saved_data["eps"] = eps;
}

// The bias gradient: grad_out summed over the batch dimensions in float32 (float64), then rounded to bias's dtype.
at::Tensor sum_rows(const at::Tensor& grad_out, size_t norm_ndim, at::ScalarType dtype) {
  std::vector<int64_t> batch_dims(grad_out.dim() - norm_ndim);
  std::iota(batch_dims.begin(), batch_dims.end(), 0);
  if (batch_dims.empty()) return grad_out.to(dtype);  // sum over no dimension would sum them all
  return grad_out.sum(batch_dims, false, accumulation_dtype(dtype)).to(dtype);
}

// The gradients one backward wants: from the *_bwd kernel with the saved statistics; or, when the backward must
// itself be differentiable (create_graph=True), from the closed form in torch ops that the Python package
// registers (torch_ln.reference.norm_backward), as the Python path does.
template <typename Kernel>
Grads norm_grads(AutogradContext* ctx, const variable_list& saved, const at::Tensor& grad_out,
                 const at::Tensor& grad_residual_out, std::array<bool, 3> wanted, bool centred, const Kernel& kernel) {
  const auto& norm_input = saved[kNormInput];
  if (!grad_out.defined()) return {};  // no incoming gradient
  if (!norm_input.defined()) {         // not kept: only the bias gradient can be wanted
    if (!wanted[2]) return {};
    const auto norm_ndim = ctx->saved_data["normalized_shape"].toIntVector().size();
    return {at::Tensor(), at::Tensor(), sum_rows(grad_out, norm_ndim, saved[kBias].scalar_type())};
  }
  Grads grads;
  if (records({grad_out, grad_residual_out, norm_input, saved[kWeight], saved[kBias]})) {
    static const auto composite =
        c10::Dispatcher::singleton().findSchemaOrThrow("torch_ln::norm_backward_composite", "");
    TORCH_CHECK(composite.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd),
                "torch_ln: a double backward (create_graph=True) needs torch_ln::norm_backward_composite, which the ",
                "torch_ln Python package registers; without it only the first-order backward is available");
    // The weight offset enters as weight + offset (dweight is the same).
    const auto offset = ctx->saved_data.count("weight_offset") ? ctx->saved_data["weight_offset"].toDouble() : 0.0;
    const auto& weight = saved[kWeight];
    const auto found =
        composite
            .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const OptTensor&,
                                           const OptTensor&, std::optional<double>, bool)>()
            .call(grad_out, norm_input, ctx->saved_data["normalized_shape"].toIntVector(),
                  optional(offset != 0 && weight.defined() ? weight + offset : weight), optional(saved[kBias]),
                  ctx->saved_data["eps"].toOptional<double>(), centred);
    for (const auto i : c10::irange(3)) {
      if (wanted[i]) grads[i] = found[i];
    }
    if (wanted[0] && grad_residual_out.defined()) grads[0] = grads[0] + grad_residual_out;
    return grads;
  }
  {
    BelowAutogradAndAutocast guard;
    grads = kernel();
  }
  for (const auto i : c10::irange(3)) {
    if (!wanted[i]) grads[i] = at::Tensor();  // the kernels return unrequested gradients as empty tensors
  }
  return grads;
}

struct LayerNormFunction : torch::autograd::Function<LayerNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps) {
    const auto [y, mean, rstd] = [&] {
      BelowAutogradAndAutocast guard;
      return layer_norm_fwd(input, normalized_shape, weight, bias, eps);
    }();
    const auto [w, b] = parameter_edges(1, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()));
    save(ctx, ctx->needs_input_grad(0) || wants(ctx, w), input, mean, rstd, weight, bias, normalized_shape, eps);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto shape = ctx->saved_data["normalized_shape"].toIntVector();
    const auto [w, b] = parameter_edges(1, saved[kWeight], saved[kBias]);
    const std::array<bool, 3> wanted{ctx->needs_input_grad(0), wants(ctx, w), wants(ctx, b)};
    const auto weight = optional(saved[kWeight]), bias = optional(saved[kBias]);
    const auto g = norm_grads(ctx, saved, grads[0], at::Tensor(), wanted, true, [&] {
      return as_grads(
          layer_norm_bwd(grads[0], saved[kNormInput], shape, saved[kMean], saved[kRstd], weight, bias, wanted));
    });
    return {g[0], at::Tensor(), g[1], g[2], at::Tensor()};
  }
};

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const OptTensor& weight, std::optional<double> eps, double weight_offset,
                            bool round_normalized) {
    const auto [y, rstd] = [&] {
      BelowAutogradAndAutocast guard;
      return rms_norm_fwd(input, normalized_shape, weight, eps, weight_offset, round_normalized);
    }();
    const auto [w, _] = parameter_edges(1, weight.value_or(at::Tensor()), at::Tensor());
    save(ctx, ctx->needs_input_grad(0) || wants(ctx, w), input, at::Tensor(), rstd, weight, std::nullopt,
         normalized_shape, eps);
    ctx->saved_data["weight_offset"] = weight_offset;
    ctx->saved_data["round_normalized"] = round_normalized;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto shape = ctx->saved_data["normalized_shape"].toIntVector();
    const auto [w, _] = parameter_edges(1, saved[kWeight], at::Tensor());
    const std::array<bool, 3> wanted{ctx->needs_input_grad(0), wants(ctx, w), false};
    const auto weight = optional(saved[kWeight]);
    const auto weight_offset = ctx->saved_data["weight_offset"].toDouble();
    const auto round_normalized = ctx->saved_data["round_normalized"].toBool();
    const auto g = norm_grads(ctx, saved, grads[0], at::Tensor(), wanted, false, [&] {
      return as_grads(std::tuple_cat(rms_norm_bwd(grads[0], saved[kNormInput], shape, saved[kRstd], weight,
                                                  {wanted[0], wanted[1]}, weight_offset, round_normalized),
                                     std::make_tuple(at::Tensor())));
    });
    return {g[0], at::Tensor(), g[1], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The fused residual add: the backward reads residual_out (saved, an output) once; the gradient of input and of
// residual is the same, that of residual_out through the norm plus residual_out's own incoming gradient.
void save_fused(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& residual,
                const at::Tensor& residual_out, const at::Tensor& mean, const at::Tensor& rstd, const OptTensor& weight,
                const OptTensor& bias, at::IntArrayRef normalized_shape, const c10::IValue& eps) {
  const auto [w, b] = parameter_edges(2, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()));
  const bool keep_rows = ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || wants(ctx, w);
  save(ctx, keep_rows, residual_out, mean, rstd, weight, bias, normalized_shape, eps);
  ctx->saved_data["input_dtype"] = input.scalar_type();
  ctx->saved_data["residual_dtype"] = residual.scalar_type();
  ctx->set_materialize_grads(false);  // residual_out's gradient is often absent: no zeros to read
}

// What a fused backward works from: the saved tensors, the incoming gradient of y (zeros when only residual_out was
// used) and which of (residual_out, weight, bias) gradients are wanted.
struct FusedBackward {
  variable_list saved;
  std::vector<int64_t> normalized_shape;
  at::Tensor grad_out;
  std::array<bool, 3> wanted{};
};

FusedBackward fused_backward_inputs(AutogradContext* ctx, const variable_list& grads) {
  FusedBackward in{ctx->get_saved_variables(), ctx->saved_data["normalized_shape"].toIntVector()};
  const auto& like = grads[0].defined() ? grads[0] : grads[1];
  if (!like.defined()) return in;  // no incoming gradient at all
  const auto dtype = ctx->saved_data["input_dtype"].toScalarType();
  in.grad_out = grads[0].defined() ? grads[0] : at::zeros_like(like, like.options().dtype(dtype));
  const auto [w, b] = parameter_edges(2, in.saved[kWeight], in.saved[kBias]);
  in.wanted = {ctx->needs_input_grad(0) || ctx->needs_input_grad(1), wants(ctx, w), wants(ctx, b)};
  return in;
}

variable_list fused_grads(AutogradContext* ctx, const Grads& g) {
  const auto dresidual_out = g[0];
  const auto converted = [&](int64_t edge, const char* dtype) {
    if (!dresidual_out.defined()) return at::Tensor();
    return ctx->needs_input_grad(edge) ? dresidual_out.to(ctx->saved_data[dtype].toScalarType()) : at::Tensor();
  };
  return {converted(0, "input_dtype"),
          converted(1, "residual_dtype"),
          at::Tensor(),
          g[1],
          g[2],
          at::Tensor(),
          at::Tensor()};
}

struct AddLayerNormFunction : torch::autograd::Function<AddLayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& residual,
                               at::IntArrayRef normalized_shape, const OptTensor& weight, const OptTensor& bias,
                               double eps, OptDtype residual_dtype) {
    const auto [y, residual_out, mean, rstd] = [&] {
      BelowAutogradAndAutocast guard;
      return add_layer_norm_fwd(input, residual, normalized_shape, weight, bias, eps, residual_dtype);
    }();
    save_fused(ctx, input, residual, residual_out, mean, rstd, weight, bias, normalized_shape, eps);
    return {y, residual_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto in = fused_backward_inputs(ctx, grads);
    const auto& saved = in.saved;
    return fused_grads(ctx, norm_grads(ctx, saved, in.grad_out, grads[1], in.wanted, true, [&] {
                         return as_grads(add_layer_norm_bwd(
                             in.grad_out, optional(grads[1]), saved[kNormInput], in.normalized_shape, saved[kMean],
                             saved[kRstd], optional(saved[kWeight]), optional(saved[kBias]), in.wanted));
                       }));
  }
};

struct AddRmsNormFunction : torch::autograd::Function<AddRmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& residual,
                               at::IntArrayRef normalized_shape, const OptTensor& weight, std::optional<double> eps,
                               OptDtype residual_dtype) {
    const auto [y, residual_out, rstd] = [&] {
      BelowAutogradAndAutocast guard;
      return add_rms_norm_fwd(input, residual, normalized_shape, weight, eps, residual_dtype);
    }();
    save_fused(ctx, input, residual, residual_out, at::Tensor(), rstd, weight, std::nullopt, normalized_shape, eps);
    return {y, residual_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto in = fused_backward_inputs(ctx, grads);
    const auto& saved = in.saved;
    auto out =
        fused_grads(ctx, norm_grads(ctx, saved, in.grad_out, grads[1], in.wanted, false, [&] {
                      return as_grads(std::tuple_cat(
                          add_rms_norm_bwd(in.grad_out, optional(grads[1]), saved[kNormInput], in.normalized_shape,
                                           saved[kRstd], optional(saved[kWeight]), {in.wanted[0], in.wanted[1]}),
                          std::make_tuple(at::Tensor())));
                    }));
    out.pop_back();  // no bias argument
    return out;
  }
};

// Each operator records a node only when autograd would: otherwise it is the plain forward kernel.

at::Tensor layer_norm_op(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                         const OptTensor& bias, double eps) {
  if (records({input, weight, bias})) return LayerNormFunction::apply(input, normalized_shape, weight, bias, eps);
  BelowAutogradAndAutocast guard;
  return std::get<0>(layer_norm_fwd(input, normalized_shape, weight, bias, eps));
}

at::Tensor rms_norm_op(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                       std::optional<double> eps, double weight_offset, bool round_normalized) {
  if (records({input, weight})) {
    return RmsNormFunction::apply(input, normalized_shape, weight, eps, weight_offset, round_normalized);
  }
  BelowAutogradAndAutocast guard;
  return std::get<0>(rms_norm_fwd(input, normalized_shape, weight, eps, weight_offset, round_normalized));
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_op(const at::Tensor& input, const at::Tensor& residual,
                                                     at::IntArrayRef normalized_shape, const OptTensor& weight,
                                                     const OptTensor& bias, double eps, OptDtype residual_dtype) {
  if (records({input, residual, weight, bias})) {
    const auto out = AddLayerNormFunction::apply(input, residual, normalized_shape, weight, bias, eps, residual_dtype);
    return {out[0], out[1]};
  }
  BelowAutogradAndAutocast guard;
  const auto out = add_layer_norm_fwd(input, residual, normalized_shape, weight, bias, eps, residual_dtype);
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& input, const at::Tensor& residual,
                                                   at::IntArrayRef normalized_shape, const OptTensor& weight,
                                                   std::optional<double> eps, OptDtype residual_dtype) {
  if (records({input, residual, weight})) {
    const auto out = AddRmsNormFunction::apply(input, residual, normalized_shape, weight, eps, residual_dtype);
    return {out[0], out[1]};
  }
  BelowAutogradAndAutocast guard;
  const auto out = add_rms_norm_fwd(input, residual, normalized_shape, weight, eps, residual_dtype);
  return {std::get<0>(out), std::get<1>(out)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ln, m) {
  // The differentiable entry points for eager code. torch.compile, torch.func and forward-mode AD take the *_fwd
  // operators (csrc/norm_ops.cpp), whose autograd Python registers.
  m.def(
      "layer_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-05)"
      " -> Tensor");
  m.def(
      "rms_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, float? eps=None, float weight_offset=0.,"
      " bool round_normalized=False) -> Tensor");
  m.def(
      "add_layer_norm(Tensor input, Tensor residual, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None,"
      " float eps=1e-05, ScalarType? residual_dtype=None) -> (Tensor, Tensor)");
  m.def(
      "add_rms_norm(Tensor input, Tensor residual, int[] normalized_shape, Tensor? weight=None, float? eps=None,"
      " ScalarType? residual_dtype=None) -> (Tensor, Tensor)");
  // The gradients of a norm (centred: LayerNorm) in torch ops, differentiable, statistics recomputed: the
  // eager operators' double backward. The Python package registers it (torch_ln.reference.norm_backward).
  m.def(
      "norm_backward_composite(Tensor grad_out, Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias,"
      " float? eps, bool centred) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(torch_ln, CompositeImplicitAutograd, m) {
  m.impl("layer_norm", &layer_norm_op);
  m.impl("rms_norm", &rms_norm_op);
  m.impl("add_layer_norm", &add_layer_norm_op);
  m.impl("add_rms_norm", &add_rms_norm_op);
}

}  // namespace torch_ln
