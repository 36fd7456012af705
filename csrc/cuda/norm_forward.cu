#include "cuda_context.cuh"
#include "forward_launch.h"
#include "norm_cuda.h"

namespace torch_ln {

void cuda_norm_forward(NormKind kind, const ForwardArgs& args) {
  const CudaLaunchContext context(args.x);
  launch_norm_forward(kind, args, context.limits, context.stream);
}

}  // namespace torch_ln
