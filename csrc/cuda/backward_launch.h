// Host side of the backward kernels: plan, pick the template instance, launch.
#pragma once

#include "backward.cuh"
#include "grad_reduce.cuh"
#include "launch_common.h"

namespace torch_ln {

// Sums the partial rows ([partial_rows, a.cols]) into dweight and dbias (launched on the row kernel's stream, after it:
// a dependent launch, which starts while the row kernel's blocks write their partial rows).
template <typename acc_t, typename W, typename Params>
void launch_reduce_partials(const Params& p, const BackwardArgs& a, int64_t partial_rows, dev::Stream stream) {
  constexpr int kVec = kVectorBytes / sizeof(acc_t);
  const bool vec_ok = a.cols % kVec == 0 && is_aligned(data_or_null<W>(a.dweight), kVec * sizeof(W)) &&
                      is_aligned(data_or_null<W>(a.dbias), kVec * sizeof(W));
  const int vec = vec_ok ? kVec : 1;
  const dev::Dim3 grid{static_cast<unsigned>(ceil_div(a.cols / vec, kReduceVectors)), 2};
  const dev::Dim3 block{kReduceVectors, kReduceStripes};
  auto launch = [&](auto kernel) {
    dev::launch_dependent(kernel, grid, block, 0, stream, p.partial_dweight, p.partial_dbias,
                          mutable_data_or_null<W>(a.dweight), mutable_data_or_null<W>(a.dbias), partial_rows, a.cols);
  };
  if (vec_ok) {
    launch(reduce_partials_kernel<acc_t, W, kVec>);
  } else {
    launch(reduce_partials_kernel<acc_t, W, 1>);
  }
}

// Where the backward may stage rows too long for registers: x (R) and dy (T), the weight slice (W) where given,
// and the requested gradients' sums (acc_t: the weight's where `weight_grad`, the bias' where `bias_grad`), in the
// device's shared memory per block, over clusters where it has them; and the bulk loads' mbarriers where x and dy
// read in 16-byte vectors (`vectorizable`) are of one size.
template <typename acc_t, typename T, typename R, typename W>
SharedRowSpace backward_shared_row_space(NormKind kind, bool weight, bool weight_grad, bool bias_grad,
                                         bool vectorizable, const DeviceLimits& limits) {
  return {.row_elem_bytes = sizeof(R),
          .param_rows = int{weight},
          .param_elem_bytes = sizeof(W),
          .acc_bytes = sizeof(acc_t),
          .smem_per_block = limits.max_shared_per_block,
          .max_cluster_blocks = limits.max_cluster_blocks,
          .dy_elem_bytes = sizeof(T),
          .grad_rows = int{weight_grad} + int{bias_grad},
          .bulk_stages = bulk_stages(limits.max_cluster_blocks, vectorizable && sizeof(R) == sizeof(T)),
          .held_sums = true,
          .layer_norm = kind == NormKind::LayerNorm,
          .weight_grad = weight_grad};
}

template <typename Types>
void launch_backward_typed(NormKind kind, const BackwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  using T = typename Types::input_t;
  using W = typename Types::param_t;
  using acc_t = typename Types::acc_t;
  using R = typename Types::row_t;
  // A gated RMSNorm (GateArgs) runs the GATED instances, on rows of the input's dtype; a grouped one on its groups.
  constexpr bool kGateable = std::is_same_v<R, T>;
  const bool gated = kGateable && (a.gate.z.defined() || a.gate.group_size > 0);
  const KernelRows k = kernel_rows(a.rows, a.cols, a.x_rows, a.gate);
  BackwardParams<T, W, acc_t, R> p{a.dy.const_data_ptr<T>(),
                                   a.x.const_data_ptr<R>(),
                                   data_or_null<acc_t>(a.mean),
                                   a.rstd.const_data_ptr<acc_t>(),
                                   data_or_null<W>(a.weight),
                                   mutable_data_or_null<R>(a.dx),
                                   nullptr,
                                   nullptr,
                                   k.rows,
                                   k.cols,
                                   0,
                                   data_or_null<R>(a.grad_residual_out),
                                   {static_cast<acc_t>(a.rounding.weight_offset), a.rounding.round_normalized}};
  if constexpr (std::is_same_v<T, R>) p.x_rows.strides = k.x_rows;
  p.from_output = a.from_output;
  p.inverse_weight = data_or_null<acc_t>(a.inverse_weight);
  p.gate = {data_or_null<T>(a.gate.z), mutable_data_or_null<T>(a.dgate), a.gate.before, a.gate.activation, k.groups};
  const bool vec_ok = vectorizable<T, W>(k.cols, {p.dy, p.x, p.dx, p.gate.z, p.gate.dz}, {p.weight}) &&
                      vectorizable<T, acc_t>(k.cols, {}, {p.inverse_weight}) &&
                      vectorizable<T, R>(k.cols, {}, {p.x, p.dx, p.grad_residual_out}) &&
                      k.x_rows.multiple_of(kVectorBytes / static_cast<int64_t>(sizeof(R)));
  // A gated norm's rows too long for registers take the multi-pass kernel (no shared-memory path).
  const SharedRowSpace space =
      gated ? SharedRowSpace{}
            : backward_shared_row_space<acc_t, T, R, W>(kind, p.weight != nullptr, a.dweight.defined(),
                                                        a.dbias.defined(), vec_ok, limits);
  RowPlan plan =
      plan_rows(k.rows, k.cols, sizeof(T), vec_ok,
                gated ? BackwardKernels<T, W, acc_t, R, true>::budget : BackwardKernels<T, W, acc_t, R>::budget, space);
  p.threads_per_row = plan.threads_per_row;
  p.cluster_blocks = plan.cluster_blocks;
  p.slice_vectors = plan.slice_vectors;
  p.row_on_chip = plan.row_on_chip;
  p.staged_weight = plan.slice_params;
  p.bulk_stages = bulk_loads(plan, space, false);
  const auto launch = [&](auto kernel) {
    // The blocks whose partial rows become one: a cluster of partial_cluster groups (where the device has clusters),
    // each a block or a row's cluster of the shared-memory path; a block alone for a grouped norm, whose neighbouring
    // blocks sum different groups.
    p.partial_cluster =
        k.groups > 1 ? 1
                     : partial_cluster_blocks(plan, limits, a.dweight.defined() || a.dbias.defined(), sizeof(acc_t));
    const int cluster = std::max(1, plan.cluster_blocks) * p.partial_cluster;
    size_t smem = 0;
    if (plan.shared_row()) {  // a cluster per row, as many as the device holds at once
      const RingPlacement shared = backward_shared_smem(plan, space, limits);
      p.prefetch_stages = shared.stages;
      p.prefetch_offset = shared.offset;
      smem = shared.total;
    } else {  // row reductions, then the partial rows of a block's rows (and of a cluster's blocks) added on chip
      smem =
          std::max(plan.smem_bytes<acc_t>(),
                   plan.rows_per_block > 1 || cluster > 1 ? plan.rows_per_block * k.cols * sizeof(acc_t) : size_t{0});
    }
    // The register kernel's prefetch ring after that (TilePrefetch: per stage, each thread's vectors of x and dy and
    // its row's statistics), where the block's shared memory has room.
    if (!plan.shared_row() && !plan.multipass() && ring_prefetches(plan.vec, sizeof(acc_t), gated)) {
      const size_t stage_bytes = static_cast<size_t>(plan.block_threads()) *
                                 (plan.items * plan.vec * (sizeof(R) + sizeof(T)) + 2 * sizeof(acc_t));
      const RingPlacement ring = place_ring(smem, stage_bytes, limits, [](size_t) { return true; });
      p.prefetch_stages = ring.stages;
      p.prefetch_offset = ring.offset;
      smem = ring.total;
    }
    size_cluster_grid(kernel, plan, ceil_div(plan.blocks, p.partial_cluster), smem, limits, cluster);
    group_units(plan, a.rows, k.groups);
    // One partial row per cluster (a block without one) and gradient; the multi-pass kernel accumulates into them,
    // so they start at zero. A grouped norm's units of one group each write the group's slice of a row D wide.
    const int64_t partial_rows = plan.blocks / cluster / k.groups;
    const auto partial_options = a.x.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    auto partial = [&](const at::Tensor& grad) {
      if (!grad.defined()) return at::Tensor();
      return plan.multipass() ? at::zeros({partial_rows, a.cols}, partial_options)
                              : at::empty({partial_rows, a.cols}, partial_options);
    };
    const at::Tensor partial_dweight = partial(a.dweight), partial_dbias = partial(a.dbias);
    p.partial_dweight = mutable_data_or_null<acc_t>(partial_dweight);
    p.partial_dbias = mutable_data_or_null<acc_t>(partial_dbias);
    launch_in_clusters(kernel, cluster, plan, smem, stream, p);
    if (a.dweight.defined() || a.dbias.defined()) launch_reduce_partials<acc_t, W>(p, a, partial_rows, stream);
  };
  if constexpr (kGateable) {
    if (gated) return with_row_kernel<BackwardKernels<T, W, acc_t, R, true>, T>(kind, plan, launch);
  }
  with_row_kernel<BackwardKernels<T, W, acc_t, R>, T>(kind, plan, launch);
}

inline void launch_norm_backward(NormKind kind, const BackwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  // dbias has the bias's dtype, which is the parameter dtype when there is no weight.
  dispatch_dtypes(a.dy.scalar_type(), parameter_dtype(a.dy, a.weight, a.dbias), a.x.scalar_type(),
                  [&](auto types) { launch_backward_typed<decltype(types)>(kind, a, limits, stream); });
}

}  // namespace torch_ln
