// Host side of the CUDA kernels, the parts forward and backward share: from
// validated arguments to launches. Used by the CUDA build (csrc/cuda/*.cu) and
// the emulated build (csrc/emulated), which differ only in the device layer, the
// device limits and the stream.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "../dispatch.h"
#include "../norm.h"
#include "device.cuh"
#include "launch_plan.h"

namespace torch_ln {

// `ask()`'s answer for `key`, asked once a process: for launch set-ups that ask the occupancy API, a driver query of
// about a microsecond of host time, which the forward asks up to a dozen times to size a block (float32 D=4096), more
// than a decode step's few rows take on the GPU. The key holds all the answer depends on: the kernel, its plan and
// the device (DeviceLimits::fields). One store per call site (`Ask` is its lambda); safe across threads.
template <typename Key, typename Ask>
auto remembered(const Key& key, Ask ask) {
  using Answer = decltype(ask());
  static std::mutex lock;
  static std::map<Key, Answer> answers;
  {
    const std::lock_guard<std::mutex> hold(lock);
    if (const auto found = answers.find(key); found != answers.end()) return found->second;
  }
  const Answer answer = ask();  // outside the lock: the occupancy API may take a while
  const std::lock_guard<std::mutex> hold(lock);
  return answers.emplace(key, answer).first->second;
}

inline bool is_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Whether 16-byte vectors of T (and the matching vectors of the parameter type
// W) can be used for every row: all pointers aligned, rows a whole number of
// vectors.
template <typename T, typename W>
bool vectorizable(int64_t cols, std::initializer_list<const void*> row_data,
                  std::initializer_list<const void*> params) {
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

// Calls f(kernel) with the row kernel a plan calls for. Kernels names a
// direction's kernels: Kernels::get<K, VEC, ITEMS>() is the register kernel for
// that tier, or the multi-pass one for ITEMS == 0; Kernels::shared_row<K, VEC>(plan),
// where the direction has one, the shared-memory kernel; Kernels::budget is its
// register budget. The norm kind and the vector width (16 bytes of T, or 1 for
// the scalar path) become compile-time constants here.
// Kernels::shared_row<K, VEC>(plan), or, for a direction without one (whose plans never take that path), a null
// kernel of its kernels' type.
template <typename Kernels, NormKind K, int VEC>
constexpr auto shared_row_kernel(const RowPlan& plan, int) -> decltype(Kernels::template shared_row<K, VEC>(plan)) {
  return Kernels::template shared_row<K, VEC>(plan);
}
template <typename Kernels, NormKind K, int VEC>
constexpr auto shared_row_kernel(const RowPlan&, long) {
  return decltype(Kernels::template get<K, VEC, kSmallItems>()){nullptr};
}

template <typename Kernels, typename T, typename F>
void with_row_kernel(NormKind kind, const RowPlan& plan, F&& f) {
  auto with_kind_and_vec = [&](auto kind_c, auto vec_c) {
    constexpr NormKind K = decltype(kind_c)::value;
    constexpr int VEC = decltype(vec_c)::value;
    constexpr int kLargeItems = large_items(VEC, Kernels::budget);
    if (plan.shared_row()) return f(shared_row_kernel<Kernels, K, VEC>(plan, 0));
    if (plan.multipass()) {
      f(Kernels::template get<K, VEC, 0>());
    } else if (plan.items == kSmallItems) {
      f(Kernels::template get<K, VEC, kSmallItems>());
    } else {
      f(Kernels::template get<K, VEC, kLargeItems>());
    }
  };
  auto with_kind = [&](auto kind_c) {
    if (plan.vec == 1) {
      with_kind_and_vec(kind_c, std::integral_constant<int, 1>{});
    } else {
      with_kind_and_vec(kind_c, std::integral_constant<int, kVectorBytes / sizeof(T)>{});
    }
  };
  if (kind == NormKind::LayerNorm) {
    with_kind(std::integral_constant<NormKind, NormKind::LayerNorm>{});
  } else {
    with_kind(std::integral_constant<NormKind, NormKind::RMSNorm>{});
  }
}

// The rows the kernels normalize: the call's, or a grouped gated norm's groups (GateArgs::group_size), each a row of
// its own: M * groups rows of group_size, row m * groups + g starting g * group_size past row m of x, a level below
// x's row strides (norm_ops keeps a grouped input's rows one level deep, or contiguous beyond 2^32 rows).
struct KernelRows {
  int64_t rows, cols, groups;
  RowStrides x_rows;
};

inline KernelRows kernel_rows(int64_t rows, int64_t cols, const RowStrides& x_rows, const GateArgs& gate) {
  if (gate.group_size == 0) return {rows, cols, 1, x_rows};
  const int64_t size = gate.group_size, groups = cols / size;
  // Member by member: nvcc 13.0's cicc crashes on a braced RowStrides in a conditional expression here.
  RowStrides grouped;
  grouped.inner = size;
  if (x_rows.inner != cols || x_rows.inner_rows != 0) {  // strided rows: the groups' rows a level below them
    grouped.inner_rows = groups;
    grouped.outer = x_rows.inner;
  }
  return {rows * groups, size, groups, grouped};
}

// A grid of whole groups of units for `groups` groups a row (GroupWalk): the plan's blocks rounded to a multiple of
// groups, at least one unit a group and no more than its `batch_rows` give work to.
inline void group_units(RowPlan& plan, int64_t batch_rows, int64_t groups) {
  if (groups == 1) return;
  const int64_t units = std::clamp<int64_t>(plan.blocks / groups, 1, ceil_div(batch_rows, plan.rows_per_block));
  plan.blocks = units * groups;
}

// A register kernel's prefetch ring (ThreadRing) in its dynamic shared memory: after the kernel's other `smem` bytes,
// 16-byte aligned, 3 stages of `stage_bytes` (two tiles in flight) or else 2, the first the block's limit and
// `keeps(total bytes)` allow; no stages where neither is.
struct RingPlacement {
  int stages = 0;
  size_t offset = 0, total = 0;
};

template <typename Keeps>
RingPlacement place_ring(size_t smem, size_t stage_bytes, const DeviceLimits& limits, Keeps keeps) {
  const size_t offset = static_cast<size_t>(ceil_div(static_cast<int64_t>(smem), kVectorBytes)) * kVectorBytes;
  for (const int stages : {3, 2}) {
    const size_t total = offset + stages * stage_bytes;
    if (total <= limits.max_shared_per_block && keeps(total)) return {stages, offset, total};
  }
  return {0, 0, smem};
}

// The shared-memory backward's dynamic shared memory (`total`): its slices' layout, then the held-sums instance's
// weight ring (WeightRing: `stages` of a vector a thread, from `offset`; 0 stages: none) where it takes one, of 3
// stages, else 2, where the block has the room (its one block an SM keeps any occupancy).
inline RingPlacement backward_shared_smem(const RowPlan& plan, const SharedRowSpace& space,
                                          const DeviceLimits& limits) {
  const size_t layout =
      space.layout(plan.slice_vectors, plan.cluster_blocks, plan.vec, plan.slice_params, plan.row_on_chip).total;
  const size_t weight_vector = plan.vec * space.param_elem_bytes;
  if (space.param_rows == 0 || plan.slice_params || !weight_ring_instance(plan.held, space.layer_norm, weight_vector)) {
    return {0, 0, layout};
  }
  return place_ring(layout, kSharedRowThreads * weight_vector, limits, [](size_t) { return true; });
}

inline dev::Dim3 grid_of(const RowPlan& plan) { return {static_cast<unsigned>(plan.blocks)}; }
inline dev::Dim3 block_of(const RowPlan& plan) { return {static_cast<unsigned>(plan.block_threads())}; }

// A grid of whole clusters of `cluster` blocks (1: blocks) of `smem` bytes each, as many as the device holds at once
// by the occupancy API and `units` give work to (limit_to_resident_clusters).
template <typename Kernel>
void size_cluster_grid(Kernel kernel, RowPlan& plan, int64_t units, size_t smem, const DeviceLimits& limits,
                       int cluster) {
  const int threads = plan.block_threads();
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, smem, cluster, limits.fields());
  const int64_t resident = remembered(key, [&] {
    dev::allow_dynamic_shared(kernel, smem, limits.max_shared_per_block);  // set once a device: it lasts
    return cluster == 1
               ? int64_t{limits.num_sms} * std::max(1, dev::resident_blocks_per_sm(kernel, threads, smem, limits))
               : dev::resident_clusters(kernel, cluster, threads, smem, limits);
  });
  limit_to_resident_clusters(plan, units, resident, cluster);
}

// Launches a row kernel in clusters of `cluster` blocks (1: a plain launch).
template <typename Kernel, typename Params>
void launch_in_clusters(Kernel kernel, int cluster, const RowPlan& plan, size_t smem, dev::Stream stream,
                        const Params& p) {
  if (cluster == 1) {
    dev::launch(kernel, grid_of(plan), block_of(plan), smem, stream, p);
  } else {
    dev::launch_clusters(kernel, cluster, grid_of(plan), block_of(plan), smem, stream, p);
  }
}

}  // namespace torch_ln
