// The test-only emulated build: the CUDA kernels and their launch planning,
// compiled by the host compiler against the SIMT emulation, registered as the
// operators of a separate library (torch_ln_emulated) on CPU tensors.
#include "../norm_ops.h"
#include "emulated_kernels.h"

namespace torch_ln {

struct EmulatedBackend {
  static constexpr NormKernels kernels{&emulated_norm_forward, &emulated_norm_backward};
};

TORCH_LIBRARY(torch_ln_emulated, m) { define_norm_schemas(m); }

TORCH_LIBRARY_IMPL(torch_ln_emulated, CPU, m) { register_norm_ops<EmulatedBackend>(m); }

}  // namespace torch_ln
