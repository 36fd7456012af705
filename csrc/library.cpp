// The torch_ln operator library: schemas and the CPU implementations. The CUDA
// implementations register themselves in csrc/cuda/norm_cuda.cu.
#include <Python.h>

#include "cpu/norm_cpu.h"
#include "norm_ops.h"

namespace torch_ln {

struct CpuBackend {
  static constexpr NormKernels kernels{&cpu_norm_forward, &cpu_norm_backward};
};

TORCH_LIBRARY(torch_ln, m) { define_norm_schemas(m); }

TORCH_LIBRARY_IMPL(torch_ln, CPU, m) { register_norm_ops<CpuBackend>(m); }

}  // namespace torch_ln

// `import torch_ln._C` loads this library, which runs the registrations above.
extern "C" PyObject* PyInit__C() {
  static PyModuleDef module{PyModuleDef_HEAD_INIT, "_C", "torch_ln operator library", -1, nullptr};
  return PyModule_Create(&module);
}
