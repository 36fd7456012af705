// Large CPU outputs (y, residual_out, dx) from a bounded cache of this library's freed outputs. Its public
// functions (empty_output_cache, output_cache_bytes) are declared in torch_ln/torch_ln.h.
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_ln {

// A contiguous CPU tensor for a kernel to write whole: from the output cache when it is large, else at::empty.
at::Tensor empty_cpu_output(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace torch_ln
