// CPU kernels: vectorized with at::vec, parallel over rows with at::parallel_for.
#pragma once

#include "../dispatch.h"
#include "../norm.h"

namespace torch_ln {

void cpu_norm_forward(NormKind kind, const ForwardArgs& args);
void cpu_norm_backward(NormKind kind, const BackwardArgs& args);

// The kernels of one dtype combination (Types: a DtypePair), both kinds: specialized for each combination that
// dispatch_norm_dtypes and dispatch_row_dtype give, in the norm_cpu_<dtype>.cpp of its input dtype
// (TORCH_LN_DEFINE_CPU_KERNELS, norm_cpu_kernels.h).
template <typename Types>
void cpu_forward(NormKind kind, const ForwardArgs& args);
template <typename Types>
void cpu_backward(NormKind kind, const BackwardArgs& args);

// X(T, W[, R]) for each combination of a half-precision input dtype T: T or float32 parameters (mixed precision),
// each with rows (the residual stream after an add) of T or float32.
#define TORCH_LN_FOR_HALF_PRECISION(X, T) X(T, T) X(T, float) X(T, T, float) X(T, float, float)

// The specializations, declared before any use.
#define TORCH_LN_DECLARE_CPU_KERNELS(...)                                           \
  template <>                                                                       \
  void cpu_forward<DtypePair<__VA_ARGS__>>(NormKind kind, const ForwardArgs& args); \
  template <>                                                                       \
  void cpu_backward<DtypePair<__VA_ARGS__>>(NormKind kind, const BackwardArgs& args);
TORCH_LN_DECLARE_CPU_KERNELS(float, float)
TORCH_LN_DECLARE_CPU_KERNELS(double, double)
TORCH_LN_FOR_HALF_PRECISION(TORCH_LN_DECLARE_CPU_KERNELS, c10::Half)
TORCH_LN_FOR_HALF_PRECISION(TORCH_LN_DECLARE_CPU_KERNELS, c10::BFloat16)
#undef TORCH_LN_DECLARE_CPU_KERNELS

}  // namespace torch_ln
