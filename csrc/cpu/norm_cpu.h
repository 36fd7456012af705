// CPU kernels: vectorized with at::vec, parallel over rows with at::parallel_for.
#pragma once

#include "../norm.h"

namespace torch_ln {

void cpu_norm_forward(NormKind kind, const ForwardArgs& args);
void cpu_norm_backward(NormKind kind, const BackwardArgs& args);

}  // namespace torch_ln
