// Backward kernels: dx for each row, and the weight/bias gradients as float32
// (float64) partial sums, one partial row per block or thread-block cluster,
// later reduced in a fixed order by grad_reduce.cuh. No atomics: results are
// bitwise reproducible.
//
// With xhat = (x - mean) * rstd and g = dy * weight:
//   LayerNorm: dx = rstd * (g - sum(g) / D - xhat * sum(g * xhat) / D)
//   RMSNorm:   dx = rstd * (g - xhat * sum(g * xhat) / D)          (mean = 0)
//   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy.
#pragma once

#include <type_traits>

#include "../norm_kind.h"
#include "../row_strides.h"
#include "gate.cuh"
#include "launch_plan.h"
#include "reduce.cuh"
#include "rounding.cuh"
#include "shared_vectors.cuh"

namespace torch_ln {

// R: the element type of x and dx, T's or, after a residual add, residual_out's.
// Where the rows of x start, an argument only some kernels take (BackwardParams::x_rows): with Strided false it holds
// nothing, and the rows are contiguous.
template <bool Strided>
struct XRowStarts {
  RowStrides strides;
  TLN_DEVICE int64_t offset(int64_t row, int64_t) const { return strides.offset(row); }
};
template <>
struct XRowStarts<false> {
  TLN_DEVICE int64_t offset(int64_t row, int64_t cols) const { return row * cols; }
};

template <typename T, typename W, typename acc_t, typename R = T>
struct BackwardParams {
  const T* dy;
  const R* x;
  const acc_t* mean;  // nullptr for RMSNorm
  const acc_t* rstd;
  const W* weight;         // nullptr: no weight
  R* dx;                   // nullptr: dx not requested
  acc_t* partial_dweight;  // [partial rows, cols], or nullptr when not requested
  acc_t* partial_dbias;    // [partial rows, cols], or nullptr when not requested
  int64_t rows, cols;
  int threads_per_row;
  const R* grad_residual_out;  // added to dx; nullptr when there is none
  DeviceRounding<acc_t> rounding;
  // The shared-memory kernel (RowPlan): blocks a row is split over, vectors a block holds, whether it keeps its
  // slice of the row (else reads it twice) and of the weight on chip.
  int cluster_blocks = 0;
  int64_t slice_vectors = 0;
  bool row_on_chip = false;
  bool staged_weight = false;
  int bulk_stages = 0;  // the shared-memory kernel: its slices of x and dy loaded by bulk copies in this many chunks
  // The register kernel's prefetch of its next tiles (TilePrefetch), or the shared-memory kernel's of its weight
  // (WeightRing): its ring's stages (0: none; 2 or 3), and where in the dynamic shared memory the ring starts (bytes,
  // after the row reductions' and partial rows' room, or after the slices' layout).
  int prefetch_stages = 0;
  size_t prefetch_offset = 0;
  // The blocks of a thread-block cluster (sm_90) whose partial rows are added on chip into one: the register
  // kernels', and the shared-memory kernel's where a block holds whole rows.
  int partial_cluster = 1;
  // memory_efficient (BackwardArgs::from_output): x is the forward's output y, and xhat = y * inverse_weight
  // (1 / (weight + offset); nullptr without a weight: xhat = y).
  bool from_output = false;
  const acc_t* inverse_weight = nullptr;
  // Where each row of x starts: cols apart, but for a strided view (BackwardArgs). Only where x has the input's
  // dtype: any other x is the fused add's float32 residual stream, contiguous, whose kernels sit at their register
  // cap (an argument more made ptxas spill two of them).
  [[no_unique_address]] XRowStarts<std::is_same_v<T, R>> x_rows;
  // A gated RMSNorm (the kernels' GATED instances): the gate and its gradient, a grouped norm's groups as rows.
  DeviceGate<T> gate = {};

  TLN_DEVICE int64_t x_offset(int64_t row) const { return x_rows.offset(row, cols); }
};

// g = dy * weight (dy without weight), rounded to the input dtype under Llama-style rounding.
template <typename T, typename Params, typename acc_t>
TLN_DEVICE acc_t weighted_grad(const Params& p, acc_t dy, acc_t w) {
  return p.rounding.template to_input<T>(p.weight != nullptr ? dev::mul_rn(dy, p.rounding.weight(w)) : dy);
}

// The weight at element offset i, or zeros without one (then weighted_grad ignores it).
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_weight(const BackwardParams<T, W, acc_t, R>& p, int64_t i, acc_t (&w)[VEC]) {
  if (p.weight != nullptr) {
    load_vec<VEC>(p.weight, i, w);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = acc_t(0);
  }
}

// Turns one vector of the rows read into xhat: (x - mean) * rstd, or from the forward's output (memory_efficient)
// y * inverse (the vector's 1 / (weight + offset)), y itself without a weight.
template <int VEC, typename Params, typename acc_t>
TLN_DEVICE void to_xhat(const Params& p, const acc_t (&inverse)[VEC], acc_t mean, acc_t rstd, acc_t (&x)[VEC]) {
  if (p.from_output) {
    if (p.inverse_weight == nullptr) return;
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[j] *= inverse[j];
    return;
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) x[j] = (x[j] - mean) * rstd;
}

// to_xhat for the vector at element offset i, its inverse weights read from global memory (L1) where needed.
template <int VEC, typename Params, typename acc_t>
TLN_DEVICE void to_xhat_at(const Params& p, int64_t i, acc_t mean, acc_t rstd, acc_t (&x)[VEC]) {
  acc_t inverse[VEC] = {};
  if (p.from_output && p.inverse_weight != nullptr) load_vec<VEC>(p.inverse_weight, i, inverse);
  to_xhat(p, inverse, mean, rstd, x);
}

// Adds one vector's terms (xhat, dy, the weight w) to the row sums of g and g * xhat.
template <typename T, int VEC, typename Params, typename acc_t>
TLN_DEVICE void add_row_terms(const Params& p, const acc_t (&xhat)[VEC], const acc_t (&dy)[VEC], const acc_t (&w)[VEC],
                              acc_t& sum_g, acc_t& sum_g_xhat) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const acc_t g = weighted_grad<T>(p, dy[j], w[j]);
    sum_g += g;
    sum_g_xhat += g * xhat[j];
  }
}

// A gated norm's row as the norm saw it (GATED instances), for one vector at element offset i as loaded: x becomes
// h = x * act(z) with a gate before the norm; with a gate after it, dy becomes the weighted value's gradient
// dy * act(z), rounded to the input dtype where that value is (autograd's cast: rounds_weighted).
template <bool GATED, int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void gate_row_vector(const BackwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, acc_t (&x)[VEC],
                                acc_t (&dy)[VEC]) {
  if constexpr (GATED) {
    if (p.gate.z == nullptr) return;
    if (p.gate.before) {  // (not a reference chosen at run time: that puts both arrays in local memory)
      p.gate.multiply(row * p.cols + i, x);
      return;
    }
    p.gate.multiply(row * p.cols + i, dy);
    if (!rounds_weighted<T, W>(p)) return;
#pragma unroll
    for (int j = 0; j < VEC; ++j) dy[j] = static_cast<acc_t>(static_cast<T>(dy[j]));
  }
}

