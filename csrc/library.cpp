// The torch_ln operator library: schemas and the CPU implementations. The CUDA
// implementations register themselves in csrc/cuda/register_cuda.cpp.
// No Python here: this file is part of libtorch_ln, which C++ programs link
// and the Python package loads with torch.ops.load_library.
#include <torch_ln/torch_ln.h>

#include "cpu/norm_cpu.h"
#include "cpu/output_cache.h"
#include "norm_ops.h"

namespace torch_ln {

struct CpuBackend {
  static constexpr NormKernels kernels{&cpu_norm_forward, &cpu_norm_backward, &empty_cpu_output};
};

TORCH_LIBRARY(torch_ln, m) {
  define_norm_schemas(m);
  // The CPU output cache (cpu/output_cache.h), for torch_ln.empty_output_cache and output_cache_bytes.
  m.def("empty_output_cache() -> int", &empty_output_cache);
  m.def("output_cache_bytes() -> int", &output_cache_bytes);
}

TORCH_LIBRARY_IMPL(torch_ln, CPU, m) {
  register_norm_ops<CpuBackend>(m);
  register_gated_norm_ops<CpuBackend>(m);
}

}  // namespace torch_ln
