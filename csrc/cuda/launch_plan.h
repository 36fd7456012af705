// Launch planning: the one function that picks the thread layout of the row
// kernels from the row length. Plain host C++, shared by the CUDA build and the
// emulated build, so the emulation tests exercise the very same plans.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <tuple>

namespace torch_ln {

// What the plan needs to know about the device.
struct DeviceLimits {
  int num_sms;
  int max_threads_per_sm;
  size_t max_shared_per_block;  // dynamic shared memory a block may have (opted in beyond 48 KB)
  int max_cluster_blocks;       // blocks a cluster may have: 16 on sm_90 (if one fits), else 8, 1 without clusters
  // Shared memory an SM holds for its resident blocks (0: not counted). On a GPU the occupancy API counts it; the
  // emulated device counts it in residency only where a test or the kernel model sets it.
  size_t shared_per_sm = 0;
  int device = 0;  // its index (one emulated device): launch set-ups are remembered per device

  // Every field: what a remembered launch set-up depends on of the device (remembered, launch_common.h).
  auto fields() const {
    return std::make_tuple(num_sms, max_threads_per_sm, max_shared_per_block, max_cluster_blocks, shared_per_sm,
                           device);
  }
};

// Shared memory the hardware reserves for each resident block beside its own (sm_80 and later: 1 KB).
constexpr size_t kReservedSharedPerBlock = 1024;

constexpr int kVectorBytes = 16;  // one 128-bit load or store
constexpr int kSmallItems = 2;    // vectors per thread for short rows

// How much of a row a thread keeps in registers, per kernel family. Sized by
// the register file (64K 32-bit registers per SM): a block of max_threads may
// use 65536 / max_threads registers a thread, and the values it holds must fit
// in them with room for addresses and indices (ptxas: no spills, no stack; the
// tests check it for every instantiation).
struct RegisterBudget {
  int elems;               // accumulator values per thread, for a 4-byte accumulator, in 16-byte vectors
  int scalar_elems;        // the same on the scalar path, where each value carries its own address and bounds check
  int max_threads;         // threads per row (and per block) at most; the kernels' launch bounds
  int rows_block_threads;  // block size when several rows share a block
};
// The forward holds x: 32 values a thread in up to 128 registers (512 threads;
// at 1024 threads, 64 registers do not hold 32 values and their addresses), 8
// on the scalar path (each value with its own address and bounds check).
constexpr RegisterBudget kForwardBudget{32, 8, 512, 128};
// The backward holds x, dy, the weight and the running weight/bias gradient
// sums: 5 x 16 values a thread, so blocks stop at 512 threads to stay within the
// register file; 8 on the scalar path. Its blocks share rows up to 512 threads: each block writes one partial row
// per gradient for the reduce to read, so 4x fewer of them than with blocks of 128 (at the same residency: 512
// threads an SM at the 128 registers a thread it takes).
constexpr RegisterBudget kBackwardBudget{16, 8, 512, 512};

// The gated RMSNorm's instances (GATED): blocks of at most 256 threads, whose up to 255 registers a thread hold the
// gate's loads and activations beside the row (at 512 threads' 128, ptxas spilled their larger tiers, and the
// backward's bfloat16 tier of two 8-vectors: no fewer items would do).
constexpr RegisterBudget gated_budget(RegisterBudget budget, bool gated) {
  return gated ? RegisterBudget{budget.elems, budget.scalar_elems, 256, std::min(budget.rows_block_threads, 256)}
               : budget;
}

// Whether a forward register kernel holds the next row's loads beside this row's values (norm_forward_kernel):
// where that row, as stored, is at most 64 bytes a thread (16 registers). Beyond it (the 8-vector tiers of float32
// and float64 rows) ptxas would spill at the 128 registers of a 512-thread block.
constexpr int kPrefetchBytes = 64;
constexpr bool prefetches_next_row(size_t row_bytes_per_thread) { return row_bytes_per_thread <= kPrefetchBytes; }

// Whether the forward register kernel takes a prefetch ring (RowPrefetch) where its instance has one and the device
// room: where the register prefetch cannot serve (over kPrefetchBytes a thread), for rows of a warp or less, whose
// reductions need no block barrier, so that a row's work is short beside the DRAM latency one row in flight leaves
// exposed, and for rows with a residual add, whose residual the register prefetch does not hold (read vector by
// vector as it is added, each load used before the next) and the ring copies beside x. Not for other block rows the
// register prefetch serves: there the kernel model has the ring's shared-memory reads cost more than a second row in
// flight gains (2026-12-06-kernel-model-prefetch-forward: bfloat16 D=512 84 -> 99.6 % of copy with the ring, D=4096
// 96 -> 87).
constexpr bool forward_ring_wanted(size_t row_bytes_per_thread, int threads_per_row, bool residual) {
  return !prefetches_next_row(row_bytes_per_thread) || threads_per_row <= 32 || residual;
}

// A budget for accumulators of `acc_bytes`: 8-byte (float64) values take two registers each.
constexpr RegisterBudget for_accumulator(RegisterBudget budget, int acc_bytes) {
  return {budget.elems * 4 / acc_bytes, budget.scalar_elems * 4 / acc_bytes, budget.max_threads,
          budget.rows_block_threads};
}

// The register tiers a kernel is compiled for, in vectors per thread: kSmallItems
// and this one.
constexpr int large_items(int vec, RegisterBudget budget) {
  return std::max(kSmallItems, vec == 1 ? budget.scalar_elems : budget.elems / vec);
}

struct RowPlan {
  int vec;              // elements per access: a 16-byte vector, or 1 (the scalar path)
  int items;            // vectors per thread kept in registers; 0: the row is not (shared-memory or multi-pass path)
  int threads_per_row;  // a power of two; rows of <= 32 threads live inside one warp
  int rows_per_block;
  int64_t blocks;
  // The shared-memory path: a row staged in the shared memory of this many blocks (a thread-block cluster when
  // more than one), each holding slice_vectors of it; 0 otherwise.
  int cluster_blocks;
  int64_t slice_vectors;
  bool slice_params;  // the shared-memory path also keeps its slice of the weight and bias on chip
  bool row_on_chip;   // the shared-memory path keeps its slice of the row (false: the backward reads it twice)
  int held = 0;       // the shared-memory backward's held-sums instance: the gradients it holds (SharedRowSpace::held)