// Whether a row's second pass has gradients to store: dx, or a gated norm's dz.
template <bool GATED, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE bool wants_row_grads(const BackwardParams<T, W, acc_t, R>& p) {
  return p.dx != nullptr || (GATED && p.gate.dz != nullptr);
}

// A gated norm's dx and dz for one vector at element offset i, from dh, the gradient of the row the norm saw
// (GATED instances): before the norm, dz = dh * x * act'(z) and dx = dh * act(z); after it, dx = dh and
// dz = dy * (the weighted value, as the forward rounded it) * act'(z).
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void store_gated_grads(const BackwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i,
                                  const acc_t (&xhat)[VEC], const acc_t (&w)[VEC], acc_t (&dh)[VEC]) {
  if (p.gate.z != nullptr) {
    acc_t a[VEC], slope[VEC], value[VEC];
    p.gate.act(row * p.cols + i, a, slope);
    if (p.gate.before) {
      load_vec<VEC>(p.x + p.x_offset(row), i, value);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        value[j] = p.rounding.template to_input<T>(xhat[j]);
        if (p.weight != nullptr) value[j] *= w[j];
        if (rounds_weighted<T, W>(p)) value[j] = static_cast<acc_t>(static_cast<T>(value[j]));
      }
    }
    if (p.gate.dz != nullptr) {
      acc_t grad[VEC], dz[VEC];
      if (p.gate.before) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) grad[j] = dh[j];
      } else {
        load_vec<VEC>(p.dy + row * p.cols, i, grad);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) dz[j] = grad[j] * value[j] * slope[j];
      store_vec<VEC>(p.gate.dz + row * p.cols, i, dz);
    }
    if (p.gate.before) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dh[j] *= a[j];
    }
  }
  if (p.dx != nullptr) store_vec<VEC>(p.dx + row * p.cols, i, dh);
}

// dx for one vector, from the row's reduced sums (already divided by D). g is
// rounded exactly as in add_row_terms (mul_rn), so with D = 1 dx is exactly 0.
// With a residual add, grad_residual_out is added to dx. GATED: a gated norm's, with dz (store_gated_grads).
template <NormKind KIND, bool GATED = false, int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void store_dx(const BackwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, const acc_t (&xhat)[VEC],
                         const acc_t (&dy)[VEC], const acc_t (&w)[VEC], acc_t rstd, acc_t mean_g, acc_t mean_g_xhat) {
  acc_t dx[VEC], extra[VEC];
  if (p.grad_residual_out != nullptr) load_vec<VEC>(p.grad_residual_out + row * p.cols, i, extra);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const acc_t g = weighted_grad<T>(p, dy[j], w[j]);
    const acc_t centred = KIND == NormKind::LayerNorm ? g - mean_g : g;
    dx[j] = rstd * (centred - xhat[j] * mean_g_xhat);
    if (p.grad_residual_out != nullptr) dx[j] += extra[j];
  }
  if constexpr (GATED) {
    store_gated_grads(p, row, i, xhat, w, dx);
  } else {
    store_vec<VEC>(p.dx + row * p.cols, i, dx);
  }
}

// The partial rows of `groups` groups of a thread-block cluster, added in group order through distributed shared
// memory into one: `load(g, c, v)` reads vector c of group g's row (of its part of the row). This block is of group
// `group`: it writes the vectors group x threads + thread, strided by the groups' threads.
template <int VEC, typename acc_t, typename Load>
TLN_DEVICE void store_cluster_partial(acc_t* partial, int64_t nvec, int group, int groups, const Load& load) {
  dev::cluster_sync();  // every block's row on chip
  const int64_t threads = dev::block_dim_x();
  for (int64_t c = group * threads + dev::thread_x(); c < nvec; c += groups * threads) {
    acc_t total[VEC] = {};
    for (int g = 0; g < groups; ++g) {
      acc_t v[VEC];
      load(g, c, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) total[j] += v[j];
    }
    store_vec<VEC>(partial, c * VEC, total);
  }
  dev::cluster_sync();  // no block reuses (or exits with) its shared memory while another reads it
}

// store_cluster_partial's load for the shared-memory kernel: group g's copy of this block's slice of the sums (rank
// g x cluster + slice_rank). A class, not a lambda in the kernel, so coverage counts its arms once for every kernel
// instance of the same vectors.
template <typename acc_t, int VEC>
struct GroupSliceSums {
  const SharedVectors<acc_t, VEC>& sums;
  int cluster;
  unsigned slice_rank;
  TLN_DEVICE void operator()(int g, int64_t c, acc_t (&v)[VEC]) const {
    load_from_rank(sums, g * cluster + slice_rank, c, v);
  }
};

// The block's partial row of one gradient: its row-slots' sums added on chip in slot order, and where `cluster` > 1
// the cluster's blocks' rows added in rank order (store_cluster_partial), so a block (a cluster) writes one partial
// row, whatever its rows per block. Shared memory holds the slots' vectors plane by plane (element j of every vector
// together), so a warp's accesses fall in distinct banks.
template <int VEC, int ITEMS, typename acc_t>
TLN_DEVICE void store_block_partial(acc_t* partial, const acc_t (&sums)[ITEMS][VEC], const RowLayout& layout,
                                    int64_t nvec, acc_t* smem, int cluster) {
  if (layout.rows_per_block == 1 && cluster == 1) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int64_t c = layout.vector(k);
      if (c < nvec) store_vec<VEC>(partial, c * VEC, sums[k]);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int64_t c = layout.vector(k);
    if (c >= nvec) continue;
#pragma unroll
    for (int j = 0; j < VEC; ++j) dev::store_shared(&smem[(layout.row_in_block * VEC + j) * nvec + c], sums[k][j]);
  }
  dev::sync_threads();
  for (int64_t c = dev::thread_x(); c < nvec; c += dev::block_dim_x()) {
    acc_t total[VEC] = {};
    for (int r = 0; r < layout.rows_per_block; ++r) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) total[j] += dev::load_shared(&smem[(r * VEC + j) * nvec + c]);
    }
    if (cluster == 1) {
      store_vec<VEC>(partial, c * VEC, total);
    } else {  // the block's row, for the cluster: in row 0's planes, column c (only this thread reads it)
#pragma unroll
      for (int j = 0; j < VEC; ++j) dev::store_shared(&smem[j * nvec + c], total[j]);
    }
  }
  if constexpr (partial_clusters_for(sizeof(acc_t))) {
    if (cluster > 1) {  // each block's row in planes 0..VEC-1
      store_cluster_partial<VEC>(partial, nvec, dev::cluster_rank(), cluster, [&](int rank, int64_t c, acc_t(&v)[VEC]) {
        const acc_t* remote = dev::cluster_shared(smem, rank);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = dev::load_shared(&remote[j * nvec + c]);
      });
      return;
    }
  }
  dev::sync_threads();  // smem is reused by the next gradient
}

