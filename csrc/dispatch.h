// The one place where runtime dtypes become kernel template types, shared by
// the CPU, CUDA and emulated-CUDA backends.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace torch_ln {

// The input/output element type T and the weight/bias element type W of a call,
// and R, the element type of the rows the norm reads and dx: T, or after a
// residual add, the residual stream's (residual_out's).
template <typename T, typename W, typename R = T>
struct DtypePair {
  using input_t = T;
  using param_t = W;
  using row_t = R;
  // Statistics and partial sums: float64 for float64 input, float32 otherwise.
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
};

// The dtype of weight and bias, or the input's when there are none.
inline at::ScalarType parameter_dtype(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  if (weight.defined()) return weight.scalar_type();
  if (bias.defined()) return bias.scalar_type();
  return input.scalar_type();
}

// Calls f(DtypePair<T, W>{}) for the supported combinations: W == T, or
// W == float with a half or bfloat16 T (mixed precision).
template <typename F>
void dispatch_norm_dtypes(at::ScalarType input, at::ScalarType param, F&& f) {
  const bool float_params = param == at::kFloat;
  switch (input) {
    case at::kFloat:
      return f(DtypePair<float, float>{});
    case at::kDouble:
      return f(DtypePair<double, double>{});
    case at::kHalf:
      return float_params ? f(DtypePair<c10::Half, float>{}) : f(DtypePair<c10::Half, c10::Half>{});
    case at::kBFloat16:
      return float_params ? f(DtypePair<c10::BFloat16, float>{}) : f(DtypePair<c10::BFloat16, c10::BFloat16>{});
    default:
      TORCH_CHECK_TYPE(false, "torch_ln: unsupported input dtype ", input);
  }
}

// Calls f(types) with row_t set to `row`: T itself, or float for a float32
// residual stream under half or bfloat16 input (the only other combination
// the operators accept).
template <typename Types, typename F>
void dispatch_row_dtype(Types types, at::ScalarType row, F&& f) {
  using T = typename Types::input_t;
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    if (row == at::kFloat) return f(DtypePair<T, typename Types::param_t, float>{});
  }
  return f(types);
}

}  // namespace torch_ln
