// CPU kernels: vectorized with at::vec, parallel over rows with at::parallel_for.
#pragma once

#include "../dispatch.h"
#include "../norm.h"

namespace torch_ln {

void cpu_norm_forward(NormKind kind, const ForwardArgs& args);
void cpu_norm_backward(NormKind kind, const BackwardArgs& args);

// The kernels of one dtype combination (Types: a DtypePair), both kinds: specialized for each of
// TORCH_LN_FOR_EACH_DTYPE_COMBINATION (dispatch.h), in the norm_cpu_<dtype>.cpp of its input dtype
// (TORCH_LN_DEFINE_CPU_KERNELS, norm_cpu_kernels.h).
template <typename Types>
void cpu_forward(NormKind kind, const ForwardArgs& args);
template <typename Types>
void cpu_backward(NormKind kind, const BackwardArgs& args);

// The specializations, declared before any use.
#define TORCH_LN_DECLARE_CPU_KERNELS(...)                                           \
  template <>                                                                       \
  void cpu_forward<DtypePair<__VA_ARGS__>>(NormKind kind, const ForwardArgs& args); \
  template <>                                                                       \
  void cpu_backward<DtypePair<__VA_ARGS__>>(NormKind kind, const BackwardArgs& args);
TORCH_LN_FOR_EACH_DTYPE_COMBINATION(TORCH_LN_DECLARE_CPU_KERNELS)
#undef TORCH_LN_DECLARE_CPU_KERNELS

}  // namespace torch_ln
