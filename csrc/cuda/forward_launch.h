// Host side of the forward kernels: plan, pick the template instance, launch.
#pragma once

#include "forward.cuh"
#include "launch_common.h"

namespace torch_ln {

template <typename Types>
void launch_forward_typed(NormKind kind, const ForwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  using T = typename Types::input_t;
  using W = typename Types::param_t;
  using acc_t = typename Types::acc_t;
  ForwardParams<T, W, acc_t> p{a.x.const_data_ptr<T>(),
                                     data_or_null<W>(a.weight),
                                     data_or_null<W>(a.bias),
                                     a.y.mutable_data_ptr<T>(),
                                     mutable_data_or_null<acc_t>(a.mean),
                                     a.rstd.mutable_data_ptr<acc_t>(),
                                     a.rows,
                                     a.cols,
                                     static_cast<acc_t>(a.eps),
                                     0};
  const bool vec_ok = vectorizable<T, W>(a.cols, {p.x, p.y}, {p.weight, p.bias});
  const RowPlan plan = plan_rows(a.rows, a.cols, sizeof(T), vec_ok, kForwardBudget, limits, false);
  p.threads_per_row = plan.threads_per_row;
  dispatch_kind_and_vec<T>(kind, plan.vec, [&](auto kind_c, auto vec_c) {
    constexpr NormKind K = decltype(kind_c)::value;
    constexpr int VEC = decltype(vec_c)::value;
    auto kernel_for = [](auto items_c) {
      constexpr int ITEMS = decltype(items_c)::value;
      if constexpr (ITEMS == 0) {
        return &norm_forward_multipass_kernel<T, W, acc_t, K, VEC>;
      } else {
        return &norm_forward_kernel<T, W, acc_t, K, VEC, ITEMS>;
      }
    };
    launch_planned<large_items(VEC, kForwardBudget), acc_t>(plan, stream, kernel_for, p);
  });
}

inline void launch_norm_forward(NormKind kind, const ForwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  dispatch_norm_dtypes(a.x.scalar_type(), parameter_dtype(a.x, a.weight, a.bias),
                       [&](auto types) { launch_forward_typed<decltype(types)>(kind, a, limits, stream); });
}

}  // namespace torch_ln
