// Entry points of the emulated CUDA kernels (emulated_forward.cpp, emulated_backward.cpp).
#pragma once

#include "../cuda/launch_plan.h"
#include "../norm.h"

namespace torch_ln {

// A small pretend GPU: two SMs, so that the backward's weight-gradient partial
// sums span several slots with several rows each even on small inputs, and a
// forward block walks many rows; an sm_90's 227 KB of shared memory a block and clusters of up to 8 blocks (the
// portable size; tests and the kernel model ask for 16).
// The kernel model (benchmarks/kernel_model.py) and the tests change it through
// torch_ln_emulated::set_device.
constexpr DeviceLimits kEmulatedDevice{2, 2048, 227 * 1024, kPortableClusterBlocks};
DeviceLimits& emulated_device();

void emulated_norm_forward(NormKind kind, const ForwardArgs& args);
void emulated_norm_backward(NormKind kind, const BackwardArgs& args);

}  // namespace torch_ln
