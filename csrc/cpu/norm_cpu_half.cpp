// The CPU kernels for half input, with each parameter and row dtype it takes.
#include "norm_cpu_kernels.h"

namespace torch_ln {

TORCH_LN_FOR_HALF_PRECISION(TORCH_LN_DEFINE_CPU_KERNELS, c10::Half)

}  // namespace torch_ln
