// The CUDA implementations of the torch_ln operators register themselves here.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "../norm_ops.h"
#include "norm_cuda.h"

namespace torch_ln {

// Whether the current stream of `t`'s device records a CUDA graph (which forbids host synchronization).
bool cuda_stream_capturing(const at::Tensor& t) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(t.device().index()), &status));
  return status != cudaStreamCaptureStatusNone;
}

struct CudaBackend {
  static constexpr NormKernels kernels{&cuda_norm_forward, &cuda_norm_backward, &empty_contiguous,
                                       &cuda_stream_capturing};
};

TORCH_LIBRARY_IMPL(torch_ln, CUDA, m) {
  register_norm_ops<CudaBackend>(m);
  register_gated_norm_ops<CudaBackend>(m);
}

}  // namespace torch_ln
