// Host side of the backward kernels: plan, pick the template instance, launch.
#pragma once

#include "backward.cuh"
#include "grad_reduce.cuh"
#include "launch_common.h"

namespace torch_ln {

template <typename Types>
void launch_backward_typed(NormKind kind, const BackwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  using T = typename Types::input_t;
  using W = typename Types::param_t;
  using acc_t = typename Types::acc_t;
  using R = typename Types::row_t;
  BackwardParams<T, W, acc_t, R> p{a.dy.const_data_ptr<T>(),
                                   a.x.const_data_ptr<R>(),
                                   data_or_null<acc_t>(a.mean),
                                   a.rstd.const_data_ptr<acc_t>(),
                                   data_or_null<W>(a.weight),
                                   mutable_data_or_null<R>(a.dx),
                                   nullptr,
                                   nullptr,
                                   a.rows,
                                   a.cols,
                                   0,
                                   data_or_null<R>(a.grad_residual_out),
                                   {static_cast<acc_t>(a.rounding.weight_offset), a.rounding.round_normalized}};
  const bool vec_ok = vectorizable<T, W>(a.cols, {p.dy, p.x, p.dx}, {p.weight}) &&
                      vectorizable<T, R>(a.cols, {}, {p.x, p.dx, p.grad_residual_out});
  const RowPlan plan = plan_rows(a.rows, a.cols, sizeof(T), vec_ok, BackwardKernels<T, W, acc_t, R>::budget, limits, true);
  p.threads_per_row = plan.threads_per_row;
  // One partial row per row-slot; the multi-pass kernel accumulates into them, so they start at zero.
  const int64_t slots = plan.blocks * plan.rows_per_block;
  const auto partial_options = a.x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  auto partial = [&](const at::Tensor& grad) {
    if (!grad.defined()) return at::Tensor();
    return plan.multipass() ? at::zeros({slots, a.cols}, partial_options) : at::empty({slots, a.cols}, partial_options);
  };
  const at::Tensor partial_dweight = partial(a.dweight), partial_dbias = partial(a.dbias);
  p.partial_dweight = mutable_data_or_null<acc_t>(partial_dweight);
  p.partial_dbias = mutable_data_or_null<acc_t>(partial_dbias);

  launch_rows<BackwardKernels<T, W, acc_t, R>, T, acc_t>(kind, plan, stream, p);
  if (a.dweight.defined() || a.dbias.defined()) {
    const dev::Dim3 grid{static_cast<unsigned>(ceil_div(a.cols, kReduceCols)), 2};
    const dev::Dim3 block{kReduceCols, kReduceRows};
    dev::launch(reduce_partials_kernel<acc_t, W>, grid, block, 0, stream, p.partial_dweight, p.partial_dbias,
                mutable_data_or_null<W>(a.dweight), mutable_data_or_null<W>(a.dbias), slots, a.cols);
  }
}

inline void launch_norm_backward(NormKind kind, const BackwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  // dbias has the bias's dtype, which is the parameter dtype when there is no weight.
  dispatch_norm_dtypes(a.dy.scalar_type(), parameter_dtype(a.dy, a.weight, a.dbias), [&](auto input_types) {
    dispatch_row_dtype(input_types, a.x.scalar_type(),
                       [&](auto types) { launch_backward_typed<decltype(types)>(kind, a, limits, stream); });
  });
}

}  // namespace torch_ln
