// The torch_ln operator library: schemas and the CPU implementations. The CUDA
// implementations register themselves in csrc/cuda/register_cuda.cpp.
// No Python here: this file is part of libtorch_ln, which C++ programs link
// and the Python package loads with torch.ops.load_library.
#include "cpu/norm_cpu.h"
#include "norm_ops.h"

namespace torch_ln {

struct CpuBackend {
  static constexpr NormKernels kernels{&cpu_norm_forward, &cpu_norm_backward};
};

TORCH_LIBRARY(torch_ln, m) { define_norm_schemas(m); }

TORCH_LIBRARY_IMPL(torch_ln, CPU, m) { register_norm_ops<CpuBackend>(m); }

}  // namespace torch_ln
