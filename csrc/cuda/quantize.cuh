// The CUDA side of the *_quant operators: y quantized in the forward kernels' epilogue (forward.cuh), and, where the
// forward cannot (launch_forward_typed), a second kernel over y (a warp per scale group).
#pragma once

#include "../quantize.h"
#include "launch_plan.h"
#include "reduce.cuh"

namespace torch_ln {

// Where and how y is quantized: q ([rows, cols] contiguous) and the scales (QuantArgs).
struct QuantOutput {
  uint8_t* q = nullptr;
  float* scales = nullptr;              // dynamic: written (spec's strides)
  const float* static_scale = nullptr;  // static: read on the device (no host synchronization)
  QuantSpec spec;
};

// An accumulator value of y as y stores it (rounded to T), in float: what is quantized.
template <typename T, typename acc_t>
TLN_DEVICE float stored_float(acc_t v) {
  return static_cast<float>(static_cast<T>(v));
}

// VEC values of y as stored (stored_float) into `stored`, and their amax.
template <typename T, int VEC, typename acc_t>
TLN_DEVICE acc_t stored_floats(const acc_t (&v)[VEC], float (&stored)[VEC]) {
  acc_t amax = acc_t(0);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    stored[j] = stored_float<T>(v[j]);
    amax = fold_abs_max(amax, static_cast<acc_t>(stored[j]));
  }
  return amax;
}

// Stores the codes of VEC consecutive values of y (element offset i of q) scaled by inverse_scale.
template <int VEC>
TLN_DEVICE void store_codes(const QuantOutput& out, int64_t i, const float (&y)[VEC], float inverse_scale) {
  Vec<uint8_t, VEC> codes;
#pragma unroll
  for (int j = 0; j < VEC; ++j) codes.v[j] = quantize_value(y[j], inverse_scale, out.spec.format);
  dev::store_global(reinterpret_cast<Vec<uint8_t, VEC>*>(out.q + i), codes);
}

template <typename T>
struct QuantizeParams {
  const T* y;  // [rows, cols] contiguous
  QuantOutput out;
  int64_t rows, cols;
};

// A warp per group of one row (per token or with a static scale: the whole row), its lanes walking the group's
// elements in turn (coalesced); the warps of the grid walk the groups of all rows.
template <typename T>
TLN_KERNEL void quantize_rows_kernel(QuantizeParams<T> p) {
  const int lane = static_cast<int>(dev::thread_x()) % dev::kWarpSize;
  const int64_t warps_per_block = dev::block_dim_x() / dev::kWarpSize;
  const int64_t first_warp = int64_t{dev::block_x()} * warps_per_block + dev::thread_x() / dev::kWarpSize;
  const QuantSpec& spec = p.out.spec;
  const int64_t group = spec.dynamic ? spec.group : p.cols;
  const int64_t groups_per_row = p.cols / group;
  for (int64_t unit = first_warp; unit < p.rows * groups_per_row;
       unit += int64_t{dev::grid_dim_x()} * warps_per_block) {
    const int64_t row = unit / groups_per_row, g = unit % groups_per_row;
    const int64_t first = row * p.cols + g * group;
    float scale;
    if (spec.dynamic) {
      float amax = 0.0f;
      for (int64_t j = lane; j < group; j += dev::kWarpSize) {
        amax = fold_abs_max(amax, static_cast<float>(dev::load_global(p.y + first + j)));
      }
      scale = dynamic_scale(warp_reduce(amax, dev::kWarpSize, AbsMax{}), spec);
      if (lane == 0) dev::store_global(p.out.scales + row * spec.scale_row_stride + g * spec.scale_group_stride, scale);
    } else {
      scale = dev::load_global(p.out.static_scale);
    }
    for (int64_t j = lane; j < group; j += dev::kWarpSize) {
      const float y[1] = {static_cast<float>(dev::load_global(p.y + first + j))};
      store_codes<1>(p.out, first + j, y, 1.0f / scale);
    }
  }
}

constexpr int kQuantizeThreads = 256;

// Quantizes y (the forward's output, [rows, cols] contiguous, of the input's dtype).
template <typename T>
void launch_quantize_rows(const T* y, const QuantOutput& out, int64_t rows, int64_t cols, const DeviceLimits& limits,
                          dev::Stream stream) {
  const QuantizeParams<T> p{y, out, rows, cols};
  const int64_t units = rows * (out.spec.dynamic ? cols / out.spec.group : 1);
  constexpr int64_t warps_per_block = kQuantizeThreads / dev::kWarpSize;
  // Enough blocks to fill the device twice over; each warp walks units beyond that.
  const int64_t most = int64_t{limits.num_sms} * 2 * limits.max_threads_per_sm / kQuantizeThreads;
  const auto blocks = static_cast<unsigned>(std::min(ceil_div(units, warps_per_block), std::max<int64_t>(most, 1)));
  dev::launch(&quantize_rows_kernel<T>, dev::Dim3{blocks}, dev::Dim3{kQuantizeThreads}, 0, stream, p);
}

}  // namespace torch_ln