// A row of a register kernel's tile: whether the thread has one (the last tile may be partial), which, and its
// statistics (mean 0 for RMSNorm; both 0 where inactive).
template <typename acc_t>
struct TileRow {
  bool active;
  int64_t row;
  acc_t mean, rstd;
};

template <typename T, typename W, typename acc_t, typename R>
TLN_DEVICE TileRow<acc_t> tile_row(const BackwardParams<T, W, acc_t, R>& p, const GroupWalk& walk,
                                   const RowLayout& layout, int64_t tile, int64_t batch_rows) {
  const bool active = tile + layout.row_in_block < batch_rows;
  const int64_t row = walk.row(tile + layout.row_in_block);
  return {active, row, active && p.mean != nullptr ? dev::load_global(&p.mean[row]) : acc_t(0),
          active ? dev::load_global(&p.rstd[row]) : acc_t(0)};
}

// The register backward's next tiles, prefetched: each thread copies its row's statistics and its vectors of x and
// dy for the tiles ahead into its own slots of a ring of `stages` stages (ThreadRing, one group a tile) while it works
// on this tile, and waits for this tile's group when it gets there (RingWalk), so a row's loads are not a round trip
// to DRAM after the last row's stores. Its statistics: acc_t (stage * 2 + s) * threads + thread, after x's and dy's.
template <typename T, typename R, int VEC, int ITEMS>
struct TilePrefetch {
  ThreadRing<R, VEC, ITEMS> x;
  ThreadRing<T, VEC, ITEMS> dy;
  float* stats;

  TLN_DEVICE TilePrefetch(unsigned char* base, int stages, int64_t block_threads)
      : x(base, stages, block_threads),
        dy(base + ThreadRing<R, VEC, ITEMS>::bytes(stages, block_threads), stages, block_threads),
        stats(reinterpret_cast<float*>(base + ThreadRing<R, VEC, ITEMS>::bytes(stages, block_threads) +
                                       ThreadRing<T, VEC, ITEMS>::bytes(stages, block_threads))) {}

  TLN_DEVICE float* stat(int stage, int s) const { return &stats[(int64_t{stage} * 2 + s) * x.threads + x.thread]; }

  // The thread's row of `tile`, its statistics as copied into `stage`.
  template <typename W>
  TLN_DEVICE TileRow<float> row(const BackwardParams<T, W, float, R>& p, const GroupWalk& walk, const RowLayout& layout,
                                int64_t tile, int64_t batch_rows, int stage) const {
    const bool active = tile + layout.row_in_block < batch_rows;
    return {active, walk.row(tile + layout.row_in_block),
            active && p.mean != nullptr ? dev::load_shared(stat(stage, 0)) : 0.0f,
            active ? dev::load_shared(stat(stage, 1)) : 0.0f};
  }
};

// Copies a thread's row of `tile` into `stage` of its prefetch ring (RingWalk): its mean (LayerNorm) and rstd, and
// its vectors in the row.
template <typename T, typename W, typename R, int VEC, int ITEMS>
TLN_DEVICE void copy_tile(const TilePrefetch<T, R, VEC, ITEMS>& ring, const BackwardParams<T, W, float, R>& p,
                          const GroupWalk& walk, const RowLayout& layout, int64_t tile, int64_t batch_rows, int stage) {
  if (tile + layout.row_in_block >= batch_rows) return;
  const int64_t row = walk.row(tile + layout.row_in_block);
  if (p.mean != nullptr) dev::copy_async_4(ring.stat(stage, 0), &p.mean[row]);
  dev::copy_async_4(ring.stat(stage, 1), &p.rstd[row]);
  ring.x.copy(p.x + p.x_offset(row), layout, p.cols / VEC, stage);
  ring.dy.copy(p.dy + row * p.cols, layout, p.cols / VEC, stage);
}

