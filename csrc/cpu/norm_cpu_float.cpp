// The CPU kernels for float32 and float64 input (with parameters and rows of the same dtype).
#include "norm_cpu_kernels.h"

namespace torch_ln {

TORCH_LN_FOR_FULL_PRECISION(TORCH_LN_DEFINE_CPU_KERNELS)

}  // namespace torch_ln
