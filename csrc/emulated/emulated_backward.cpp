#include "../cuda/backward_launch.h"
#include "emulated_kernels.h"

namespace torch_ln {

void emulated_norm_backward(NormKind kind, const BackwardArgs& args) {
  launch_norm_backward(kind, args, emulated_device(), dev::Stream{});
}

}  // namespace torch_ln
