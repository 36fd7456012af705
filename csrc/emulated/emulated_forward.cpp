#include "../cuda/forward_launch.h"
#include "emulated_kernels.h"

namespace torch_ln {

void emulated_norm_forward(NormKind kind, const ForwardArgs& args) {
  launch_norm_forward(kind, args, emulated_device(), dev::Stream{});
}

}  // namespace torch_ln