// Rows held in registers, laid out as in the forward. A block walks the tiles
// block, block + blocks, ...; each thread keeps its columns' weight and its
// share of the weight/bias gradient sums in registers, and the block (where
// p.partial_cluster > 1, its thread-block cluster) writes one partial row per
// gradient at the end. GATED (here and in the multi-pass kernel): the gated RMSNorm's instance (p.gate), whose
// blocks walk the rows of one group (GroupWalk).
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC, int ITEMS, bool GATED>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(gated_budget(kBackwardBudget, GATED).max_threads)
    norm_backward_kernel(BackwardParams<T, W, acc_t, R> p) {
  const GroupWalk walk = group_walk<GATED>(p);
  acc_t* smem = dev::dynamic_shared<acc_t>();
  const RowLayout layout(p.threads_per_row);
  const int64_t nvec = p.cols / VEC;
  acc_t w[ITEMS][VEC] = {};  // the same columns in every row: read once
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (layout.vector(k) < nvec) load_weight(p, layout.vector(k) * VEC, w[k]);
  }
  acc_t dweight[ITEMS][VEC] = {};
  // LayerNorm's bias-gradient sums; from the output (memory_efficient, never with a bias) the inverse weights
  // instead, read once: one more vector per xhat spilled the float32 kernels at their register cap.
  acc_t dbias[ITEMS][VEC] = {};
  if (KIND == NormKind::LayerNorm && p.from_output && p.inverse_weight != nullptr) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (layout.vector(k) < nvec) load_vec<VEC>(p.inverse_weight, layout.vector(k) * VEC, dbias[k]);
    }
  }
  const int64_t batch_rows = p.rows / walk.groups;
  const int64_t first_tile = walk.unit * layout.rows_per_block, tile_step = walk.units * layout.rows_per_block;
  constexpr bool kPrefetches = ring_prefetches(VEC, sizeof(acc_t), GATED);
  const int stages = kPrefetches ? p.prefetch_stages : 0;
  const bool prefetch = stages > 0;
  const TilePrefetch<T, R, VEC, ITEMS> ring(dev::dynamic_shared<unsigned char>() + p.prefetch_offset, stages,
                                            dev::block_dim_x());
  const RingWalk ring_walk(ring, p, walk, layout, tile_step, batch_rows, stages);
  if constexpr (kPrefetches) ring_walk.fill(first_tile);
  int stage = 0;
  for (int64_t tile = first_tile; tile < batch_rows; tile += tile_step, stage = next_stage(stage, stages)) {
    TileRow<acc_t> at;
    if constexpr (kPrefetches) {
      if (prefetch) {
        ring_walk.turn(tile, stage);
        at = ring.row(p, walk, layout, tile, batch_rows, stage);
      }
    }
    if (!prefetch) at = tile_row(p, walk, layout, tile, batch_rows);
    const bool active = at.active;
    const int64_t row = at.row;
    const acc_t mean = at.mean, rstd = at.rstd;
    acc_t xhat[ITEMS][VEC], dy[ITEMS][VEC];
    const R* x_row = p.x + p.x_offset(row);
    // Every load of the row is issued before the first use: predicated loads in straight-line code (no branch
    // per vector), so the loads are in flight together.
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const bool in_row = active && layout.vector(k) < nvec;
      // float64 rows are bound by their arithmetic, and all their loads at once would spill: one branch each.
      if (sizeof(acc_t) == 8 && !in_row) continue;
      if constexpr (kPrefetches) {
        if (prefetch) {  // (vectors beyond the row are neither copied nor used)
          if (!in_row) continue;
          ring.x.load(stage, k, xhat[k]);
          ring.dy.load(stage, k, dy[k]);
          continue;
        }
      }
      to_acc(load_vec_if<VEC>(in_row, x_row, layout.vector(k) * VEC), xhat[k]);
      to_acc(load_vec_if<VEC>(in_row, p.dy, row * p.cols + layout.vector(k) * VEC), dy[k]);
    }
    acc_t sum_g = acc_t(0), sum_g_xhat = acc_t(0);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!active || layout.vector(k) >= nvec) continue;
      gate_row_vector<GATED>(p, row, layout.vector(k) * VEC, xhat[k], dy[k]);
      if constexpr (KIND == NormKind::LayerNorm) {
        to_xhat(p, dbias[k], mean, rstd, xhat[k]);
      } else {
        to_xhat_at(p, layout.vector(k) * VEC, mean, rstd, xhat[k]);
      }
      add_row_terms<T>(p, xhat[k], dy[k], w[k], sum_g, sum_g_xhat);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        dweight[k][j] += p.rounding.template weight_term<T>(dy[k][j], xhat[k][j]);
        // RMSNorm has no bias, nor a LayerNorm from the output
        if (KIND == NormKind::LayerNorm && !p.from_output) dbias[k][j] += dy[k][j];
      }
    }
    row_sum2(sum_g, sum_g_xhat, p.threads_per_row, smem);
    if (!active || !wants_row_grads<GATED>(p)) continue;
    const acc_t inv_cols = acc_t(1) / static_cast<acc_t>(p.cols);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int64_t c = layout.vector(k);
      if (c < nvec)
        store_dx<KIND, GATED>(p, row, c * VEC, xhat[k], dy[k], w[k], rstd, sum_g * inv_cols, sum_g_xhat * inv_cols);
    }
  }
  dev::allow_dependent_launch();  // the reduce's launch overlaps the partial rows' stores
  // Every block (cluster) writes its whole partial rows, zeros included, so the buffers need no clearing.
  int cluster = 1;
  if constexpr (partial_clusters_for(sizeof(acc_t))) cluster = p.partial_cluster;
  const int64_t slot = dev::block_x() / cluster;
  if (p.partial_dweight != nullptr) {
    store_block_partial(p.partial_dweight + slot * p.cols, dweight, layout, nvec, smem, cluster);
  }
  if (KIND == NormKind::LayerNorm && p.partial_dbias != nullptr) {
    store_block_partial(p.partial_dbias + slot * p.cols, dbias, layout, nvec, smem, cluster);
  }
}

// Adds a vector to a slot's partial row in global memory (the slot's own row:
// no other thread touches it, so no atomics).
template <int VEC, typename acc_t>
TLN_DEVICE void accumulate_partial(acc_t* partial, int64_t i, const acc_t (&v)[VEC]) {
  acc_t sum[VEC];
  load_vec<VEC>(partial, i, sum);
#pragma unroll
  for (int j = 0; j < VEC; ++j) sum[j] += v[j];
  store_vec<VEC>(partial, i, sum);
}

// Rows too long for registers: a row per block at a time, two passes over each
// row (the sums, then dx and the gradient terms added to the block's
// zero-initialized partial rows).
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC, bool GATED>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(gated_budget(kBackwardBudget, GATED).max_threads)
    norm_backward_multipass_kernel(BackwardParams<T, W, acc_t, R> p) {
  const GroupWalk walk = group_walk<GATED>(p);
  acc_t* smem = dev::dynamic_shared<acc_t>();
  const int threads = dev::block_dim_x();
  const int64_t nvec = p.cols / VEC;
  const int64_t slot = dev::block_x();
  for (int64_t batch_row = walk.unit; batch_row < p.rows / walk.groups; batch_row += walk.units) {
    const int64_t row = walk.row(batch_row);
    const acc_t mean = p.mean != nullptr ? dev::load_global(&p.mean[row]) : acc_t(0);
    const acc_t rstd = dev::load_global(&p.rstd[row]);
    acc_t xhat[VEC], dy[VEC], w[VEC];
    // One pass of the row: xhat, dy and the weight at element offset i, with the row sums' terms.
    auto load_row = [&](int64_t i, acc_t& sum_g, acc_t& sum_g_xhat) {
      load_vec<VEC>(p.x + p.x_offset(row), i, xhat);
      load_vec<VEC>(p.dy + row * p.cols, i, dy);
      load_weight(p, i, w);
      gate_row_vector<GATED>(p, row, i, xhat, dy);
      to_xhat_at(p, i, mean, rstd, xhat);
      add_row_terms<T>(p, xhat, dy, w, sum_g, sum_g_xhat);
    };
    acc_t sum_g = acc_t(0), sum_g_xhat = acc_t(0);
    for (int64_t c = dev::thread_x(); c < nvec; c += threads) load_row(c * VEC, sum_g, sum_g_xhat);
    row_sum2(sum_g, sum_g_xhat, threads, smem);
    const acc_t inv_cols = acc_t(1) / static_cast<acc_t>(p.cols);
    for (int64_t c = dev::thread_x(); c < nvec; c += threads) {
      acc_t unused_g = acc_t(0), unused_g_xhat = acc_t(0);
      load_row(c * VEC, unused_g, unused_g_xhat);
      if (wants_row_grads<GATED>(p)) {
        store_dx<KIND, GATED>(p, row, c * VEC, xhat, dy, w, rstd, sum_g * inv_cols, sum_g_xhat * inv_cols);
      }
      acc_t dy_xhat[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) dy_xhat[j] = p.rounding.template weight_term<T>(dy[j], xhat[j]);
      if (p.partial_dweight != nullptr) accumulate_partial(p.partial_dweight + slot * p.cols, c * VEC, dy_xhat);
      if (p.partial_dbias != nullptr) accumulate_partial(p.partial_dbias + slot * p.cols, c * VEC, dy);
    }
  }
}

