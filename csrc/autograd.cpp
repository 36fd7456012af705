// Autograd in C++ for eager calls: the operators torch_ln::layer_norm, rms_norm, add_layer_norm and add_rms_norm
// run the *_fwd kernel below autograd and record NormBackward, a node written out as torch's generated ones are
// (SavedVariables, plain members), whose backward calls the *_bwd kernel. A torch::autograd::Function cost ~3 us
// more a call (its context, IValue map, per-output checks). Per call, 4x1024 float32 requiring grad, thread CPU time
// on the 2-core dev VM (benchmarks/bench_overhead.py, min of 30 batches): the operator 9.1 us forward (11.8 with the
// Function), torch.layer_norm 7.3; forward + backward 104 us (116), torch's 93. It also makes the C++ API trainable.
// torch.compile, torch.func and forward-mode AD keep the *_fwd operators and their Python registration: this node
// has no jvp and no vmap rule, and torch.compile cannot trace into it. torch_ln.ops picks one or the other per call.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/library.h>
#include <torch_ln/torch_ln.h>

#include <algorithm>
#include <numeric>

#include "norm_ops.h"

namespace torch_ln {

namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using torch::dynamo::autograd::CompiledNodeArgs;
using torch::dynamo::autograd::IValuePacker;
using torch::dynamo::autograd::PackedArgs;
using torch::dynamo::autograd::SwapSavedVariables;
using OptTensor = std::optional<at::Tensor>;
using OptDtype = std::optional<at::ScalarType>;
// Gradients of (the norm's input, weight, bias). The norm's input is the input, or residual_out for the fused ops.
using Grads = std::array<at::Tensor, 3>;

// The kernels run below autograd (the node records instead) and below autocast: autocast callers take the
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

// The node has no forward-mode derivative: dual tensors belong to the *_fwd operators, where torch_ln.ops sends
// them. A dual tensor here is refused rather than its tangent dropped.
void check_no_tangent(const char* op, std::initializer_list<OptTensor> tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK(!torch::autograd::isFwGradDefined(t), "torch_ln::", op,
                " has no forward-mode AD, but a dual tensor came; call torch_ln.", op, ", which takes torch_ln::", op,
                "_fwd for it");
  }
}

// Which operator a node differentiates. Its inputs (the node's edges, in order) are (input, weight[, bias]), or
// (input, residual, weight[, bias]) for the fused residual add, whose outputs are (y, residual_out).
enum class Norm : int64_t { kLayer, kRms, kAddLayer, kAddRms };

bool centred(Norm norm) { return norm == Norm::kLayer || norm == Norm::kAddLayer; }
bool fused(Norm norm) { return norm == Norm::kAddLayer || norm == Norm::kAddRms; }
int64_t weight_edge(Norm norm) { return fused(norm) ? 2 : 1; }
size_t edge_count(Norm norm) { return weight_edge(norm) + 1 + centred(norm); }

// What a backward needs besides the gradients and the saved tensors.
struct Attributes {
  Norm norm;
  std::vector<int64_t> normalized_shape;
  std::optional<double> eps;
  double weight_offset = 0.0;
  bool round_normalized = false;
  at::ScalarType input_dtype = at::kFloat, residual_dtype = at::kFloat, bias_dtype = at::kFloat;
};

// The saved tensors, unpacked: undefined where not saved. The norm's input and statistics are saved only when the
// gradient of the input or the weight is wanted (the bias gradient alone needs none of them, and they are not kept
// alive for it).
struct Saved {
  at::Tensor norm_input, mean, rstd, weight, bias;
};

