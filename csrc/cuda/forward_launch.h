// Host side of the forward kernels: plan, pick the template instance, launch.
#pragma once

#include <tuple>
#include <utility>

#include "forward.cuh"
#include "launch_common.h"

namespace torch_ln {

// Where the forward may stage rows too long for registers: rows of R (what is normalized) and the parameter rows
// given in the device's shared memory per block, over clusters where it has them; and the bulk loads' `stages`.
template <typename acc_t, typename R, typename W>
SharedRowSpace forward_shared_row_space(bool weight, bool bias, int stages, const DeviceLimits& limits) {
  return {.row_elem_bytes = sizeof(R),
          .param_rows = int{weight} + int{bias},
          .param_elem_bytes = sizeof(W),
          .acc_bytes = sizeof(acc_t),
          .smem_per_block = limits.max_shared_per_block,
          .max_cluster_blocks = limits.max_cluster_blocks,
          .bulk_stages = stages};
}

// ForwardParams::quant_group_lanes for the kernel `plan` runs: 0 without per-group scales; a group's vectors where
// they lie in consecutive lanes of one warp, whose shuffles reduce its amax: a power of two <= 32 of whole vectors,
// inside one slice of the shared-memory kernel's row; -1 elsewhere. (A group of at most half the row spans no more
// than the register kernels' threads of a row, and the multi-pass kernel's rounds of the block's threads hold whole
// groups.)
inline int quant_group_lanes(const QuantSpec& spec, int64_t cols, const RowPlan& plan) {
  if (!spec.dynamic || spec.group == cols) return 0;
  const int64_t lanes = spec.group / plan.vec;
  const bool in_warp = spec.group % plan.vec == 0 && lanes <= dev::kWarpSize && (lanes & (lanes - 1)) == 0;
  if (!in_warp || (plan.shared_row() && plan.slice_vectors % lanes != 0)) return -1;
  return static_cast<int>(lanes);
}

template <typename Types>
void launch_forward_typed(NormKind kind, const ForwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  using T = typename Types::input_t;
  using W = typename Types::param_t;
  using acc_t = typename Types::acc_t;
  using R = typename Types::row_t;
  // A gated RMSNorm (GateArgs) runs the GATED instances, on rows of the input's dtype; a grouped one on its groups.
  constexpr bool kGateable = std::is_same_v<R, T>;
  const bool gated = kGateable && (a.gate.z.defined() || a.gate.group_size > 0);
  const KernelRows k = kernel_rows(a.rows, a.cols, a.x_rows, a.gate);
  ForwardParams<T, W, acc_t, R> p{a.x.const_data_ptr<T>(),
                                  data_or_null<W>(a.weight),
                                  data_or_null<W>(a.bias),
                                  mutable_data_or_null<T>(a.y),
                                  mutable_data_or_null<acc_t>(a.mean),
                                  a.rstd.mutable_data_ptr<acc_t>(),
                                  k.rows,
                                  k.cols,
                                  static_cast<acc_t>(a.eps),
                                  0,
                                  data_or_null<R>(a.residual),
                                  mutable_data_or_null<R>(a.residual_out),
                                  {static_cast<acc_t>(a.rounding.weight_offset), a.rounding.round_normalized},
                                  false,
                                  0,
                                  0,
                                  k.x_rows};
  const bool quantized = a.quant.q.defined();
  const QuantOutput quant =
      quantized ? QuantOutput{reinterpret_cast<uint8_t*>(a.quant.q.mutable_data_ptr()),
                              a.quant.spec.dynamic ? a.quant.scales.mutable_data_ptr<float>() : nullptr,
                              a.quant.spec.dynamic ? nullptr : a.quant.scales.const_data_ptr<float>(), a.quant.spec}
                : QuantOutput{};
  p.quant = quant;
  p.gate = {data_or_null<T>(a.gate.z), nullptr, a.gate.before, a.gate.activation, k.groups};
  // A strided x is read in 16-byte vectors where every row starts 16-byte aligned, as its base does.
  const bool vec_ok = vectorizable<T, W>(k.cols, {p.x, p.y, p.gate.z}, {p.weight, p.bias}) &&
                      vectorizable<T, R>(k.cols, {}, {p.residual, p.residual_out}) &&
                      k.x_rows.multiple_of(kVectorBytes / static_cast<int64_t>(sizeof(T)));
  // A gated norm's rows too long for registers take the multi-pass kernel (no shared-memory path).
  const SharedRowSpace shared_space =
      gated ? SharedRowSpace{}
            : forward_shared_row_space<acc_t, R, W>(
                  p.weight != nullptr, p.bias != nullptr,
                  bulk_stages(limits.max_cluster_blocks, p.residual == nullptr && vec_ok), limits);
  const RegisterBudget budget =
      gated ? ForwardKernels<T, W, acc_t, R, false, true>::budget : ForwardKernels<T, W, acc_t, R>::budget;
  RowPlan plan = plan_rows(k.rows, k.cols, sizeof(T), vec_ok, budget, shared_space);
  p.threads_per_row = plan.threads_per_row;
  p.bulk_stages = bulk_loads(plan, shared_space, true);
  p.cluster_blocks = plan.cluster_blocks;
  p.slice_vectors = plan.slice_vectors;
  p.staged_params = plan.slice_params;
  p.quant_group_lanes = quantized ? quant_group_lanes(a.quant.spec, a.cols, plan) : 0;
  // The forward quantizes in its epilogue, but for groups its layout cannot reduce in a warp, and for the dtype
  // combinations without QUANTIZED kernel instances (float64, mixed parameters, a float32 residual stream: kept to
  // the serving dtypes for build time). There y is written (a temporary where not asked for), then quantized by a
  // second kernel.
  constexpr bool kQuantizesInForward = std::is_same_v<W, T> && std::is_same_v<R, T> && !std::is_same_v<T, double>;
  const bool separate_quantize = quantized && (p.quant_group_lanes < 0 || !kQuantizesInForward);
  at::Tensor y_for_quantize;
  if (separate_quantize) {
    y_for_quantize = a.y.defined() ? a.y : at::empty({a.rows, a.cols}, a.x.options());
    p.y = y_for_quantize.mutable_data_ptr<T>();
    p.quant = {};
  }
  const size_t scratch = plan.smem_bytes<acc_t>();
  const size_t staged =
      plan.multipass() ? 0 : staged_params_bytes(k.cols, p.weight != nullptr, p.bias != nullptr, sizeof(W));
  const auto launch = [&](auto kernel) {
    if (plan.shared_row()) {  // a cluster of blocks per row, as many clusters as the device holds at once
      const size_t smem =
          shared_space.layout(plan.slice_vectors, plan.cluster_blocks, plan.vec, plan.slice_params).total;
      size_cluster_grid(kernel, plan, a.rows, smem, limits, plan.cluster_blocks);
      launch_in_clusters(kernel, plan.cluster_blocks, plan, smem, stream, p);
      return;
    }
    size_t smem = scratch;
    if (!plan.multipass()) {  // one wave of blocks, each walking many rows (the multi-pass kernel: a block a row)
      // The block's residency and shared memory at `at`'s rows a block. The weight and bias from a copy in shared
      // memory, made once per block, where the device has room for it without fewer blocks resident than the
      // registers allow (every D on sm_90; not on GPUs with less). The prefetch ring after that (RowPrefetch: per
      // stage, each thread's vectors of x, and of the residual), where it is wanted and the device has room for it
      // without fewer blocks resident; with a residual add, of x's vectors alone where there is no room for both and
      // a ring of x is wanted.
      struct BlockSetup {
        int blocks_per_sm;
        bool staged_params = false;
        bool ring_wanted = false;  // a ring of some stream is wanted, whether or not it found room
        RingPlacement ring{};
        bool ring_residual = false;
        size_t smem;
      };
      const auto set_up = [&](const RowPlan& at) {
        const int threads = at.block_threads();
        const size_t block_scratch = at.smem_bytes<acc_t>();
        BlockSetup s{.blocks_per_sm = dev::resident_blocks_per_sm(kernel, threads, block_scratch, limits),
                     .smem = block_scratch};
        if (staged > 0 && block_scratch + staged <= limits.max_shared_per_block) {
          dev::allow_dynamic_shared(kernel, block_scratch + staged, limits.max_shared_per_block);
          s.staged_params =
              dev::resident_blocks_per_sm(kernel, threads, block_scratch + staged, limits) == s.blocks_per_sm;
          if (s.staged_params) s.smem += staged;
        }
        const size_t stage_elems = static_cast<size_t>(threads) * at.items * at.vec;  // of each stream
        for (const bool with_residual : {true, false}) {
          if ((with_residual && p.residual == nullptr) || !ring_prefetches(at.vec, sizeof(acc_t), gated) ||
              !forward_ring_wanted(at.items * at.vec * sizeof(T), at.threads_per_row, with_residual)) {
            continue;
          }
          s.ring_wanted = true;
          s.ring = place_ring(s.smem, stage_elems * (sizeof(T) + (with_residual ? sizeof(R) : 0)), limits,
                              [&](size_t total) {
                                dev::allow_dynamic_shared(kernel, total, limits.max_shared_per_block);
                                return dev::resident_blocks_per_sm(kernel, threads, total, limits) == s.blocks_per_sm;
                              });
          if (s.ring.stages == 0) continue;
          s.ring_residual = with_residual;
          s.smem = s.ring.total;
          break;
        }
        return s;
      };
      // Remembered per kernel, plan and device (remembered: the occupancy queries cost microseconds a launch). Rows
      // a block doubled, up to the kernel's threads, where a wanted ring finds no room beside each block's copy of
      // the weight and bias, and the larger blocks keep as many threads an SM: fewer copies an SM, and the room for a
      // ring (float32 LayerNorm D=4096: 4 blocks of 128 threads copy 4 x 32 KiB and hold no ring; 2 blocks of 256
      // hold 2 stages). A function of D, dtype and the device, as the plan is; each row's result is unchanged.
      const auto key =
          std::make_tuple(reinterpret_cast<const void*>(kernel), plan.vec, plan.items, plan.threads_per_row,
                          plan.rows_per_block, staged, p.residual != nullptr, limits.fields());
      const auto [rows_per_block, setup] = remembered(key, [&] {
        int rows = plan.rows_per_block;
        BlockSetup best = set_up(plan);
        for (RowPlan grown = plan;
             best.ring_wanted && best.ring.stages == 0 && grown.block_threads() * 2 <= budget.max_threads;) {
          share_blocks(grown, k.rows, grown.rows_per_block * 2);
          const BlockSetup tried = set_up(grown);
          if (tried.ring.stages > 0 &&
              tried.blocks_per_sm * grown.block_threads() >= best.blocks_per_sm * plan.block_threads()) {
            rows = grown.rows_per_block;
            best = tried;
          }
        }
        return std::make_pair(rows, best);
      });
      share_blocks(plan, k.rows, rows_per_block);
      p.staged_params = setup.staged_params;
      p.prefetch_stages = setup.ring.stages;
      p.prefetch_offset = setup.ring.offset;
      p.prefetch_residual = setup.ring_residual;
      smem = setup.smem;
      limit_to_one_wave(plan, limits, setup.blocks_per_sm);
    }
    group_units(plan, a.rows, k.groups);
    dev::launch(kernel, grid_of(plan), block_of(plan), smem, stream, p);
  };
  if constexpr (kGateable) {
    if (gated) return with_row_kernel<ForwardKernels<T, W, acc_t, R, false, true>, T>(kind, plan, launch);
  }
  if constexpr (kQuantizesInForward) {
    if (p.quant.q != nullptr) return with_row_kernel<ForwardKernels<T, W, acc_t, R, true>, T>(kind, plan, launch);
  }
  with_row_kernel<ForwardKernels<T, W, acc_t, R>, T>(kind, plan, launch);
  if (separate_quantize) {
    launch_quantize_rows<T>(p.y, quant, a.rows, a.cols, limits, stream);
  }
}

// The forward kernel, with a quantized output where quant.q is defined.
inline void launch_norm_forward(NormKind kind, const ForwardArgs& a, const DeviceLimits& limits, dev::Stream stream) {
  const auto rows = a.residual_out.defined() ? a.residual_out.scalar_type() : a.x.scalar_type();
  dispatch_dtypes(a.x.scalar_type(), parameter_dtype(a.x, a.weight, a.bias), rows,
                  [&](auto types) { launch_forward_typed<decltype(types)>(kind, a, limits, stream); });
}

}  // namespace torch_ln