// Adds v to vector c of a block's gradient sums in shared memory (a vector only its thread touches).
template <int VEC, typename acc_t>
TLN_DEVICE void add_to_sums(const SharedVectors<acc_t, VEC>& sums, int64_t c, const acc_t (&v)[VEC]) {
  acc_t sum[VEC];
  sums.load(c, sum);
  Vec<acc_t, VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out.v[j] = sum[j] + v[j];
  sums.store(c, out);
}

// One vector's terms of the weight and bias gradients (those asked for: dweight, dbias), added to a block's sums by
// add(gradient, terms): gradient 0 the weight's, 1 the bias'.
template <int VEC, typename T, typename W, typename acc_t, typename R, typename Add>
TLN_DEVICE void add_gradient_terms(const BackwardParams<T, W, acc_t, R>& p, bool dweight, bool dbias,
                                   const acc_t (&xhat)[VEC], const acc_t (&dy)[VEC], const Add& add) {
  if (dweight) {
    acc_t dy_xhat[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) dy_xhat[j] = p.rounding.template weight_term<T>(dy[j], xhat[j]);
    add(0, dy_xhat);
  }
  if (dbias) add(1, dy);
}

// The shared-memory backward's gradient sums held in registers (its held-sums instances): the sums of gradients
// 0 .. GRADS - 1 (0: the weight's, 1: the bias') of the vectors c = thread + round * threads of the block's slice
// (rounds 0 .. ROUNDS - 1), added to with no shared-memory read and write a row, and stored to the block's sums in
// shared memory once, after its last row.
template <typename acc_t, int VEC, int ROUNDS, int GRADS>
struct HeldGradientSums {
  acc_t sums[GRADS][ROUNDS][VEC] = {};

  // Gradient `gradient`'s terms of slice vector c, of round `round`: to its held sums, or to `shared` (its sums in
  // shared memory) where it has none.
  TLN_DEVICE void add(int gradient, int round, int64_t c, const acc_t (&v)[VEC],
                      const SharedVectors<acc_t, VEC>& shared) {
    if (gradient >= GRADS) {
      add_to_sums(shared, c, v);
      return;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) sums[gradient][round][j] += v[j];
  }
  TLN_DEVICE void store(const SharedVectors<acc_t, VEC> (&to)[2], const bool (&wanted)[2], int64_t count) const {
#pragma unroll
    for (int round = 0; round < ROUNDS; ++round) {
      const int64_t c = dev::thread_x() + int64_t{round} * dev::block_dim_x();
#pragma unroll
      for (int g = 0; g < GRADS; ++g) {
        if (!wanted[g] || c >= count) continue;
        Vec<acc_t, VEC> v;
#pragma unroll
        for (int j = 0; j < VEC; ++j) v.v[j] = sums[g][round][j];
        to[g].store(c, v);
      }
    }
  }
};

// The weight of vector c of a block's slice (whose first vector is `first`): from the block's copy where
// p.staged_weight, from global memory otherwise.
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void slice_weight(const BackwardParams<T, W, acc_t, R>& p, const SharedVectors<W, VEC>& staged,
                             int64_t first, int64_t c, acc_t (&w)[VEC]) {
  if (p.staged_weight) {
    staged.load(c, w);
  } else {
    load_weight(p, (first + c) * VEC, w);
  }
}

// The held-sums instance's weight where its block keeps no copy of its slice (weight_ring_instance; the launcher's
// p.prefetch_stages): a ThreadRing of `stages` of the thread's weight vectors, each copied by cp.async stages - 1
// uses ahead, from L2 (the same slice every row), in the order the thread uses them in both passes of every row: its
// vectors of the slice, c = thread + round * threads < count, round after round. Read as used instead, each use
// waited on an L2 round trip (16 a thread a row at float32 D=262144).
template <typename W, int VEC>
struct WeightRing {
  ThreadRing<W, VEC, 1> ring;
  const W* slice;  // the block's slice of the weight in global memory
  int stages;
  int rounds;     // the thread's vectors of the slice: at least 4 (its instance's slices are of 5-8 rounds)
  int ahead = 0;  // the round of the next copy
  int stage = 0;  // the stage of the next use

  TLN_DEVICE WeightRing(unsigned char* base, int ring_stages, const W* weight_slice, int64_t count, int threads)
      : ring(base, ring_stages, threads),
        slice(weight_slice),
        stages(ring_stages),
        rounds(static_cast<int>(ceil_div(count - dev::thread_x(), threads))) {}

  // Before the first use: the copies of the first stages - 1 uses, a group each.
  TLN_DEVICE void fill() {
    for (int s = 0; s + 1 < stages; ++s) {
      copy(s);
      dev::copy_async_commit();
    }
  }

  // The next use's weight: the copy stages - 1 uses ahead into the stage the last use read, then this use's wait.
  template <typename acc_t>
  TLN_DEVICE void next(acc_t (&w)[VEC]) {
    copy(previous_stage(stage, stages));
    ring_turn(stages);
    ring.load(stage, 0, w);
    stage = next_stage(stage, stages);
  }

 private:
  TLN_DEVICE void copy(int to) {
    ring.vectors.copy_async(ring.slot(to, 0), slice + (ring.thread + int64_t{ahead} * ring.threads) * VEC);
    ahead = ahead + 1 == rounds ? 0 : ahead + 1;
  }
};

// x and dy of one vector of a row as loaded, converted to acc_t.
template <int VEC, typename T, typename R, typename acc_t>
TLN_DEVICE void row_vector(const Vec<R, VEC>& x_raw, const Vec<T, VEC>& dy_raw, acc_t (&x)[VEC], acc_t (&dy)[VEC]) {
  to_acc(x_raw, x);
  to_acc(dy_raw, dy);
}

// One round of the shared-memory backward's loads of its slice of a row, x from element offset x_start and dy from
// dy_start: vectors base, base + threads, ... (N of each), as stored, none at or past `count`; all in flight before
// the first is used.
template <int N, int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_slice_round(const BackwardParams<T, W, acc_t, R>& p, int64_t x_start, int64_t dy_start,
                                 int64_t count, int64_t base, Vec<R, VEC> (&x_raw)[N], Vec<T, VEC> (&dy_raw)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const int64_t c = base + int64_t{k} * dev::block_dim_x();
    x_raw[k] = load_vec_if<VEC>(c < count, p.x, x_start + c * VEC);
    dy_raw[k] = load_vec_if<VEC>(c < count, p.dy, dy_start + c * VEC);
  }
}