// Which of the node's inputs want a gradient, by edge.
using Needs = std::array<bool, 4>;

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
Grads norm_grads(const Attributes& a, const Saved& s, const at::Tensor& grad_out, const at::Tensor& grad_residual_out,
                 std::array<bool, 3> wanted) {
  if (!s.norm_input.defined()) {  // not kept: only the bias gradient can be wanted
    if (!wanted[2]) return {};
    return {at::Tensor(), at::Tensor(), sum_rows(grad_out, a.normalized_shape.size(), a.bias_dtype)};
  }
  Grads grads;
  if (records({grad_out, grad_residual_out, s.norm_input, s.weight, s.bias})) {
    static const auto composite =
        c10::Dispatcher::singleton().findSchemaOrThrow("torch_ln::norm_backward_composite", "");
    TORCH_CHECK(composite.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd),
                "torch_ln: a double backward (create_graph=True) needs torch_ln::norm_backward_composite, which the ",
                "torch_ln Python package registers; without it only the first-order backward is available");
    // The weight offset enters as weight + offset (dweight is the same).
    const auto& weight = s.weight;
    const auto found =
        composite
            .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, at::IntArrayRef, const OptTensor&,
                                           const OptTensor&, std::optional<double>, bool)>()
            .call(grad_out, s.norm_input, a.normalized_shape,
                  optional(a.weight_offset != 0 && weight.defined() ? weight + a.weight_offset : weight),
                  optional(s.bias), a.eps, centred(a.norm));
    for (const auto i : c10::irange(3)) {
      if (wanted[i]) grads[i] = found[i];
    }
    if (wanted[0] && grad_residual_out.defined()) grads[0] = grads[0] + grad_residual_out;
    return grads;
  }
  {
    BelowAutogradAndAutocast guard;
    const auto weight = optional(s.weight), bias = optional(s.bias);
    const auto& shape = a.normalized_shape;
    const std::array<bool, 2> weighed{wanted[0], wanted[1]};
    switch (a.norm) {
      case Norm::kLayer:
        grads = as_grads(
            layer_norm_bwd(grad_out, s.norm_input, shape, s.mean, s.rstd, weight, bias, wanted, a.weight_offset));
        break;
      case Norm::kRms:
        grads = as_grads(std::tuple_cat(
            rms_norm_bwd(grad_out, s.norm_input, shape, s.rstd, weight, weighed, a.weight_offset, a.round_normalized),
            std::make_tuple(at::Tensor())));
        break;
      case Norm::kAddLayer:
        grads = as_grads(add_layer_norm_bwd(grad_out, optional(grad_residual_out), s.norm_input, shape, s.mean, s.rstd,
                                            weight, bias, wanted, a.weight_offset));
        break;
      case Norm::kAddRms:
        grads = as_grads(std::tuple_cat(add_rms_norm_bwd(grad_out, optional(grad_residual_out), s.norm_input, shape,
                                                         s.rstd, weight, weighed, a.weight_offset, a.round_normalized),
                                        std::make_tuple(at::Tensor())));
        break;
    }
  }
  for (const auto i : c10::irange(3)) {
    if (!wanted[i]) grads[i] = at::Tensor();  // the kernels return unrequested gradients as empty tensors
  }
  return grads;
}

// The gradient of each edge from the incoming gradients of the outputs; undefined where not wanted. The fused ops:
// the gradient of input and of residual is the same, that of residual_out through the norm plus residual_out's own
// incoming gradient; y's gradient is zeros when only residual_out's came.
variable_list norm_backward(const Attributes& a, const Saved& s, const variable_list& grads, const Needs& needs) {
  const auto w = weight_edge(a.norm);
  variable_list out(edge_count(a.norm));
  const auto grad_residual_out = fused(a.norm) ? grads[1] : at::Tensor();
  auto grad_out = grads[0];
  if (!grad_out.defined()) {
    if (!grad_residual_out.defined()) return out;  // no incoming gradient at all
    grad_out = at::zeros_like(grad_residual_out, grad_residual_out.options().dtype(a.input_dtype));
  }
  const bool needs_dinput = needs[0] || (fused(a.norm) && needs[1]);
  const auto g =
      norm_grads(a, s, grad_out, grad_residual_out, {needs_dinput, needs[w], centred(a.norm) && needs[w + 1]});
  if (fused(a.norm)) {
    if (needs[0]) out[0] = g[0].to(a.input_dtype);
    if (needs[1]) out[1] = g[0].to(a.residual_dtype);
  } else {
    out[0] = g[0];
  }
  out[w] = g[1];
  if (centred(a.norm)) out[w + 1] = g[2];
  return out;
}

// Compiled autograd calls the backward as a function of IValues: the attributes, the saved tensors and the needs.
struct Packer {
  PackedArgs args;
  std::vector<at::TypePtr> schema;

  template <typename T>
  void pack(const T& value) {
    args.pack(value);
    schema.push_back(IValuePacker<T>::packed_type());
  }
};

void pack(Packer& p, const Attributes& a, const Saved& s, const Needs& needs) {
  p.pack(static_cast<int64_t>(a.norm));
  p.pack(a.normalized_shape);
  p.pack(a.eps);
  p.pack(a.weight_offset);
  p.pack(a.round_normalized);
  for (const auto dtype : {a.input_dtype, a.residual_dtype, a.bias_dtype}) p.pack(static_cast<int64_t>(dtype));
  for (const auto& t : {s.norm_input, s.mean, s.rstd, s.weight, s.bias}) p.pack(optional(t));
  p.pack(needs);
}

