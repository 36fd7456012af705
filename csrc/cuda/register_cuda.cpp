// The CUDA implementations of the torch_ln operators register themselves here.
#include "../norm_ops.h"
#include "norm_cuda.h"

namespace torch_ln {

struct CudaBackend {
  static constexpr NormKernels kernels{&cuda_norm_forward, &cuda_norm_backward};
};

TORCH_LIBRARY_IMPL(torch_ln, CUDA, m) {
  register_norm_ops<CudaBackend>(m);
  register_gated_norm_ops<CudaBackend>(m);
}

}  // namespace torch_ln