// Element offsets of a row's slice (its first vector `first`) in dy, and in x: the same but for a strided x of the
// input's dtype (the only kind, see x_rows).
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE int64_t dy_slice_start(const BackwardParams<T, W, acc_t, R>& p, int64_t row, int64_t first) {
  return row * p.cols + first * VEC;
}
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE int64_t x_slice_start(const BackwardParams<T, W, acc_t, R>& p, int64_t row, int64_t first) {
  if constexpr (std::is_same_v<T, R>) {
    return p.x_offset(row) + first * VEC;
  } else {
    return dy_slice_start<VEC>(p, row, first);
  }
}

// The bulk copies of chunks [from, to) of `row`'s slices of x and dy (their first vector `first`) into the block's
// shared memory (x at its start, dy `dy_offset` bytes in), by thread 0 (`producer`), none past the last row. (Not a
// lambda in the kernel: see the forward's load_slice_chunks.)
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_slice_chunks(const SliceRing& ring, const BackwardParams<T, W, acc_t, R>& p, unsigned char* shared,
                                  size_t dy_offset, int64_t first, bool producer, int64_t row, int from, int to) {
  ring.load(producer && row < p.rows, from, to, SliceRing::Stream{shared, p.x + x_slice_start<VEC>(p, row, first)},
            SliceRing::Stream{shared + dy_offset, p.dy + dy_slice_start<VEC>(p, row, first)});
}