variable_list norm_backward_packed(const variable_list& grads, const std::vector<c10::IValue>& packed) {
  PackedArgs p(packed);
  Attributes a{static_cast<Norm>(p.unpack<int64_t>()), p.unpack<std::vector<int64_t>>(),
               p.unpack<std::optional<double>>(), p.unpack<double>(), p.unpack<bool>()};
  for (auto* dtype : {&a.input_dtype, &a.residual_dtype, &a.bias_dtype}) {
    *dtype = static_cast<at::ScalarType>(p.unpack<int64_t>());
  }
  Saved s;
  for (auto* t : {&s.norm_input, &s.mean, &s.rstd, &s.weight, &s.bias})
    *t = p.unpack<OptTensor>().value_or(at::Tensor());
  const auto needs = p.unpack<Needs>();
  return norm_backward(a, s, grads, needs);
}

// The backward node of one eager call, written out as torch's generated nodes are (a torch::autograd::Function
// costs a few us more a call: its context, IValue map and per-output checks).
struct NormBackward : torch::autograd::Node {
  Attributes attributes;
  SavedVariable norm_input, mean, rstd, weight, bias;

  NormBackward(Attributes a, torch::autograd::edge_list&& edges) : Node(std::move(edges)), attributes(std::move(a)) {}

  std::string name() const override {
    switch (attributes.norm) {
      case Norm::kLayer:
        return "torch_ln::LayerNormBackward";
      case Norm::kRms:
        return "torch_ln::RmsNormBackward";
      case Norm::kAddLayer:
        return "torch_ln::AddLayerNormBackward";
      case Norm::kAddRms:
        return "torch_ln::AddRmsNormBackward";
    }
    return "torch_ln::NormBackward";
  }

  // Called once the outputs' history is set (the fused ops save residual_out, an output of this node).
  void save(const at::Tensor& norm_input_, const at::Tensor& mean_, const at::Tensor& rstd_, const OptTensor& weight_,
            const OptTensor& bias_) {
    if (bias_) attributes.bias_dtype = bias_->scalar_type();
    const auto& a = attributes;
    if (!(should_compute_output(0) || (fused(a.norm) && should_compute_output(1)) ||
          should_compute_output(weight_edge(a.norm)))) {
      return;  // the bias gradient alone: nothing to keep
    }
    norm_input = SavedVariable(norm_input_, /*is_output=*/fused(a.norm));
    if (mean_.defined()) mean = SavedVariable(mean_, false);
    rstd = SavedVariable(rstd_, false);
    if (weight_) weight = SavedVariable(*weight_, false);
    if (bias_) bias = SavedVariable(*bias_, false);
  }

  Saved unpacked() {
    const auto self = getptr();
    return {norm_input.unpack(self), mean.unpack(), rstd.unpack(), weight.unpack(), bias.unpack()};
  }

  Needs needs() const {
    Needs needs{};
    for (const auto i : c10::irange(num_outputs())) needs[i] = task_should_compute_output(i);
    return needs;
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return norm_backward(attributes, unpacked(), grads, needs());
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* saved : {&norm_input, &mean, &rstd, &weight, &bias}) saved->reset_data();
  }

  void compiled_args(CompiledNodeArgs& args) const override {
    const auto& a = attributes;
    args.collect(static_cast<int64_t>(a.norm));
    args.collect(a.normalized_shape);
    args.collect(a.eps);
    args.collect(a.weight_offset);
    args.collect(a.round_normalized);
    for (const auto dtype : {a.input_dtype, a.residual_dtype, a.bias_dtype}) args.collect(dtype);
    args.collect(norm_input, fused(a.norm));
    for (const auto* saved : {&mean, &rstd, &weight, &bias}) args.collect(*saved, false);
  }

  variable_list apply_with_saved(const variable_list& grads, SwapSavedVariables& saved) override {
    for (auto* t : {&norm_input, &mean, &rstd, &weight, &bias}) saved.before(*t);
    Packer packer;
    pack(packer, attributes, unpacked(), needs());
    const auto& interface = torch::dynamo::autograd::getPyCompilerInterface();
    // Bound once for all four norms (the norm is an argument): the schema is the same.
    static const auto fn = interface->bind_function(saved.get_py_compiler(), "torch_ln_norm_backward",
                                                    norm_backward_packed, packer.schema);
    const auto output_metadata = IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(
        torch::dynamo::autograd::get_input_metadata(next_edges()));
    auto results = interface->call_function(saved.get_py_compiler(), "apply_functional", fn, grads,
                                            std::move(packer.args).vec(), output_metadata);
    for (auto* t : {&norm_input, &mean, &rstd, &weight, &bias}) saved.after(*t);
    return results;
  }
};

// A new node, held as the installed torch holds them: torch 2.13 made nodes intrusive_ptrs (and split
// torch/csrc/autograd/node.h out of function.h); 2.11 and 2.12 keep them in shared_ptrs with torch's deleter.
template <typename... Args>
auto make_node(Args&&... args) {
#if __has_include(<torch/csrc/autograd/node.h>)
  return c10::make_intrusive<NormBackward>(std::forward<Args>(args)...);
#else
  return std::shared_ptr<NormBackward>(new NormBackward(std::forward<Args>(args)...), torch::autograd::deleteNode);
#endif
}

