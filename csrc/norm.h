// Backend-independent pieces of the torch_ln operators: argument checks, the
// problem shape, and the kernel interface each backend (CPU, CUDA, emulated
// CUDA) implements. The operators themselves are written once, in norm_ops.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "norm_kind.h"
#include "quantize.h"
#include "row_strides.h"

namespace torch_ln {

// Where the weight product rounds, for norms that follow another library's arithmetic. The defaults are torch's:
// xhat * weight in acc_t, rounded once at the end.
struct RoundingOptions {
  double weight_offset = 0;       // the weight enters as (weight + offset), added in acc_t (Gemma: 1)
  bool round_normalized = false;  // xhat rounded to the input dtype before the weight multiply (Llama)
};

// The gate of a gated RMSNorm (norm_ops.h's gated_rms_norm): y = rmsnorm(x * act(z)) (`before`) or rmsnorm(x) * act(z),
// act(z) and its product in acc_t; the RMS of each group of `group_size` elements of a row apart (Mamba2's n_groups).
struct GateArgs {
  at::Tensor z;  // [M, D] contiguous, the input's dtype; undefined: no gate
  bool before = false;
  GateActivation activation = GateActivation::Silu;
  int64_t group_size = 0;  // 0: the whole row; else a divisor of D, and rstd holds M * (D / group_size) values
};

// The *_quant operators' output: q ([M, D] contiguous, 1 byte an element) = y quantized as `spec` says, with the
// scales: the given float32 one (one element) or, dynamic, where the kernels write them (float32 [M, D / group] in
// the layout of spec's strides).
struct QuantArgs {
  at::Tensor q, scales;
  QuantSpec spec;
};

// Arguments of one forward call, already validated. x holds M rows of D contiguous elements, each where x_rows says
// (D apart: contiguous; else a slice, a chunk, the heads of a packed projection, transposed leading dimensions, a
// broadcast row); y is [M, D] contiguous;
// weight and bias are [D] contiguous or undefined; mean and rstd are [M] contiguous in the accumulation dtype (mean
// is undefined for RMSNorm). With a residual ([M, D] contiguous, of residual_out's dtype; x then contiguous too),
// the norm is of residual_out = x + residual, which the kernels write; otherwise both are undefined.
struct ForwardArgs {
  at::Tensor x, weight, bias;
  double eps;
  at::Tensor y, mean, rstd;
  int64_t rows, cols;
  at::Tensor residual, residual_out;
  RoundingOptions rounding;
  RowStrides x_rows;
  // With quant.q defined, y is also quantized into quant.q; y itself may then be undefined (not asked for: the CPU
  // kernels keep each row in a per-thread buffer, the CUDA kernels in a temporary).
  QuantArgs quant = {};
  GateArgs gate = {};  // RMSNorm only, on rows of the input (no residual, no quantized output)
};

// Arguments of one backward call. dy is [M, D] contiguous; x is read as in ForwardArgs (x_rows); mean/rstd
// as in ForwardArgs. dx ([M, D] contiguous), dweight, dbias are undefined when not requested. After a residual add,
// x is residual_out (contiguous), whose dtype may differ from dy's (then dx has x's); grad_residual_out, if defined
// ([M, D] contiguous, x's dtype), is added to dx.
struct BackwardArgs {
  at::Tensor dy, x, mean, rstd, weight;
  at::Tensor dx, dweight, dbias;
  int64_t rows, cols;
  at::Tensor grad_residual_out;
  RoundingOptions rounding;
  RowStrides x_rows;
  // memory_efficient: x holds the forward's output y instead of its input (a norm without bias), and the kernels
  // recover xhat as y * inverse_weight, inverse_weight = 1 / (weight + offset) in the accumulation dtype ([D]
  // contiguous; undefined without a weight: xhat = y). mean is not read then.
  bool from_output = false;
  at::Tensor inverse_weight;
  // A gated norm's gate (GateArgs, as the forward's) and the gradient of z ([M, D] contiguous; undefined when not
  // requested). With a gate, dx may be undefined while dgate is not.
  GateArgs gate = {};
  at::Tensor dgate;
};

// A contiguous tensor of `sizes` (at::empty).
at::Tensor empty_contiguous(at::IntArrayRef sizes, const at::TensorOptions& options);

// Whether the current stream of `t`'s device records a CUDA graph: never, on a backend without graphs.
inline bool never_capturing(const at::Tensor& /*t*/) { return false; }

// The kernels one backend provides, how it allocates the outputs shaped like the input (y, residual_out, dx), and
// whether a call may synchronize with the host now (not while its stream records a CUDA graph).
struct NormKernels {
  void (*forward)(NormKind, const ForwardArgs&);
  void (*backward)(NormKind, const BackwardArgs&);
  at::Tensor (*empty_rows)(at::IntArrayRef sizes, const at::TensorOptions& options) = &empty_contiguous;
  bool (*capturing)(const at::Tensor& t) = &never_capturing;
};

// Registers the operator schemas into `m` (the torch_ln library, or the
// emulated-CUDA test library, which shares the schemas).
void define_norm_schemas(torch::Library& m);

}  // namespace torch_ln