  bool shared_row() const { return cluster_blocks > 0; }
  bool multipass() const { return items == 0 && !shared_row(); }
  int block_threads() const { return threads_per_row * rows_per_block; }
  // Shared memory for block-wide reductions of up to two values per warp.
  template <typename acc_t>
  size_t smem_bytes() const {
    return threads_per_row > 32 ? 2 * sizeof(acc_t) * (block_threads() / 32) : 0;
  }
};

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shared memory of the forward register kernel's copy of its weight and bias rows (each only when given), of
// `cols` elements of `elem_bytes`, rounded up to 16 bytes: the row-sum scratch follows it.
constexpr size_t staged_params_bytes(int64_t cols, bool weight, bool bias, size_t elem_bytes) {
  return static_cast<size_t>(ceil_div((int{weight} + int{bias}) * cols * static_cast<int64_t>(elem_bytes), 16) * 16);
}

inline int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// The shared-memory path: a block of kSharedRowThreads per row slice, each thread loading kSharedRowUnroll vectors
// at a time (all in flight before the first is used), at most kMaxClusterBlocks blocks per row: sm_90's non-portable
// cluster size (H100/H200 run clusters of 16 where the kernel opts in, dev::resident_clusters; beyond
// kPortableClusterBlocks the launch needs that opt-in, and the occupancy API says how many the device holds).
constexpr int kSharedRowThreads = 512;
constexpr int kSharedRowUnroll = 8;
constexpr int kBackwardSharedUnroll = 4;  // the backward loads x and dy: 8 vectors a thread in flight
// The backward's second read of a row too long for its cluster's shared memory: vectors of x and of dy a thread in
// flight together, kBackwardSharedUnroll where a vector converted to the accumulator is at most 16 bytes (float32,
// float64, the scalar path); one at a time for 16-bit rows, whose kernels sit at the 128 registers of their
// 512-thread blocks (two at a time spilled them).
constexpr int backward_reread_unroll(int vec, int acc_bytes) {
  return vec * acc_bytes <= kVectorBytes ? kBackwardSharedUnroll : 1;
}
constexpr int kPortableClusterBlocks = 8;
constexpr int kMaxClusterBlocks = 16;
// The cluster reductions' room in shared memory (ClusterReduce2) for rows over `blocks` blocks: two mbarriers, then
// two halves of a pair of accumulators from each block; none for a block alone.
constexpr size_t cluster_exchange_bytes(size_t acc_bytes, int blocks) {
  return blocks > 1 ? 2 * sizeof(uint64_t) + 2 * static_cast<size_t>(blocks) * 2 * acc_bytes : 0;
}

// The shared-memory kernels may stream their slices of each row into shared memory by bulk copies (sm_90's copy
// engine, on devices with clusters) in this many chunks, each completing on an mbarrier of its own, where the slices
// are kept as stored in global memory, in 16-byte vectors (`as_stored`: the forward's row normalized as loaded, with
// no residual add; the backward's x and dy of one size) (SliceRing, shared_vectors.cuh): their room is kept in the
// layout there.
constexpr int kBulkStages = 4;
constexpr int bulk_stages(int max_cluster_blocks, bool as_stored) {
  return max_cluster_blocks > 1 && as_stored ? kBulkStages : 0;
}
// Where the shared-memory path keeps things in a block's shared memory, as byte offsets: its slice of the row
// (`slice_elems` of `row_elem_bytes`; the backward's x, then its dy, of `dy_elem_bytes`), of the weight and of the
// bias (`param_rows` of them, each of `param_elem_bytes`, where the block keeps them), the backward's weight/bias
// gradient sums (`grad_rows` of `acc_bytes`), the cluster reductions' exchange (rows over `cluster_blocks` blocks),
// the row-sum scratch, the bulk loads' mbarriers (at `stages`: two for each of `bulk_stages` chunks).
struct SharedRowLayout {
  size_t dy, weight, bias, grads, exchange, scratch, stages, total;

