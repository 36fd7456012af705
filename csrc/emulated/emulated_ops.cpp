// The test-only emulated build: the CUDA kernels and their launch planning,
// compiled by the host compiler against the SIMT emulation, registered as the
// operators of a separate library (torch_ln_emulated) on CPU tensors.
#include "../cuda/launch.h"
#include "../norm_ops.h"

namespace torch_ln {

namespace {

// A small pretend GPU: two SMs, so that the backward's weight-gradient partial
// sums span several slots with several rows each even on small inputs.
constexpr DeviceLimits kEmulatedDevice{2, 2048};

void emulated_forward(NormKind kind, const ForwardArgs& args) {
  launch_norm_forward(kind, args, kEmulatedDevice, dev::Stream{});
}

void emulated_backward(NormKind kind, const BackwardArgs& args) {
  launch_norm_backward(kind, args, kEmulatedDevice, dev::Stream{});
}

struct EmulatedBackend {
  static constexpr NormKernels kernels{&emulated_forward, &emulated_backward};
};

}  // namespace

TORCH_LIBRARY(torch_ln_emulated, m) { define_norm_schemas(m); }

TORCH_LIBRARY_IMPL(torch_ln_emulated, CPU, m) { register_norm_ops<EmulatedBackend>(m); }

}  // namespace torch_ln
