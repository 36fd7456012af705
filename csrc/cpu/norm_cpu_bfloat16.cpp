// The CPU kernels for bfloat16 input, with each parameter and row dtype it takes.
#include "norm_cpu_kernels.h"

namespace torch_ln {

TORCH_LN_FOR_HALF_PRECISION(TORCH_LN_DEFINE_CPU_KERNELS, c10::BFloat16)

}  // namespace torch_ln