  static constexpr size_t round16(size_t bytes) { return (bytes + 15) / 16 * 16; }
  constexpr SharedRowLayout(int64_t slice_elems, int cluster_blocks, size_t row_elem_bytes, int param_rows,
                            size_t param_elem_bytes, size_t acc_bytes, size_t dy_elem_bytes = 0, int grad_rows = 0,
                            int bulk_stages = 0)
      : dy(round16(slice_elems * row_elem_bytes)),
        weight(dy + round16(slice_elems * dy_elem_bytes)),
        bias(weight + (param_rows > 0 ? round16(slice_elems * param_elem_bytes) : 0)),
        grads(bias + (param_rows > 1 ? round16(slice_elems * param_elem_bytes) : 0)),
        exchange(grads + grad_rows * round16(slice_elems * acc_bytes)),
        scratch(exchange + cluster_exchange_bytes(acc_bytes, cluster_blocks)),
        stages(scratch + 2 * acc_bytes * (kSharedRowThreads / 32)),
        total(stages + 2 * bulk_stages * sizeof(uint64_t)) {}  // a chunk's full and empty mbarriers
};

// The shared-memory backward's held-sums instances keep gradient sums in registers (HeldGradientSums) instead of
// reading and writing them in shared memory every row, at most kHeldSumVectors vectors of float32 sums a thread
// (ptxas sm_90, 512 threads: float32 LayerNorm holding both gradients' at 8 rounds spilled 28 bytes): for a slice of
// `rounds` rounds of the block's threads, the sums of the first held_gradients (2: the weight's and the bias', 1: the
// weight's). LayerNorm holds both up to 4 rounds and, for float32 rows, the weight's up to 8 (16-bit rows' 64
// registers of them beside the bias' shared-memory sums spilled 4 bytes); RMSNorm its one up to 8. For bulk-loaded
// slices with float32 sums only (x and dy of one size, in 16-byte vectors: the instances have no other loads).
constexpr int kHeldSumVectors = 8;
constexpr int held_gradients(int64_t rounds, bool layer_norm, size_t elem_bytes) {
  if (!layer_norm) return rounds <= kHeldSumVectors ? 1 : 0;
  if (rounds <= kHeldSumVectors / 2) return 2;
  return rounds <= kHeldSumVectors && elem_bytes == 4 ? 1 : 0;
}
// Whether rows of x (`row_elem_bytes`) and dy (`dy_elem_bytes`) in vectors of `vec` elements, with sums of
// `acc_bytes`, have held-sums instances (they load their slices by bulk copies only: x and dy of one size, 16-byte
// vectors; float32 sums).
constexpr bool holds_sums_for(int vec, size_t row_elem_bytes, size_t dy_elem_bytes, size_t acc_bytes) {
  return row_elem_bytes == dy_elem_bytes && vec * dy_elem_bytes == kVectorBytes && acc_bytes == 4;
}
// Of the gradients whose sums a held-sums instance holds (`held`: held_gradients), the requested ones.
constexpr int held_requested(int held, bool weight_grad, bool bias_grad) {
  return held >= 2 ? int{weight_grad} + int{bias_grad} : held == 1 ? int{weight_grad} : 0;
}
// Whether a held-sums instance holding `held` gradients' sums takes a weight ring (WeightRing, backward.cuh) where
// its block keeps no copy of its slice of the weight: LayerNorm's holding the weight's sums alone (float32 rows of
// 5-8 rounds, the held slices too long for the weight beside them: float32 D=262144 over 16 blocks), for weight
// vectors of whole 16-byte pieces (cp.async). Not the others: RMSNorm's and LayerNorm's holding both keep the weight
// on chip wherever the H200 runs them, and the float32 RMSNorm instance sits at its 128 registers.
constexpr bool weight_ring_instance(int held, bool layer_norm, size_t weight_vector_bytes) {
  return held == 1 && layer_norm && weight_vector_bytes % kVectorBytes == 0;
}
// Where a held-sums instance holding `held` gradients' sums stores them after its walk: over its slices of x and dy
// (the walk done) where they have the room, in rooms of their own beside the other sums otherwise (16-bit LayerNorm
// holding both).
constexpr bool held_sums_over_row(int held, size_t acc_bytes, size_t row_elem_bytes, size_t dy_elem_bytes) {
  return held * acc_bytes <= row_elem_bytes + dy_elem_bytes;
}
// The gradient sums' rows the shared-memory backward keeps rooms for after its slices of x and dy: all but the
// `held_requested` ones stored over the row.
constexpr int own_sum_rows(int grad_rows, int held_requested, bool over_row) {
  return over_row ? grad_rows - held_requested : grad_rows;
}

// Room for the shared-memory path: what a row element takes there (the forward: the type of the normalized row;
// the backward: x's, and dy's in dy_elem_bytes), the weight and bias rows given and their element size, the
// accumulator's size, the device's shared memory per block (0: no shared-memory path) and cluster size, and the
// backward's gradient sums kept on chip (grad_rows: one per requested parameter gradient; where the held-sums
// instances may run, `held_sums`, some of them in registers: held).
struct SharedRowSpace {
  size_t row_elem_bytes = 0;
  int param_rows = 0;
  size_t param_elem_bytes = 0, acc_bytes = 0, smem_per_block = 0;
  int max_cluster_blocks = 1;
  size_t dy_elem_bytes = 0;
  int grad_rows = 0;
  int bulk_stages = 0;  // the bulk loads' chunks where taken (the function bulk_stages)
  // The held-sums instances (the backward's, with its bulk loads): whether they may run, for which norm, and
  // whether the weight's gradient is requested.
  bool held_sums = false, layer_norm = false, weight_grad = false;

