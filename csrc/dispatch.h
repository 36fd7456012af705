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

// The combinations of input, parameter and row dtypes that the operators accept (their checks refuse the others),
// as X(T, W[, R]) (DtypePair's arguments), for dispatch_dtypes and the CPU kernels' per-dtype files (norm_cpu.h).
// float32 and float64 inputs: parameters and rows of the input's dtype.
#define TORCH_LN_FOR_FULL_PRECISION(X) X(float, float) X(double, double)
// A half-precision input dtype T: T or float32 parameters (mixed precision), each with rows (the residual stream
// after an add) of T or float32.
#define TORCH_LN_FOR_HALF_PRECISION(X, T) X(T, T) X(T, float) X(T, T, float) X(T, float, float)
#define TORCH_LN_FOR_EACH_DTYPE_COMBINATION(X) \
  TORCH_LN_FOR_FULL_PRECISION(X) TORCH_LN_FOR_HALF_PRECISION(X, c10::Half) TORCH_LN_FOR_HALF_PRECISION(X, c10::BFloat16)

template <typename Types>
bool has_dtypes(at::ScalarType input, at::ScalarType param, at::ScalarType rows) {
  return input == c10::CppTypeToScalarType<typename Types::input_t>::value &&
         param == c10::CppTypeToScalarType<typename Types::param_t>::value &&
         rows == c10::CppTypeToScalarType<typename Types::row_t>::value;
}

// Calls f(DtypePair<T, W, R>{}) for the input, parameter and row dtypes of a call (rows: x's, or after a residual
// add, residual_out's), one of TORCH_LN_FOR_EACH_DTYPE_COMBINATION's.
template <typename F>
void dispatch_dtypes(at::ScalarType input, at::ScalarType param, at::ScalarType rows, F&& f) {
#define TORCH_LN_CALL_IF_DTYPES(...) \
  if (has_dtypes<DtypePair<__VA_ARGS__>>(input, param, rows)) return f(DtypePair<__VA_ARGS__>{});
  TORCH_LN_FOR_EACH_DTYPE_COMBINATION(TORCH_LN_CALL_IF_DTYPES)
#undef TORCH_LN_CALL_IF_DTYPES
  TORCH_CHECK_TYPE(false, "torch_ln: unsupported dtypes: input ", input, ", parameters ", param, ", rows ", rows);
}

}  // namespace torch_ln
