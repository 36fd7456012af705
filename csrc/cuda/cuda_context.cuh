// Where a CUDA call runs: under a guard for the input's device, on its current
// stream, with that device's limits for launch planning. Nothing synchronizes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "launch_plan.h"

namespace torch_ln {

struct CudaLaunchContext {
  explicit CudaLaunchContext(const at::Tensor& input) : guard(input.device()) {
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    // Clusters where the device launches them: on sm_90 (H100/H200) of up to 16 blocks (non-portable: the
    // occupancy API then says how many fit), elsewhere of the portable 8.
    const int clusters = props->major == 9 ? kMaxClusterBlocks : kPortableClusterBlocks;
    limits = {props->multiProcessorCount, props->maxThreadsPerMultiProcessor, props->sharedMemPerBlockOptin,
              props->clusterLaunch ? clusters : 1};
    stream = at::cuda::getCurrentCUDAStream();
  }

  c10::cuda::CUDAGuard guard;
  DeviceLimits limits{};
  cudaStream_t stream{};
};

}  // namespace torch_ln