// Rows too long for registers (the backward of norm_forward_shared_kernel): a row per block, or per thread-block
// cluster of p.cluster_blocks (sm_90), each block owning a slice of p.slice_vectors of the columns for all the rows
// it walks. Per row a block reads its slices of x and dy once (kBackwardSharedUnroll vectors of each a thread, all in
// flight before the first is used), keeps them in shared memory where p.row_on_chip (as stored: the fewest bytes),
// adds the row sums' terms and, to the gradient sums it keeps in shared memory (acc_t) for the whole walk, dy * xhat
// and dy. The row sums go through the cluster in rank order (ClusterReduce2); dx is written once, from the slice on
// chip, or (rows too long for a cluster's shared memory) from a second read of it, mostly from L2: the one extra
// read. At the end each block writes its slice of its cluster's partial row, once, for reduce_partials_kernel. Where
// p.partial_cluster > 1 the launch's thread-block clusters hold that many groups of p.cluster_blocks blocks (of one
// block where a block holds whole rows), each group walking its own rows, and the groups' sums are added in group
// order first (store_cluster_partial), so a cluster writes one partial row. A thread touches only the vectors
// c = thread, thread + threads, ... of the slice, so only the row sums need barriers (bulk loads: each chunk's two
// mbarriers, SliceRing; without dx the slices are refilled whole after the row sums' block barrier).
// With p.bulk_stages (sm_90, the row on chip, x and dy of one size in 16-byte vectors) thread 0 instead has the copy
// engine load the slices of x and dy into shared memory (SliceRing), the block's next row's chunk by chunk as the dx
// pass finishes each: that row's loads are in flight during this row's dx pass and the next row's reductions.
// The weight slice is copied on chip once where p.staged_weight, read per row from global memory (L2) otherwise.
// HELD > 0: the held-sums instances, for bulk-loaded slices of at most kHeldSumVectors / HELD rounds of the block's
// threads (the launcher's choice: RowPlan::held, held_gradients), which keep the sums of the first HELD gradients
// (weight, bias) in registers for the whole walk (HeldGradientSums) instead of reading and writing them in shared
// memory every row, and store them after it, over the slices of x and dy where those have the room
// (held_sums_over_row); they have no other loads.
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC, int HELD = 0>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(kSharedRowThreads) norm_backward_shared_kernel(BackwardParams<T, W, acc_t, R> p) {
  unsigned char* shared = dev::dynamic_shared<unsigned char>();
  const bool dweight = p.partial_dweight != nullptr;
  const bool dbias = KIND == NormKind::LayerNorm && p.partial_dbias != nullptr;
  // The held gradients' sums stored over the row's slices after the walk (kOverRow), the others in rooms of their
  // own from layout.grads.
  constexpr bool kHeld = HELD > 0;
  constexpr bool kOverRow = kHeld && held_sums_over_row(HELD, sizeof(acc_t), sizeof(R), sizeof(T));
  const size_t row_bytes = p.row_on_chip ? sizeof(R) : 0, dy_bytes = p.row_on_chip ? sizeof(T) : 0;
  const SharedRowLayout layout(
      p.slice_vectors * VEC, p.cluster_blocks, row_bytes, int{p.staged_weight}, sizeof(W), sizeof(acc_t), dy_bytes,
      own_sum_rows(int{dweight} + int{dbias}, held_requested(HELD, dweight, dbias), kOverRow), p.bulk_stages);
  auto vectors = [&](auto elem, size_t offset) {
    using E = decltype(elem);
    return SharedVectors<E, VEC>{reinterpret_cast<typename SharedVectors<E, VEC>::Piece*>(shared + offset),
                                 p.slice_vectors};
  };
  const SharedVectors<R, VEC> x_slice = vectors(R{}, 0);
  const SharedVectors<T, VEC> dy_slice = vectors(T{}, layout.dy);
  const SharedVectors<W, VEC> weight_slice = vectors(W{}, layout.weight);
  size_t weight_sums_at = layout.grads;
  size_t bias_sums_at = layout.grads + (dweight ? SharedRowLayout::round16(p.slice_vectors * VEC * sizeof(acc_t)) : 0);
  if constexpr (kOverRow) {
    // From the row's start: the weight's over x's slice (and dy's, for 16-bit rows), the bias' over dy's (float32
    // rows: 16-bit ones hold both only in rooms of their own). The 0 is one ptxas cannot fold (the row is always on
    // chip here): as a constant, the float32 RMSNorm instance spilled 28 bytes.
    weight_sums_at = layout.grads * !p.row_on_chip;
    bias_sums_at = HELD >= 2 ? layout.dy : layout.grads;
  }
  const SharedVectors<acc_t, VEC> dweight_sums = vectors(acc_t{}, weight_sums_at);
  const SharedVectors<acc_t, VEC> dbias_sums = vectors(acc_t{}, bias_sums_at);
  acc_t* scratch = reinterpret_cast<acc_t*>(shared + layout.scratch);
  const int cluster = p.cluster_blocks;  // blocks a row is split over (a group)
  int groups = 1;
  if constexpr (partial_clusters_for(sizeof(acc_t))) groups = p.partial_cluster;
  const int group = groups > 1 ? static_cast<int>(dev::cluster_rank()) / cluster : 0;
  const int threads = dev::block_dim_x();
  const RowSlice mine = row_slice(p.cols / VEC, p.slice_vectors, cluster);
  const int64_t first = mine.first, count = mine.count;  // of the row, in vectors
  const Vec<acc_t, VEC> zeros{};
  for (int64_t c = dev::thread_x(); c < count; c += threads) {
    if (p.staged_weight)
      weight_slice.store(c, dev::load_global(reinterpret_cast<const Vec<W, VEC>*>(p.weight) + first + c));
    if (dweight && HELD < 1) dweight_sums.store(c, zeros);  // (held sums start at zero in registers)
    if (dbias && HELD < 2) dbias_sums.store(c, zeros);
  }
  // Bulk loads where the slices of x and dy are kept as stored, in 16-byte vectors (p.bulk_stages > 0: sm_90, the
  // row on chip).
  constexpr bool kBulkable = sizeof(R) == sizeof(T) && VEC * sizeof(T) == kVectorBytes;
  static_assert(!kHeld || kBulkable, "the held-sums instance loads its slices by bulk copies only");
  const bool bulk = kHeld || (kBulkable && p.bulk_stages > 0);
  constexpr int kHeldRounds = kHeld ? kHeldSumVectors / HELD : 1;
  HeldGradientSums<acc_t, VEC, kHeldRounds, kHeld ? HELD : 1> held;
  const SliceRing ring(shared + layout.stages, count, p.bulk_stages, threads);
  const bool producer = dev::thread_x() == 0;
  if (bulk && producer) ring.init(threads);
  ClusterReduce2<acc_t> cluster_sum2(shared + layout.exchange, cluster);
  if (bulk) dev::sync_threads();  // the ring's mbarriers, before anyone waits on them
  // The weight through a ring where the launcher gave one (this instance's slices are too long for its copy).
  constexpr bool kWeightRing = weight_ring_instance(HELD, KIND == NormKind::LayerNorm, VEC * sizeof(W));
  const bool weight_ringed = kWeightRing && p.prefetch_stages > 0;
  WeightRing<W, VEC> weight_ring(shared + p.prefetch_offset, p.prefetch_stages,
                                 weight_ringed ? p.weight + first * VEC : nullptr, count, threads);
  if constexpr (kWeightRing) {
    if (weight_ringed) weight_ring.fill();
  }
  // The weight of vector c of the slice, which each thread takes in the ring's order.
  const auto weight_of = [&](int64_t c, acc_t(&w)[VEC]) {
    if constexpr (kWeightRing) {
      if (weight_ringed) return weight_ring.next(w);
    }
    slice_weight(p, weight_slice, first, c, w);
  };
  const acc_t inv_cols = acc_t(1) / static_cast<acc_t>(p.cols);
  // A cluster's groups walk the same leads, group g row lead + g, each reducing its row sums within the group: a
  // group past the last row takes its reductions with nothing to add.
  const int64_t row_step = dev::grid_dim_x() / cluster;
  if (bulk)
    load_slice_chunks<VEC>(ring, p, shared, layout.dy, first, producer, dev::block_x() / cluster, 0, p.bulk_stages);
  unsigned parity = 0;  // of the ring's phases for this row
  for (int64_t lead = dev::block_x() / cluster - group; lead < p.rows; lead += row_step, parity ^= 1) {
    const int64_t row = lead + group;
    const bool active = row < p.rows;
    const int64_t row_count = active ? count : 0;  // vectors of the slice this row loads
    const acc_t mean = active && p.mean != nullptr ? dev::load_global(&p.mean[row]) : acc_t(0);
    const acc_t rstd = active ? dev::load_global(&p.rstd[row]) : acc_t(0);
    const int64_t row_start = dy_slice_start<VEC>(p, row, first), row_x_start = x_slice_start<VEC>(p, row, first);
    acc_t sum_g = acc_t(0), sum_g_xhat = acc_t(0);
    // Vector c of the slice (x and dy as acc_t): the row sums' terms and the gradient sums' dy * xhat and dy, added
    // to the sums by add_grads (add_gradient_terms).
    const auto add_terms = [&](int64_t c, acc_t(&xhat)[VEC], const acc_t(&dy)[VEC], const auto& add_grads) {
      acc_t w[VEC];
      weight_of(c, w);
      to_xhat_at(p, (first + c) * VEC, mean, rstd, xhat);
      add_row_terms<T>(p, xhat, dy, w, sum_g, sum_g_xhat);
      add_gradient_terms(p, dweight, dbias, xhat, dy, add_grads);
    };
    // Vector c's gradient terms added to the sums in shared memory.
    const auto to_shared_sums = [&](int64_t c) {
      return
          [&, c](int gradient, const acc_t(&v)[VEC]) { add_to_sums(gradient == 0 ? dweight_sums : dbias_sums, c, v); };
    };
    // The held-sums instance: round by round (chunks are whole rounds), each chunk waited for before its first
    // round.
    if constexpr (kHeld) {
      if (active) {
        int waited = 0;
#pragma unroll
        for (int round = 0; round < kHeldRounds; ++round) {
          ring.wait_through_round(waited, round, threads, parity);
          const int64_t c = dev::thread_x() + int64_t{round} * threads;
          if (c >= count) continue;
          acc_t xhat[VEC], dy[VEC];
          x_slice.load(c, xhat);
          dy_slice.load(c, dy);
          add_terms(c, xhat, dy,
                    [&](int gradient, const acc_t(&v)[VEC]) { held.add(gradient, round, c, v, dbias_sums); });
        }  // (every chunk with vectors begins at a round: the empty ones need no wait)
      }
    }
    for (int k = 0; !kHeld && bulk && active && k < p.bulk_stages; ++k) {
      ring.wait(k, parity);
      for (int64_t c = ring.begin(k) + dev::thread_x(); c < ring.end(k); c += threads) {
        acc_t xhat[VEC], dy[VEC];
        x_slice.load(c, xhat);
        dy_slice.load(c, dy);
        add_terms(c, xhat, dy, to_shared_sums(c));
      }
    }
    for (int64_t base = dev::thread_x(); !kHeld && !bulk && base < row_count;
         base += int64_t{kBackwardSharedUnroll} * threads) {
      Vec<R, VEC> x_raw[kBackwardSharedUnroll];
      Vec<T, VEC> dy_raw[kBackwardSharedUnroll];
      load_slice_round(p, row_x_start, row_start, row_count, base, x_raw, dy_raw);
#pragma unroll
      for (int k = 0; k < kBackwardSharedUnroll; ++k) {
        const int64_t c = base + int64_t{k} * threads;
        if (c >= row_count) break;
        if (p.row_on_chip) {
          x_slice.store(c, x_raw[k]);
          dy_slice.store(c, dy_raw[k]);
        }
        acc_t xhat[VEC], dy[VEC];
        row_vector(x_raw[k], dy_raw[k], xhat, dy);
        add_terms(c, xhat, dy, to_shared_sums(c));
      }
    }
    cluster_sum2(sum_g, sum_g_xhat, threads, scratch);
    if (!active) continue;
    if (p.dx == nullptr) {  // the row sums' block barrier followed the last read of the slices: refill them whole
      if (bulk) load_slice_chunks<VEC>(ring, p, shared, layout.dy, first, producer, row + row_step, 0, p.bulk_stages);
      continue;
    }
    // A row too long for the cluster's shared memory is read again (mostly from L2), kReread vectors of x and of dy
    // a thread, all in flight before the first is used (one at a time, a thread had two loads in flight: float32
    // D=262144 ran at 48% of copy).
    // With bulk loads by chunks of the ring, each refilled with the next row's once read by the block.
    constexpr int kReread = kHeld ? 1 : backward_reread_unroll(VEC, sizeof(acc_t));
    const int chunks = bulk ? p.bulk_stages : 1;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const int64_t end = bulk ? ring.end(chunk) : count;
      for (int64_t base = (bulk ? ring.begin(chunk) : 0) + dev::thread_x(); base < end;
           base += int64_t{kReread} * threads) {
        Vec<R, VEC> x_raw[kReread];
        Vec<T, VEC> dy_raw[kReread];
        if (kReread > 1 && !p.row_on_chip) load_slice_round(p, row_x_start, row_start, end, base, x_raw, dy_raw);
#pragma unroll
        for (int k = 0; k < kReread; ++k) {
          const int64_t c = base + int64_t{k} * threads;
          if (c >= end) break;
          acc_t xhat[VEC], dy[VEC], w[VEC];
          if (kHeld || p.row_on_chip) {  // (the held-sums instance's slices are always on chip)
            x_slice.load(c, xhat);
            dy_slice.load(c, dy);
          } else if constexpr (kReread == 1) {  // plain loads, as used
            row_vector(dev::load_global(reinterpret_cast<const Vec<R, VEC>*>(p.x + row_x_start) + c),
                       dev::load_global(reinterpret_cast<const Vec<T, VEC>*>(p.dy + row_start) + c), xhat, dy);
          } else {
            row_vector(x_raw[k], dy_raw[k], xhat, dy);
          }
          to_xhat_at(p, (first + c) * VEC, mean, rstd, xhat);  // as the first pass computed it
          weight_of(c, w);
          store_dx<KIND>(p, row, (first + c) * VEC, xhat, dy, w, rstd, sum_g * inv_cols, sum_g_xhat * inv_cols);
        }
      }
      if (!bulk) continue;
      ring.release(chunk, parity, producer);  // chunk read by every thread (thread 0 waits for that)
      load_slice_chunks<VEC>(ring, p, shared, layout.dy, first, producer, row + row_step, chunk, chunk + 1);
    }
  }
  // (Over the row, no barrier first: a thread's sums of vector c take the 16-byte pieces of its own vector c of x and
  // of dy, SharedVectors' piece h at h * count + c, which only it reads.)
  if constexpr (kHeld) held.store({dweight_sums, dbias_sums}, {dweight, dbias}, count);
  if constexpr (kWeightRing) {
    if (weight_ringed) dev::copy_async_wait<0>();  // the ring's copies ahead, not to be used
  }
  dev::allow_dependent_launch();  // the reduce's launch overlaps the partial rows' stores
  // The groups' gradient sums added in group order into the cluster's one partial row (slot: the cluster's index),
  // each block of a group its share of its slice of it.
  if constexpr (partial_clusters_for(sizeof(acc_t))) {
    if (groups > 1) {
      const int64_t slot = dev::block_x() / (cluster * groups);
      const unsigned slice_rank = dev::cluster_rank() % cluster;
      const int64_t offset = slot * p.cols + first * VEC;
      using Sums = GroupSliceSums<acc_t, VEC>;
      if (dweight)
        store_cluster_partial<VEC>(p.partial_dweight + offset, count, group, groups,
                                   Sums{dweight_sums, cluster, slice_rank});
      if (dbias)
        store_cluster_partial<VEC>(p.partial_dbias + offset, count, group, groups,
                                   Sums{dbias_sums, cluster, slice_rank});
      return;
    }
  }
  // The cluster's partial row (slot: the cluster's index), this block's slice of it.
  const int64_t slot = dev::block_x() / cluster;
  for (int64_t c = dev::thread_x(); c < count; c += threads) {
    acc_t sum[VEC];
    if (dweight) {
      dweight_sums.load(c, sum);
      store_vec<VEC>(p.partial_dweight + slot * p.cols, (first + c) * VEC, sum);
    }
    if (dbias) {
      dbias_sums.load(c, sum);
      store_vec<VEC>(p.partial_dbias + slot * p.cols, (first + c) * VEC, sum);
    }
  }
  // No barrier before exiting: as the forward's shared-memory kernel.
}

