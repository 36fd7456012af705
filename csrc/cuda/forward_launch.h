// Host side of the forward kernels: plan, pick the template instance, launch.
#pragma once

#include <ATen/Dispatch.h>

#include "forward.cuh"
#include "launch_common.h"
#include "quantize.cuh"

namespace torch_ln {

// Where the forward may stage rows too long for registers: rows of R (what is normalized) and the parameter rows
// given in the device's shared memory per block, over clusters where it has them.
template <typename acc_t, typename R, typename W>
SharedRowSpace forward_shared_row_space(bool weight, bool bias, const DeviceLimits& limits) {
  return {sizeof(R),     int{weight} + int{bias},     sizeof(W),
          sizeof(acc_t), limits.max_shared_per_block, limits.max_cluster_blocks};
}

template <typename Types>
void launch_forward_typed(NormKind kind, const ForwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  using T = typename Types::input_t;
  using W = typename Types::param_t;
  using acc_t = typename Types::acc_t;
  using R = typename Types::row_t;
  ForwardParams<T, W, acc_t, R> p{a.x.const_data_ptr<T>(),
                                  data_or_null<W>(a.weight),
                                  data_or_null<W>(a.bias),
                                  a.y.mutable_data_ptr<T>(),
                                  mutable_data_or_null<acc_t>(a.mean),
                                  a.rstd.mutable_data_ptr<acc_t>(),
                                  a.rows,
                                  a.cols,
                                  static_cast<acc_t>(a.eps),
                                  0,
                                  data_or_null<R>(a.residual),
                                  mutable_data_or_null<R>(a.residual_out),
                                  {static_cast<acc_t>(a.rounding.weight_offset), a.rounding.round_normalized},
                                  false,
                                  0,
                                  0,
                                  a.x_rows};
  // A strided x is read in 16-byte vectors where every row starts 16-byte aligned, as its base does.
  const bool vec_ok = vectorizable<T, W>(a.cols, {p.x, p.y}, {p.weight, p.bias}) &&
                      vectorizable<T, R>(a.cols, {}, {p.residual, p.residual_out}) &&
                      a.x_rows.multiple_of(kVectorBytes / static_cast<int64_t>(sizeof(T)));
  RowPlan plan = plan_rows(a.rows, a.cols, sizeof(T), vec_ok, ForwardKernels<T, W, acc_t, R>::budget,
                           forward_shared_row_space<acc_t, R, W>(p.weight != nullptr, p.bias != nullptr, limits));
  p.threads_per_row = plan.threads_per_row;
  p.cluster_blocks = plan.cluster_blocks;
  p.slice_vectors = plan.slice_vectors;
  p.staged_params = plan.slice_params;
  const size_t scratch = plan.smem_bytes<acc_t>();
  const size_t staged =
      plan.multipass() ? 0 : staged_params_bytes(a.cols, p.weight != nullptr, p.bias != nullptr, sizeof(W));
  with_row_kernel<ForwardKernels<T, W, acc_t, R>, T>(kind, plan, [&](auto kernel) {
    if (plan.shared_row()) {  // a cluster of blocks per row, as many clusters as the device holds at once
      const size_t smem = forward_shared_row_space<acc_t, R, W>(p.weight != nullptr, p.bias != nullptr, limits)
                              .layout(plan.slice_vectors, plan.vec, plan.slice_params)
                              .total;
      size_cluster_grid(kernel, plan, a.rows, smem, limits, plan.cluster_blocks);
      launch_in_clusters(kernel, plan.cluster_blocks, plan, smem, stream, p);
      return;
    }
    size_t smem = scratch;
    if (!plan.multipass()) {  // one wave of blocks, each walking many rows (the multi-pass kernel: a block a row)
      const int threads = plan.block_threads();
      const int blocks_per_sm = dev::resident_blocks_per_sm(kernel, threads, scratch, limits.max_threads_per_sm);
      // The weight and bias from a copy in shared memory, made once per block, where the device has room for it
      // without fewer blocks resident than the registers allow (every D on sm_90; not on GPUs with less).
      if (staged > 0 && scratch + staged <= limits.max_shared_per_block) {
        dev::allow_dynamic_shared(kernel, scratch + staged, limits.max_shared_per_block);
        p.staged_params =
            dev::resident_blocks_per_sm(kernel, threads, scratch + staged, limits.max_threads_per_sm) == blocks_per_sm;
        if (p.staged_params) smem += staged;
      }
      limit_to_one_wave(plan, limits, blocks_per_sm);
    }
    dev::launch(kernel, grid_of(plan), block_of(plan), smem, stream, p);
  });
}

// The forward kernel, then with a quantized output the quantize kernel over y (a temporary where y is not asked for).
inline void launch_norm_forward(NormKind kind, const ForwardArgs& args, const DeviceLimits& limits,
                                dev::Stream stream) {
  ForwardArgs a = args;
  const bool quantized = a.quant.q.defined();
  if (quantized && !a.y.defined())
    a.y = at::empty({a.rows, a.cols}, a.x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto rows = a.residual_out.defined() ? a.residual_out.scalar_type() : a.x.scalar_type();
  dispatch_dtypes(a.x.scalar_type(), parameter_dtype(a.x, a.weight, a.bias), rows,
                  [&](auto types) { launch_forward_typed<decltype(types)>(kind, a, limits, stream); });
  if (!quantized) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.y.scalar_type(), "torch_ln quantize", [&] {
    launch_quantize_rows<scalar_t>(a.y, a.quant, a.rows, a.cols, limits, stream);
  });
}

}  // namespace torch_ln
