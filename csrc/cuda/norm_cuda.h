// CUDA entry points of the torch_ln operators (csrc/cuda/*.cu).
#pragma once

#include "../norm.h"

namespace torch_ln {

void cuda_norm_forward(NormKind kind, const ForwardArgs& args);
void cuda_norm_backward(NormKind kind, const BackwardArgs& args);

}  // namespace torch_ln