// The backward's kernels by register tier, for launch_rows; GATED: the gated RMSNorm's instances (no LayerNorm form,
// no shared-memory path: null kernels there, as ForwardKernels').
template <typename T, typename W, typename acc_t, typename R, bool GATED = false>
struct BackwardKernels {
  static constexpr RegisterBudget budget = for_accumulator(gated_budget(kBackwardBudget, GATED), sizeof(acc_t));
  using Kernel = void (*)(BackwardParams<T, W, acc_t, R>);
  template <NormKind K, int VEC, int ITEMS>
  static constexpr Kernel get() {
    if constexpr (GATED && K == NormKind::LayerNorm) {
      return nullptr;
    } else if constexpr (ITEMS == 0) {
      return &norm_backward_multipass_kernel<T, W, acc_t, R, K, VEC, GATED>;
    } else {
      return &norm_backward_kernel<T, W, acc_t, R, K, VEC, ITEMS, GATED>;
    }
  }
  // The shared-memory kernel; its held-sums instances where the plan says (RowPlan::held: only for rows they have).
  template <NormKind K, int VEC>
  static constexpr Kernel shared_row(const RowPlan& plan) {
    if constexpr (GATED) {
      return nullptr;
    } else {
      constexpr bool kHeldable = holds_sums_for(VEC, sizeof(R), sizeof(T), sizeof(acc_t));
      if constexpr (kHeldable && held_gradients(1, K == NormKind::LayerNorm, sizeof(T)) == 2) {
        if (plan.held == 2) return &norm_backward_shared_kernel<T, W, acc_t, R, K, VEC, 2>;
      }
      if constexpr (kHeldable && held_gradients(kHeldSumVectors, K == NormKind::LayerNorm, sizeof(T)) == 1) {
        if (plan.held == 1) return &norm_backward_shared_kernel<T, W, acc_t, R, K, VEC, 1>;
      }
      return &norm_backward_shared_kernel<T, W, acc_t, R, K, VEC>;
    }
  }
};

}  // namespace torch_ln