// Records the node of one call: an edge to each input (invalid where no gradient is wanted), then the outputs'
// history.
template <typename... Inputs>
auto record(Attributes attributes, std::initializer_list<at::Tensor*> outputs, const Inputs&... inputs) {
  auto node = make_node(std::move(attributes), torch::autograd::collect_next_edges(inputs...));
  for (auto* output : outputs) torch::autograd::set_history(*output, node);
  return node;
}

// Each operator records a node only when autograd would: otherwise it is the plain forward kernel.

at::Tensor layer_norm_op(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                         const OptTensor& bias, double eps, double weight_offset) {
  check_no_tangent("layer_norm", {input, weight, bias});
  auto [y, mean, rstd] = [&] {
    BelowAutogradAndAutocast guard;
    return layer_norm_fwd(input, normalized_shape, weight, bias, eps, weight_offset);
  }();
  if (records({input, weight, bias})) {
    record({Norm::kLayer, normalized_shape.vec(), eps, weight_offset}, {&y}, input, weight, bias)
        ->save(input, mean, rstd, weight, bias);
  }
  return y;
}

at::Tensor rms_norm_op(const at::Tensor& input, at::IntArrayRef normalized_shape, const OptTensor& weight,
                       std::optional<double> eps, double weight_offset, bool round_normalized) {
  check_no_tangent("rms_norm", {input, weight});
  auto [y, rstd] = [&] {
    BelowAutogradAndAutocast guard;
    return rms_norm_fwd(input, normalized_shape, weight, eps, weight_offset, round_normalized);
  }();
  if (records({input, weight})) {
    record({Norm::kRms, normalized_shape.vec(), eps, weight_offset, round_normalized}, {&y}, input, weight)
        ->save(input, at::Tensor(), rstd, weight, std::nullopt);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_op(const at::Tensor& input, const at::Tensor& residual,
                                                     at::IntArrayRef normalized_shape, const OptTensor& weight,
                                                     const OptTensor& bias, double eps, OptDtype residual_dtype,
                                                     double weight_offset) {
  check_no_tangent("add_layer_norm", {input, residual, weight, bias});
  auto [y, residual_out, mean, rstd] = [&] {
    BelowAutogradAndAutocast guard;
    return add_layer_norm_fwd(input, residual, normalized_shape, weight, bias, eps, residual_dtype, weight_offset);
  }();
  if (records({input, residual, weight, bias})) {
    const Attributes a{Norm::kAddLayer,     normalized_shape.vec(), eps, weight_offset, false,
                       input.scalar_type(), residual.scalar_type()};
    record(a, {&y, &residual_out}, input, residual, weight, bias)->save(residual_out, mean, rstd, weight, bias);
  }
  return {y, residual_out};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& input, const at::Tensor& residual,
                                                   at::IntArrayRef normalized_shape, const OptTensor& weight,
                                                   std::optional<double> eps, OptDtype residual_dtype,
                                                   double weight_offset, bool round_normalized) {
  check_no_tangent("add_rms_norm", {input, residual, weight});
  auto [y, residual_out, rstd] = [&] {
    BelowAutogradAndAutocast guard;
    return add_rms_norm_fwd(input, residual, normalized_shape, weight, eps, residual_dtype, weight_offset,
                            round_normalized);
  }();
  if (records({input, residual, weight})) {
    const Attributes a{Norm::kAddRms,       normalized_shape.vec(), eps, weight_offset, round_normalized,
                       input.scalar_type(), residual.scalar_type()};
    record(a, {&y, &residual_out}, input, residual, weight)
        ->save(residual_out, at::Tensor(), rstd, weight, std::nullopt);
  }
  return {y, residual_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ln, m) {
  // The differentiable entry points for eager code. torch.compile, torch.func and forward-mode AD take the *_fwd
  // operators (csrc/norm_ops.cpp), whose autograd Python registers.
  m.def(
      "layer_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-05,"
      " float weight_offset=0.) -> Tensor");
  m.def(
      "rms_norm(Tensor input, int[] normalized_shape, Tensor? weight=None, float? eps=None, float weight_offset=0.,"
      " bool round_normalized=False) -> Tensor");
  m.def(
      "add_layer_norm(Tensor input, Tensor residual, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None,"
      " float eps=1e-05, ScalarType? residual_dtype=None, float weight_offset=0.) -> (Tensor, Tensor)");
  m.def(
      "add_rms_norm(Tensor input, Tensor residual, int[] normalized_shape, Tensor? weight=None, float? eps=None,"
      " ScalarType? residual_dtype=None, float weight_offset=0., bool round_normalized=False) -> (Tensor, Tensor)");
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
