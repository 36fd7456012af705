// The test-only emulated build: the CUDA kernels and their launch planning,
// compiled by the host compiler against the SIMT emulation, registered as the
// operators of a separate library (torch_ln_emulated) on CPU tensors, with the
// emulator's traffic counters and the launch planning exposed for the kernel model.
#include <optional>
#include <vector>

#include "../cuda/backward.cuh"
#include "../cuda/forward.cuh"
#include "../cuda/launch_common.h"
#include "../norm_ops.h"
#include "emulated_kernels.h"

#ifdef TORCH_LN_EMULATED_COVERAGE
extern "C" void __gcov_dump();  // libgcov's: writes the counts now; the exit-time write then does nothing
#endif

namespace torch_ln {

DeviceLimits& emulated_device() {
  static DeviceLimits limits = kEmulatedDevice;
  return limits;
}

namespace {

// Whether the emulated stream records a CUDA graph (set_capturing): the operators take their capture-safe checks.
bool capturing_now = false;

bool emulated_stream_capturing(const at::Tensor& /*t*/) { return capturing_now; }

void set_capturing(bool on) { capturing_now = on; }

}  // namespace

struct EmulatedBackend {
  static constexpr NormKernels kernels{&emulated_norm_forward, &emulated_norm_backward, &empty_contiguous,
                                       &emulated_stream_capturing};
};

namespace {

// max_shared_per_block and max_cluster_blocks: the default device's when not given; shared_per_sm: not counted in
// residency when not given.
void set_device(int64_t num_sms, int64_t max_threads_per_sm, std::optional<int64_t> shared,
                std::optional<int64_t> cluster, std::optional<int64_t> shared_per_sm) {
  const int64_t max_shared_per_block =
      shared.has_value() ? *shared : static_cast<int64_t>(kEmulatedDevice.max_shared_per_block);
  const int64_t max_cluster_blocks = cluster.has_value() ? *cluster : kEmulatedDevice.max_cluster_blocks;
  TORCH_CHECK(num_sms > 0 && max_threads_per_sm > 0 && max_shared_per_block >= 0,
              "set_device: expected positive SMs and threads and max_shared_per_block >= 0, got num_sms=", num_sms,
              ", max_threads_per_sm=", max_threads_per_sm, ", max_shared_per_block=", max_shared_per_block);
  TORCH_CHECK(max_cluster_blocks >= 1 && max_cluster_blocks <= kMaxClusterBlocks,
              "set_device: expected max_cluster_blocks in [1, ", kMaxClusterBlocks, "], got ", max_cluster_blocks);
  const int64_t sm_shared = shared_per_sm.value_or(0);
  TORCH_CHECK(sm_shared >= 0, "set_device: expected shared_per_sm >= 0, got ", sm_shared);
  emulated_device() = {static_cast<int>(num_sms), static_cast<int>(max_threads_per_sm),
                       static_cast<size_t>(max_shared_per_block), static_cast<int>(max_cluster_blocks),
                       static_cast<size_t>(sm_shared)};
}

// The plan the launchers make on the emulated device (rows without a residual, `param_rows` of weight and bias in
// the input's dtype; the backward: a weight where param_rows > 0, and param_rows gradients asked for, a LayerNorm's
// weight and bias where 2, an RMSNorm's weight where 1): vec, items,
// threads_per_row, rows_per_block, blocks, cluster_blocks (the shared-memory path; 0 elsewhere), that path's shared
// memory per block, whether it keeps the parameters there and whether it keeps the row there, the backward's
// partial_cluster_blocks, the gradients its held-sums instance holds (RowPlan::held) and the stages of that
// instance's weight ring (backward_shared_smem, counted in that shared memory; 0: none). The register and
// shared-memory kernels' grid is one wave at `blocks_per_sm` (the kernel's occupancy; 0: by the device's threads per
// SM alone, as the emulated launch counts it where set_device's shared_per_sm is not set); and the backward's
// partial_cluster_blocks.
std::vector<int64_t> plan(std::string direction, int64_t rows, int64_t cols, int64_t elem_bytes, bool vectorizable,
                          int64_t blocks_per_sm, int64_t param_rows) {
  TORCH_CHECK(direction == "fwd" || direction == "bwd", "plan: direction must be 'fwd' or 'bwd', got '", direction,
              "'");
  const bool fwd = direction == "fwd";
  const int acc_bytes = elem_bytes == 8 ? 8 : 4;  // float64 accumulates in float64, the rest in float32
  const DeviceLimits& d = emulated_device();
  const auto elem = static_cast<size_t>(elem_bytes);
  const SharedRowSpace shared{.row_elem_bytes = elem,
                              .param_rows = fwd ? static_cast<int>(param_rows) : int{param_rows > 0},
                              .param_elem_bytes = elem,
                              .acc_bytes = static_cast<size_t>(acc_bytes),
                              .smem_per_block = d.max_shared_per_block,
                              .max_cluster_blocks = d.max_cluster_blocks,
                              .dy_elem_bytes = fwd ? 0 : elem,
                              .grad_rows = fwd ? 0 : static_cast<int>(param_rows),
                              .bulk_stages = bulk_stages(d.max_cluster_blocks, vectorizable),
                              .held_sums = !fwd,
                              .layer_norm = param_rows == 2,
                              .weight_grad = param_rows > 0};
  RowPlan p = plan_rows(rows, cols, static_cast<int>(elem_bytes), vectorizable,
                        for_accumulator(fwd ? kForwardBudget : kBackwardBudget, acc_bytes), shared);
  const int per_sm = blocks_per_sm > 0 ? static_cast<int>(blocks_per_sm) : d.max_threads_per_sm / p.block_threads();
  int64_t smem = 0;
  const int partial_cluster = fwd ? 1 : partial_cluster_blocks(p, d, param_rows > 0, acc_bytes);
  const int cluster = std::max(1, p.cluster_blocks) * partial_cluster;
  int weight_stages = 0;
  if (p.shared_row() && fwd) {
    smem = static_cast<int64_t>(shared.layout(p.slice_vectors, p.cluster_blocks, p.vec, p.slice_params).total);
  } else if (p.shared_row()) {
    const RingPlacement backward = backward_shared_smem(p, shared, d);
    smem = static_cast<int64_t>(backward.total);
    weight_stages = backward.stages;
  }
  if (p.shared_row() || partial_cluster > 1) {
    limit_to_resident_clusters(p, ceil_div(p.blocks, partial_cluster), int64_t{d.num_sms} * per_sm / cluster, cluster);
  } else if (!p.multipass() || !fwd) {  // the forward's multi-pass kernel has a block a row
    limit_to_one_wave(p, d, per_sm);
  }
  return {p.vec, p.items,        p.threads_per_row, p.rows_per_block, p.blocks, p.cluster_blocks,
          smem,  p.slice_params, p.row_on_chip,     partial_cluster,  p.held,   weight_stages};
}

void set_counting(bool on) { emu::set_counting(on); }

bool racecheck_active() { return emu::racecheck_enabled(); }

void set_l2_model(double l2_bytes, int64_t concurrent_blocks) { emu::set_l2_model(l2_bytes, concurrent_blocks); }

void set_block_sample(int64_t blocks) {
  TORCH_CHECK(blocks >= 0, "set_block_sample: expected blocks >= 0, got ", blocks);
  emu::set_block_sample(static_cast<unsigned>(blocks));
}

std::string take_launch_log() { return emu::take_launch_log(); }

// Writes the gcov counts of a coverage build now (false: not one). At process exit is too late under pytest-xdist,
// which kills a worker that takes over 10 s to exit (this library's took 3 s here).
bool dump_coverage() {
#ifdef TORCH_LN_EMULATED_COVERAGE
  __gcov_dump();
  return true;
#else
  return false;
#endif
}

// Names the tensors whose traffic each launch reports apart (empty: none).
void set_regions(std::vector<std::string> names, std::vector<at::Tensor> tensors) {
  TORCH_CHECK(names.size() == tensors.size(), "set_regions: expected a name per tensor, got ", names.size(),
              " names for ", tensors.size(), " tensors");
  std::vector<emu::Region> regions;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto begin = reinterpret_cast<uintptr_t>(tensors[i].const_data_ptr());
    regions.push_back({names[i], begin, begin + tensors[i].nbytes()});
  }
  emu::set_regions(std::move(regions));
}

}  // namespace

TORCH_LIBRARY(torch_ln_emulated, m) {
  define_norm_schemas(m);
  m.def(
      "set_device(int num_sms, int max_threads_per_sm, int? max_shared_per_block=None, int? max_cluster_blocks=None, "
      "int? shared_per_sm=None) -> ()",
      &set_device);
  m.def("set_capturing(bool on) -> ()", &set_capturing);
  m.def(
      "plan(str direction, int rows, int cols, int elem_bytes, bool vectorizable, int blocks_per_sm=0, "
      "int param_rows=0) -> int[]",
      &plan);
  m.def("set_counting", &set_counting);
  m.def("racecheck_active", &racecheck_active);
  m.def("set_l2_model", &set_l2_model);
  m.def("take_launch_log", &take_launch_log);
  m.def("dump_coverage", &dump_coverage);
  m.def("set_regions", &set_regions);
  m.def("set_block_sample", &set_block_sample);
}

TORCH_LIBRARY_IMPL(torch_ln_emulated, CPU, m) {
  register_norm_ops<EmulatedBackend>(m);
  register_gated_norm_ops<EmulatedBackend>(m);
}

}  // namespace torch_ln