  // The gradients whose sums the held-sums instance holds for slices of `slice_vectors` vectors of `vec` elements
  // (held_gradients; with the row on chip, bulk-loaded), where it holds a requested one; 0: no held-sums instance.
  int held(int64_t slice_vectors, int vec, bool with_row = true) const {
    const bool holds =
        held_sums && with_row && bulk_stages > 0 && holds_sums_for(vec, row_elem_bytes, dy_elem_bytes, acc_bytes);
    const int h = holds ? held_gradients(ceil_div(slice_vectors, kSharedRowThreads), layer_norm, dy_elem_bytes) : 0;
    return held_requested(h, weight_grad, bias_grad()) > 0 ? h : 0;
  }
  bool bias_grad() const { return grad_rows > int{weight_grad}; }  // (the other requested gradient)
  // `with_row`: the slice of the row on chip (the backward may read it twice instead, keeping only its sums).
  SharedRowLayout layout(int64_t slice_vectors, int cluster_blocks, int vec, bool with_params,
                         bool with_row = true) const {
    const size_t row_bytes = with_row ? row_elem_bytes : 0, dy_bytes = with_row ? dy_elem_bytes : 0;
    const int h = held(slice_vectors, vec, with_row);
    const int own_rows = own_sum_rows(grad_rows, held_requested(h, weight_grad, bias_grad()),
                                      h > 0 && held_sums_over_row(h, acc_bytes, row_bytes, dy_bytes));
    return {slice_vectors * vec, cluster_blocks, row_bytes, with_params ? param_rows : 0,
            param_elem_bytes,    acc_bytes,      dy_bytes,  own_rows,
            bulk_stages};
  }
};

// The chunks `plan`'s shared-memory kernel loads by bulk copies (ForwardParams/BackwardParams::bulk_stages; 0: none),
// where `space` has their room. The forward takes them for every slice: one of at most kSharedRowUnroll rounds of
// the block's threads it reads once, into registers, releasing every chunk for the next row's copies at once; a
// longer one chunk by chunk as its normalize pass reads it. The backward takes them for every slice it keeps on chip.
inline int bulk_loads(const RowPlan& plan, const SharedRowSpace& space, bool forward) {
  return plan.shared_row() && (forward || plan.row_on_chip) ? space.bulk_stages : 0;
}

// The smallest cluster (a power of two up to kMaxClusterBlocks) whose blocks hold a row of `nvec` vectors in
// their shared memory (its slice of the row where `with_row`, of the weight and bias where `with_params`, and the
// backward's gradient sums), or 0 where none does.
inline int shared_row_cluster(int64_t nvec, int vec, const SharedRowSpace& s, bool with_params, bool with_row) {
  if (s.smem_per_block == 0) return 0;  // no shared-memory path
  for (int c = 1; c <= std::min(s.max_cluster_blocks, kMaxClusterBlocks); c *= 2) {
    if (s.layout(ceil_div(nvec, c), c, vec, with_params, with_row).total <= s.smem_per_block) return c;
  }
  return 0;
}

// `rows` rows a block, and the blocks M rows take.
inline void share_blocks(RowPlan& p, int64_t M, int rows) {
  p.rows_per_block = rows;
  p.blocks = std::max<int64_t>(1, std::min(ceil_div(M, p.rows_per_block), int64_t{1} << 30));
}

// Plans the row kernels for M rows of D elements of `elem_bytes` each.
// `vectorizable`: every pointer involved is 16-byte aligned and each row starts
// 16-byte aligned (D * elem_bytes % 16 == 0); otherwise the scalar path runs.
// Rows beyond the grid are handled by a grid-stride loop. The layout depends
// only on D, dtype and alignment, never on M: that makes a row's result
// independent of its batch.
// Rows too long for registers go to the shared-memory path where `shared` has room for them, with the weight and
// bias beside them where the device's largest cluster has room for those too (they are then read once per block,
// not once per row), and to the multi-pass path otherwise. Each is a function of D, dtype, alignment, the
// parameters and gradients asked for and the device.
inline RowPlan plan_rows(int64_t M, int64_t D, int elem_bytes, bool vectorizable, RegisterBudget budget,
                         const SharedRowSpace& shared = {}) {
  RowPlan p{};
  p.vec = vectorizable ? kVectorBytes / elem_bytes : 1;
  const int64_t nvec = ceil_div(D, p.vec);
  const int large = large_items(p.vec, budget);
  if (nvec <= int64_t{kSmallItems} * 32) {  // short rows: a warp or less per row
    p.items = kSmallItems;
    p.threads_per_row = next_pow2(ceil_div(nvec, kSmallItems));
  } else if (nvec <= int64_t{large} * budget.max_threads) {  // the row fits in the registers of a block
    p.items = large;
    p.threads_per_row = std::max(32, next_pow2(ceil_div(nvec, large)));
  } else {  // longer rows: staged on chip, or several passes
    p.items = 0;
    // The first that a cluster holds: the row with the weight and bias (read once per block, not once per row);
    // the row alone; and for the backward, whose gradient sums must stay on chip, those sums with the weight, then
    // alone, the row read twice (the second time mostly from L2: one extra read, not the multi-pass kernel's
    // read-modify-write of the sums in global memory for every row).
    struct Staging {
      bool row, params;
    };
    for (const Staging s : {Staging{true, true}, Staging{true, false}, Staging{false, true}, Staging{false, false}}) {
      if (!s.row && shared.grad_rows == 0) break;
      p.cluster_blocks = shared_row_cluster(nvec, p.vec, shared, s.params, s.row);
      if (!p.shared_row()) continue;
      p.row_on_chip = s.row;
      p.slice_params = s.params && shared.param_rows > 0;
      break;
    }
    p.threads_per_row = p.shared_row() ? kSharedRowThreads : budget.max_threads;
    p.slice_vectors = p.shared_row() ? ceil_div(nvec, p.cluster_blocks) : 0;
    p.held = p.shared_row() ? shared.held(p.slice_vectors, p.vec, p.row_on_chip) : 0;
  }
  share_blocks(p, M, std::max(1, budget.rows_block_threads / p.threads_per_row));
  return p;
}

// Caps the grid at the blocks the device holds at once, for the register
// kernels: each block then walks many rows, and what it does once (the
// backward's partial row per gradient, the forward's copy of the weight and
// bias) is done once per resident block. `blocks_per_sm` is the kernel's
// occupancy at its launch configuration, from the occupancy API.
inline void limit_to_one_wave(RowPlan& p, const DeviceLimits& d, int blocks_per_sm) {
  p.blocks = std::max<int64_t>(1, std::min(p.blocks, int64_t{d.num_sms} * std::max(1, blocks_per_sm)));
}

// A grid of whole clusters of `cluster` blocks, as many as the device holds at once (`resident_clusters`, from the
// occupancy API) and `units` give work to, each walking its units: the shared-memory path's rows (a cluster of
// cluster_blocks per row), the backward's rows or tiles of rows in clusters of partial_cluster_blocks.
inline void limit_to_resident_clusters(RowPlan& p, int64_t units, int64_t resident_clusters, int cluster) {
  const int64_t clusters =
      std::max<int64_t>(1, std::min({units, resident_clusters, (int64_t{1} << 30) / kMaxClusterBlocks}));
  p.blocks = clusters * cluster;
}

// Whether the backward adds its blocks' partial rows over clusters (partial_cluster_blocks) for sums of
// `acc_bytes`: not float64's, whose register kernels have no registers left for it (ptxas spills) and whose rows
// are bound by their arithmetic rather than by the partial rows.
constexpr bool partial_clusters_for(int acc_bytes) { return acc_bytes == 4; }

// The backward's row groups whose partial rows are added on chip into one (a thread-block cluster of that many
// groups, so the reduce reads that many times fewer rows). A group is a block that holds whole rows (the register
// path, the shared-memory path's single blocks), in clusters up to kPortableClusterBlocks (no opt-in), or the
// p.cluster_blocks blocks a row is split over, in clusters up to the device's largest: alone, such clusters leave a
// partial row D wide per resident cluster, 13% more traffic for a bfloat16 LayerNorm of any D over 16384. The largest
// power of two that fits and that the rows fill (`p.blocks`, before the grid is capped at one wave); 1 without
// clusters, or without parameter gradients to sum, or with float64 sums (partial_clusters_for).
inline int partial_cluster_blocks(const RowPlan& p, const DeviceLimits& d, bool grads, int acc_bytes) {
  if (!grads || !partial_clusters_for(acc_bytes) || p.multipass()) return 1;
  const int row_cluster = std::max(1, p.cluster_blocks);
  const int largest = row_cluster > 1 ? std::min(d.max_cluster_blocks, kMaxClusterBlocks)
                                      : std::min(d.max_cluster_blocks, kPortableClusterBlocks);
  const int64_t most = std::min<int64_t>(largest / row_cluster, p.blocks);
  int groups = 1;
  while (groups * 2 <= most) groups *= 2;
  return groups;
}

}  // namespace torch_ln
