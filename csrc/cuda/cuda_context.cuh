// Where a CUDA call runs: under a guard for the input's device, on its current
// stream, with that device's limits for launch planning. Nothing synchronizes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMacros.h>

#include <array>
#include <atomic>

#include "device.cuh"
#include "launch_plan.h"

namespace torch_ln {

namespace detail {
// Does nothing: the occupancy API's subject where it is asked where clusters fit.
static __global__ void cluster_probe_kernel() {}
}  // namespace detail

// The most blocks a cluster may have on the current device. sm_90 (H100/H200) launches clusters of up to 16 blocks
// (non-portable) where a GPC has 16 SMs free for them; the shared-memory kernels that use 16 take a whole SM a
// block, so the device is asked whether one such cluster fits at all (its GPCs' shapes decide; an answer of 0 would
// fail every launch of 16), else 8, the portable size. Cached per device.
inline int largest_cluster(const cudaDeviceProp& props) {
  if (!props.clusterLaunch) return 1;
  if (props.major != 9) return kPortableClusterBlocks;
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> known{};  // 0: not asked yet
  std::atomic<int>& known_here = known.at(c10::cuda::current_device());
  if (known_here.load(std::memory_order_relaxed) == 0) {
    const size_t whole_sm = props.sharedMemPerBlockOptin;  // one block an SM
    dev::allow_dynamic_shared(detail::cluster_probe_kernel, whole_sm, whole_sm);
    const int clusters =
        dev::resident_clusters(detail::cluster_probe_kernel, kMaxClusterBlocks, dev::kWarpSize, whole_sm, {});
    known_here.store(clusters > 0 ? kMaxClusterBlocks : kPortableClusterBlocks, std::memory_order_relaxed);
  }
  return known_here.load(std::memory_order_relaxed);
}

struct CudaLaunchContext {
  explicit CudaLaunchContext(const at::Tensor& input) : guard(input.device()) {
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    limits = {props->multiProcessorCount, props->maxThreadsPerMultiProcessor, props->sharedMemPerBlockOptin,
              largest_cluster(*props), props->sharedMemPerMultiprocessor};
    limits.device = c10::cuda::current_device();
    stream = at::cuda::getCurrentCUDAStream();
  }

  c10::cuda::CUDAGuard guard;
  DeviceLimits limits{};
  cudaStream_t stream{};
};

}  // namespace torch_ln
