// The torch_ln C++ API. Link the CMake target torch_ln::torch_ln (find_package(torch_ln)); that alone
// registers the torch_ln operators, so torch::Dispatcher and AOTInductor packages find them.
//
// Every function calls its operator through the dispatcher: CPU and CUDA tensors both work.
// layer_norm, rms_norm, add_layer_norm and add_rms_norm are differentiable (torch::autograd, first order; double
// backward needs the Python package, which registers the *_fwd operators' differentiable formula). The *_fwd and
// *_bwd functions are the raw kernels: outputs with their statistics, and gradients from those statistics.
// A new operator gets its declaration here, its definition in csrc/api.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>

#if defined(_WIN32)
#define TORCH_LN_API
#else
#define TORCH_LN_API __attribute__((visibility("default")))
#endif

namespace torch_ln {

// As torch::layer_norm: normalizes over the trailing normalized_shape dimensions of input. weight_offset: the weight
// enters as (weight + weight_offset), zero-centred weights (1 + w), as in Python's torch_ln.layer_norm.
TORCH_LN_API at::Tensor layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                   const std::optional<at::Tensor>& weight = std::nullopt,
                                   const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5,
                                   double weight_offset = 0.0);

// As torch::rms_norm; eps = nullopt is torch's default, the machine epsilon of the accumulation dtype.
// weight_offset and round_normalized reproduce Gemma's and Llama's rounding, as in Python's torch_ln.rms_norm.
TORCH_LN_API at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                 const std::optional<at::Tensor>& weight = std::nullopt,
                                 std::optional<double> eps = std::nullopt, double weight_offset = 0.0,
                                 bool round_normalized = false);

// Residual add and norm in one pass: (y, residual_out) with residual_out = input + residual in residual_dtype
// (default: input's dtype; float32 with half/bfloat16 input) and y = layer_norm(residual_out) in input's dtype.
TORCH_LN_API std::tuple<at::Tensor, at::Tensor> add_layer_norm(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight = std::nullopt, const std::optional<at::Tensor>& bias = std::nullopt,
    double eps = 1e-5, std::optional<at::ScalarType> residual_dtype = std::nullopt, double weight_offset = 0.0);

// As add_layer_norm, with rms_norm (and its rounding options).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight = std::nullopt, std::optional<double> eps = std::nullopt,
    std::optional<at::ScalarType> residual_dtype = std::nullopt, double weight_offset = 0.0,
    bool round_normalized = false);

// The operator torch_ln::layer_norm_fwd: (output, mean, rstd), statistics in float32 (float64 for float64
// input) with the input's batch dimensions and a 1 for each normalized dimension, as aten::native_layer_norm.
// memory_efficient changes no result: it tells the operator's Python autograd to save the output (see the README).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, double weight_offset = 0, bool memory_efficient = false);

// The operator torch_ln::layer_norm_bwd: (grad_input, grad_weight, grad_bias) from layer_norm_fwd's statistics.
// A gradient not asked for in output_mask (or without its parameter) comes back as an empty tensor. from_output:
// `input` is the forward's output y, from which the normalized input is recovered as (y - bias) / (weight +
// weight_offset) (every weight + weight_offset nonzero, else an error).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape, const at::Tensor& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> output_mask, double weight_offset = 0, bool from_output = false);

// The operator torch_ln::rms_norm_fwd: (output, rstd). weight_offset and round_normalized reproduce other
// libraries' rounding (see the README: Gemma's 1 + weight, Llama's rounding before the weight product).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                             const std::optional<at::Tensor>& weight,
                                                             std::optional<double> eps, double weight_offset = 0,
                                                             bool round_normalized = false,
                                                             bool memory_efficient = false);

// The operator torch_ln::rms_norm_bwd: (grad_input, grad_weight), as layer_norm_bwd (from_output: y / (weight +
// weight_offset)).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_out, const at::Tensor& input,
                                                             at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                             const std::optional<at::Tensor>& weight,
                                                             std::array<bool, 2> output_mask, double weight_offset = 0,
                                                             bool round_normalized = false, bool from_output = false);

// The operator torch_ln::gated_rms_norm_fwd: (output, rstd), rstd per row and group. gate_position "after":
// rms_norm(input) * act(gate), "before": rms_norm(input * act(gate)); activation "silu" or "sigmoid"; group_size (a
// divisor of the normalized size): each group of a row has its own rstd. As Python's torch_ln.gated_rms_norm (CPU
// kernels only, for now).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor> gated_rms_norm_fwd(
    const at::Tensor& input, const std::optional<at::Tensor>& gate, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps, std::string_view gate_position = "after",
    std::string_view activation = "silu", std::optional<int64_t> group_size = std::nullopt,
    bool round_normalized = false);

