// Host side of the CUDA kernels: from validated arguments to launches. Shared by
// the CUDA build (csrc/cuda/*.cu) and the emulated build (csrc/emulated), which
// differ only in the device layer, the device limits and the stream.
#pragma once

#include "../dispatch.h"
#include "../norm.h"
#include "backward.cuh"
#include "forward.cuh"
#include "grad_reduce.cuh"
#include "launch_plan.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

namespace torch_ln {

inline bool is_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Whether 16-byte vectors of T (and the matching vectors of the parameter type
// W) can be used for every row: all pointers aligned, rows a whole number of
// vectors.
template <typename T, typename W>
bool vectorizable(int64_t cols, std::initializer_list<const void*> row_data, std::initializer_list<const void*> params) {
  constexpr int kVec = kVectorBytes / sizeof(T);
  if (cols % kVec != 0) return false;
  for (const void* p : row_data) {
    if (p != nullptr && !is_aligned(p, kVectorBytes)) return false;
  }
  for (const void* p : params) {
    if (p != nullptr && !is_aligned(p, kVec * sizeof(W))) return false;
  }
  return true;
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

template <typename T>
T* mutable_data_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

// Calls f(kind, vec) with both as compile-time constants: kind is LayerNorm or
// RMSNorm, vec is the 16-byte vector width of T or 1 (the scalar path).
template <typename T, typename F>
void dispatch_kind_and_vec(NormKind kind, int vec, F&& f) {
  constexpr int kVec = kVectorBytes / sizeof(T);
  auto with_vec = [&](auto kind_constant) {
    if (vec == 1) {
      f(kind_constant, std::integral_constant<int, 1>{});
    } else {
      f(kind_constant, std::integral_constant<int, kVec>{});
    }
  };
  if (kind == NormKind::LayerNorm) {
    with_vec(std::integral_constant<NormKind, NormKind::LayerNorm>{});
  } else {
    with_vec(std::integral_constant<NormKind, NormKind::RMSNorm>{});
  }
}

// Launches the row kernel a plan calls for. kernel_for(items) gives the kernel
// for a register tier (items as a compile-time constant), or the multi-pass
// kernel for items == 0.
template <int kLargeItems, typename acc_t, typename KernelFor, typename Params>
void launch_planned(const RowPlan& plan, dev::Stream stream, KernelFor kernel_for, const Params& params) {
  const dev::Dim3 grid{static_cast<unsigned>(plan.blocks)}, block{static_cast<unsigned>(plan.block_threads())};
  const size_t smem = plan.smem_bytes<acc_t>();
  if (plan.multipass()) {
    dev::launch(kernel_for(std::integral_constant<int, 0>{}), grid, block, smem, stream, params);
  } else if (plan.items == kSmallItems) {
    dev::launch(kernel_for(std::integral_constant<int, kSmallItems>{}), grid, block, smem, stream, params);
  } else {
    dev::launch(kernel_for(std::integral_constant<int, kLargeItems>{}), grid, block, smem, stream, params);
  }
}

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

template <typename Types>
void launch_backward_typed(NormKind kind, const BackwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  using T = typename Types::input_t;
  using W = typename Types::param_t;
  using acc_t = typename Types::acc_t;
  BackwardParams<T, W, acc_t> p{a.dy.const_data_ptr<T>(),
                                a.x.const_data_ptr<T>(),
                                data_or_null<acc_t>(a.mean),
                                a.rstd.const_data_ptr<acc_t>(),
                                data_or_null<W>(a.weight),
                                mutable_data_or_null<T>(a.dx),
                                nullptr,
                                nullptr,
                                a.rows,
                                a.cols,
                                0};
  const bool vec_ok = vectorizable<T, W>(a.cols, {p.dy, p.x, p.dx}, {p.weight});
  const RowPlan plan = plan_rows(a.rows, a.cols, sizeof(T), vec_ok, kBackwardBudget, limits, true);
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

  dispatch_kind_and_vec<T>(kind, plan.vec, [&](auto kind_c, auto vec_c) {
    constexpr NormKind K = decltype(kind_c)::value;
    constexpr int VEC = decltype(vec_c)::value;
    auto kernel_for = [](auto items_c) {
      constexpr int ITEMS = decltype(items_c)::value;
      if constexpr (ITEMS == 0) {
        return &norm_backward_multipass_kernel<T, W, acc_t, K, VEC>;
      } else {
        return &norm_backward_kernel<T, W, acc_t, K, VEC, ITEMS>;
      }
    };
    launch_planned<large_items(VEC, kBackwardBudget), acc_t>(plan, stream, kernel_for, p);
  });
  if (a.dweight.defined() || a.dbias.defined()) {
    const dev::Dim3 grid{static_cast<unsigned>(ceil_div(a.cols, kReduceCols)), 2};
    const dev::Dim3 block{kReduceCols, kReduceRows};
    dev::launch(reduce_partials_kernel<acc_t, W>, grid, block, 0, stream, p.partial_dweight, p.partial_dbias,
                mutable_data_or_null<W>(a.dweight), mutable_data_or_null<W>(a.dbias), slots, a.cols);
  }
}

inline void launch_norm_forward(NormKind kind, const ForwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  dispatch_norm_dtypes(a.x.scalar_type(), parameter_dtype(a.x, a.weight, a.bias),
                       [&](auto types) { launch_forward_typed<decltype(types)>(kind, a, limits, stream); });
}

inline void launch_norm_backward(NormKind kind, const BackwardArgs& a, const DeviceLimits& limits,
                                 dev::Stream stream) {
  // dbias has the bias's dtype, which is the parameter dtype when there is no weight.
  dispatch_norm_dtypes(a.x.scalar_type(), parameter_dtype(a.x, a.weight, a.dbias),
                       [&](auto types) { launch_backward_typed<decltype(types)>(kind, a, limits, stream); });
}

}  // namespace torch_ln
