// The CUDA side of the *_quant operators: y, as the forward kernel wrote it, quantized by a second kernel (a warp
// per scale group). Not yet fused into the forward kernels' epilogue: y makes one more round trip through memory.
#pragma once

#include "../quantize.h"
#include "launch_plan.h"
#include "reduce.cuh"

namespace torch_ln {

template <typename T>
struct QuantizeParams {
  const T* y;  // [rows, cols] contiguous
  uint8_t* q;
  float* scales;              // dynamic: written (spec's strides)
  const float* static_scale;  // static: read on the device (no host synchronization)
  int64_t rows, cols;
  QuantSpec spec;
};

// amax over the lanes of a warp: the xor butterfly folds the same pairs in every lane, so all get the same value.
TLN_DEVICE float warp_abs_max(float running) {
  for (int offset = dev::kWarpSize / 2; offset > 0; offset /= 2) {
    running = fold_abs_max(running, dev::shfl_xor(running, offset));
  }
  return running;
}

// A warp per group of one row (per token: the whole row, or with a static scale), its lanes walking the group's
// elements in turn (coalesced); the warps of the grid walk the groups of all rows.
template <typename T>
TLN_KERNEL void quantize_rows_kernel(QuantizeParams<T> p) {
  const int lane = static_cast<int>(dev::thread_x()) % dev::kWarpSize;
  const int64_t warps_per_block = dev::block_dim_x() / dev::kWarpSize;
  const int64_t first_warp = int64_t{dev::block_x()} * warps_per_block + dev::thread_x() / dev::kWarpSize;
  const int64_t group = p.spec.dynamic ? p.spec.group : p.cols;
  const int64_t groups_per_row = p.cols / group;
  for (int64_t unit = first_warp; unit < p.rows * groups_per_row;
       unit += int64_t{dev::grid_dim_x()} * warps_per_block) {
    const int64_t row = unit / groups_per_row, g = unit % groups_per_row;
    const int64_t first = row * p.cols + g * group;
    float scale;
    if (p.spec.dynamic) {
      float amax = 0.0f;
      for (int64_t j = lane; j < group; j += dev::kWarpSize) {
        amax = fold_abs_max(amax, static_cast<float>(dev::load_global(p.y + first + j)));
      }
      scale = dynamic_scale(warp_abs_max(amax), p.spec);
      if (lane == 0) dev::store_global(p.scales + row * p.spec.scale_row_stride + g * p.spec.scale_group_stride, scale);
    } else {
      scale = dev::load_global(p.static_scale);
    }
    const float inverse_scale = 1.0f / scale;
    for (int64_t j = lane; j < group; j += dev::kWarpSize) {
      dev::store_global(p.q + first + j, quantize_value(static_cast<float>(dev::load_global(p.y + first + j)),
                                                        inverse_scale, p.spec.format));
    }
  }
}

constexpr int kQuantizeThreads = 256;

// Quantizes y (the forward's output, [rows, cols] contiguous, of the input's dtype) into quant.q.
template <typename T>
void launch_quantize_rows(const at::Tensor& y, const QuantArgs& quant, int64_t rows, int64_t cols,
                          const DeviceLimits& limits, dev::Stream stream) {
  const QuantizeParams<T> p{y.const_data_ptr<T>(),
                            reinterpret_cast<uint8_t*>(quant.q.mutable_data_ptr()),
                            quant.spec.dynamic ? quant.scales.mutable_data_ptr<float>() : nullptr,
                            quant.spec.dynamic ? nullptr : quant.scales.const_data_ptr<float>(),
                            rows,
                            cols,
                            quant.spec};
  const int64_t units = rows * (quant.spec.dynamic ? cols / quant.spec.group : 1);
  constexpr int64_t warps_per_block = kQuantizeThreads / dev::kWarpSize;
  // Enough blocks to fill the device twice over; each warp walks units beyond that.
  const int64_t most = int64_t{limits.num_sms} * 2 * limits.max_threads_per_sm / kQuantizeThreads;
  const auto blocks = static_cast<unsigned>(std::min(ceil_div(units, warps_per_block), std::max<int64_t>(most, 1)));
  dev::launch(&quantize_rows_kernel<T>, dev::Dim3{blocks}, dev::Dim3{kQuantizeThreads}, 0, stream, p);
}

}  // namespace torch_ln