// The operator torch_ln::gated_rms_norm_bwd: (grad_input, grad_gate, grad_weight); output_mask in that order.
TORCH_LN_API std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rms_norm_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& gate,
    at::IntArrayRef normalized_shape, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    std::array<bool, 3> output_mask, std::string_view gate_position = "after", std::string_view activation = "silu",
    std::optional<int64_t> group_size = std::nullopt, bool round_normalized = false);

// The operator torch_ln::add_layer_norm_fwd: (output, residual_out, mean, rstd).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    std::optional<at::ScalarType> residual_dtype, double weight_offset = 0);

// The operator torch_ln::add_layer_norm_bwd: (grad of residual_out, which is that of input and of residual, in
// residual_out's dtype; grad_weight; grad_bias). grad_residual_out (undefined: none) is added to the first.
TORCH_LN_API std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layer_norm_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out, const at::Tensor& residual_out,
    at::IntArrayRef normalized_shape, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask,
    double weight_offset = 0);

// The operator torch_ln::add_rms_norm_fwd: (output, residual_out, rstd).
TORCH_LN_API std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_fwd(
    const at::Tensor& input, const at::Tensor& residual, at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps, std::optional<at::ScalarType> residual_dtype,
    double weight_offset = 0, bool round_normalized = false);

// The operator torch_ln::add_rms_norm_bwd: (grad of residual_out, grad_weight), as add_layer_norm_bwd.
TORCH_LN_API std::tuple<at::Tensor, at::Tensor> add_rms_norm_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out, const at::Tensor& residual_out,
    at::IntArrayRef normalized_shape, const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    std::array<bool, 2> output_mask, double weight_offset = 0, bool round_normalized = false);

// How the *_quant functions quantize y, as the keyword arguments of Python's torch_ln.rms_norm_quant: out_dtype
// float8_e4m3fn, float8_e5m2 or int8; a static scale (a float32 tensor of one element) or dynamic scales, per token
// (the default) or per group of group_size elements, capped by scale_ub, rounded up to a power of two (scale_ue8m0),
// laid out column-major (scales_column_major); y returned as well where return_unquantized. Inference only.
struct QuantOptions {
  at::ScalarType out_dtype = at::kFloat8_e4m3fn;
  std::optional<at::Tensor> scale = std::nullopt;
  std::optional<int64_t> group_size = std::nullopt;
  std::optional<double> scale_ub = std::nullopt;
  bool scale_ue8m0 = false;
  bool scales_column_major = false;
  bool return_unquantized = false;
};

// A quantized norm's outputs, as Python's torch_ln.QuantizedNorm: q; its scales (the static scale as given, or the
// dynamic ones, float32 [*, groups]); y where return_unquantized, and residual_out after a residual add (else
// undefined).
struct QuantizedNorm {
  at::Tensor q, scale, y, residual_out;
};

// rms_norm, layer_norm, add_rms_norm and add_layer_norm with a quantized output (the *_quant operators).
TORCH_LN_API QuantizedNorm rms_norm_quant(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                          const QuantOptions& quant,
                                          const std::optional<at::Tensor>& weight = std::nullopt,
                                          std::optional<double> eps = std::nullopt, double weight_offset = 0.0,
                                          bool round_normalized = false);
TORCH_LN_API QuantizedNorm layer_norm_quant(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                            const QuantOptions& quant,
                                            const std::optional<at::Tensor>& weight = std::nullopt,
                                            const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5,
                                            double weight_offset = 0.0);
TORCH_LN_API QuantizedNorm add_rms_norm_quant(const at::Tensor& input, const at::Tensor& residual,
                                              at::IntArrayRef normalized_shape, const QuantOptions& quant,
                                              const std::optional<at::Tensor>& weight = std::nullopt,
                                              std::optional<double> eps = std::nullopt,
                                              std::optional<at::ScalarType> residual_dtype = std::nullopt,
                                              double weight_offset = 0.0, bool round_normalized = false);
TORCH_LN_API QuantizedNorm add_layer_norm_quant(const at::Tensor& input, const at::Tensor& residual,
                                                at::IntArrayRef normalized_shape, const QuantOptions& quant,
                                                const std::optional<at::Tensor>& weight = std::nullopt,
                                                const std::optional<at::Tensor>& bias = std::nullopt, double eps = 1e-5,
                                                std::optional<at::ScalarType> residual_dtype = std::nullopt,
                                                double weight_offset = 0.0);

// The CPU output cache: freed CPU outputs (y, residual_out, dx) of 1 MiB or more, kept for the next call of the same
// size (up to TORCH_LN_OUTPUT_CACHE_MB, default 256; 0 turns it off). empty_output_cache returns them to the system
// allocator and the bytes they held; output_cache_bytes is the bytes held now.
TORCH_LN_API int64_t empty_output_cache();
TORCH_LN_API int64_t output_cache_bytes();

}  // namespace torch_ln
