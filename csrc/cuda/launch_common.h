// Host side of the CUDA kernels, the parts forward and backward share: from
// validated arguments to launches. Used by the CUDA build (csrc/cuda/*.cu) and
// the emulated build (csrc/emulated), which differ only in the device layer, the
// device limits and the stream.
#pragma once

#include "../dispatch.h"
#include "../norm.h"
#include "device.cuh"
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

}  // namespace torch_ln
