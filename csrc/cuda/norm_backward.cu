#include "backward_launch.h"
#include "cuda_context.cuh"
#include "norm_cuda.h"

namespace torch_ln {

void cuda_norm_backward(NormKind kind, const BackwardArgs& args) {
  const CudaLaunchContext context(args.x);
  launch_norm_backward(kind, args, context.limits, context.stream);
}

}  // namespace torch_ln
