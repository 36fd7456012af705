// Backward kernels: dx for each row, and the weight/bias gradients as float32
// (float64) partial sums, one partial row per block, later reduced in a fixed
// order by grad_reduce.cuh. No atomics: results are bitwise reproducible.
//
// With xhat = (x - mean) * rstd and g = dy * weight:
//   LayerNorm: dx = rstd * (g - sum(g) / D - xhat * sum(g * xhat) / D)
//   RMSNorm:   dx = rstd * (g - xhat * sum(g * xhat) / D)          (mean = 0)
//   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy.
#pragma once

#include "../norm_kind.h"
#include "launch_plan.h"
#include "reduce.cuh"
#include "rounding.cuh"

namespace torch_ln {

// R: the element type of x and dx, T's or, after a residual add, residual_out's.
template <typename T, typename W, typename acc_t, typename R = T>
struct BackwardParams {
  const T* dy;
  const R* x;
  const acc_t* mean;  // nullptr for RMSNorm
  const acc_t* rstd;
  const W* weight;         // nullptr: no weight
  R* dx;                   // nullptr: dx not requested
  acc_t* partial_dweight;  // [blocks, cols], or nullptr when not requested
  acc_t* partial_dbias;    // [blocks, cols], or nullptr when not requested
  int64_t rows, cols;
  int threads_per_row;
  const R* grad_residual_out;  // added to dx; nullptr when there is none
  DeviceRounding<acc_t> rounding;
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

// Turns one vector of x into xhat and adds its terms to the row sums of g and g * xhat.
template <typename T, int VEC, typename Params, typename acc_t>
TLN_DEVICE void add_row_terms(const Params& p, acc_t mean, acc_t rstd, acc_t (&x)[VEC], const acc_t (&dy)[VEC],
                              const acc_t (&w)[VEC], acc_t& sum_g, acc_t& sum_g_xhat) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    x[j] = (x[j] - mean) * rstd;
    const acc_t g = weighted_grad<T>(p, dy[j], w[j]);
    sum_g += g;
    sum_g_xhat += g * x[j];
  }
}

// dx for one vector, from the row's reduced sums (already divided by D). g is
// rounded exactly as in add_row_terms (mul_rn), so with D = 1 dx is exactly 0.
// With a residual add, grad_residual_out is added to dx.
template <NormKind KIND, int VEC, typename T, typename W, typename acc_t, typename R>
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
  store_vec<VEC>(p.dx + row * p.cols, i, dx);
}

// The block's partial row of one gradient: its row-slots' sums added on chip in
// slot order, so the block writes one partial row, whatever its rows per block.
// Shared memory holds the slots' vectors plane by plane (element j of every
// vector together), so a warp's accesses fall in distinct banks.
template <int VEC, int ITEMS, typename acc_t>
TLN_DEVICE void store_block_partial(acc_t* partial, const acc_t (&sums)[ITEMS][VEC], const RowLayout& layout,
                                    int64_t nvec, acc_t* smem) {
  if (layout.rows_per_block == 1) {
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
    store_vec<VEC>(partial, c * VEC, total);
  }
  dev::sync_threads();  // smem is reused by the next gradient
}

// Rows held in registers, laid out as in the forward. A block walks the tiles
// block, block + blocks, ...; each thread keeps its columns' weight and its
// share of the weight/bias gradient sums in registers, and the block writes one
// partial row per gradient at the end.
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC, int ITEMS>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(kBackwardBudget.max_threads) norm_backward_kernel(BackwardParams<T, W, acc_t, R> p) {
  acc_t* smem = dev::dynamic_shared<acc_t>();
  const RowLayout layout(p.threads_per_row);
  const int64_t nvec = p.cols / VEC;
  acc_t w[ITEMS][VEC] = {};  // the same columns in every row: read once
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    if (layout.vector(k) < nvec) load_weight(p, layout.vector(k) * VEC, w[k]);
  }
  acc_t dweight[ITEMS][VEC] = {};
  acc_t dbias[ITEMS][VEC] = {};
  for (int64_t tile = layout.first_tile(); tile < p.rows; tile += layout.tile_stride()) {
    const int64_t row = tile + layout.row_in_block;
    const bool active = row < p.rows;
    const acc_t mean = active && p.mean != nullptr ? dev::load_global(&p.mean[row]) : acc_t(0);
    const acc_t rstd = active ? dev::load_global(&p.rstd[row]) : acc_t(0);
    acc_t xhat[ITEMS][VEC], dy[ITEMS][VEC];
    // Every load of the row is issued before the first use: predicated loads in straight-line code (no branch
    // per vector), so the loads are in flight together.
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const bool in_row = active && layout.vector(k) < nvec;
      // float64 rows are bound by their arithmetic, and all their loads at once would spill: one branch each.
      if (sizeof(acc_t) == 8 && !in_row) continue;
      to_acc(load_vec_if<VEC>(in_row, p.x, row * p.cols + layout.vector(k) * VEC), xhat[k]);
      to_acc(load_vec_if<VEC>(in_row, p.dy, row * p.cols + layout.vector(k) * VEC), dy[k]);
    }
    acc_t sum_g = acc_t(0), sum_g_xhat = acc_t(0);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (!active || layout.vector(k) >= nvec) continue;
      add_row_terms<T>(p, mean, rstd, xhat[k], dy[k], w[k], sum_g, sum_g_xhat);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        dweight[k][j] += p.rounding.template weight_term<T>(dy[k][j], xhat[k][j]);
        if constexpr (KIND == NormKind::LayerNorm) dbias[k][j] += dy[k][j];  // RMSNorm has no bias
      }
    }
    row_sum2(sum_g, sum_g_xhat, p.threads_per_row, smem);
    if (!active || p.dx == nullptr) continue;
    const acc_t inv_cols = acc_t(1) / static_cast<acc_t>(p.cols);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int64_t c = layout.vector(k);
      if (c < nvec)
        store_dx<KIND>(p, row, c * VEC, xhat[k], dy[k], w[k], rstd, sum_g * inv_cols, sum_g_xhat * inv_cols);
    }
  }
  // Every block writes its whole partial rows, zeros included, so the buffers need no clearing.
  const int64_t slot = dev::block_x();
  if (p.partial_dweight != nullptr) store_block_partial(p.partial_dweight + slot * p.cols, dweight, layout, nvec, smem);
  if (KIND == NormKind::LayerNorm && p.partial_dbias != nullptr) {
    store_block_partial(p.partial_dbias + slot * p.cols, dbias, layout, nvec, smem);
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
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(kBackwardBudget.max_threads)
    norm_backward_multipass_kernel(BackwardParams<T, W, acc_t, R> p) {
  acc_t* smem = dev::dynamic_shared<acc_t>();
  const int threads = dev::block_dim_x();
  const int64_t nvec = p.cols / VEC;
  const int64_t slot = dev::block_x();
  for (int64_t row = slot; row < p.rows; row += dev::grid_dim_x()) {
    const acc_t mean = p.mean != nullptr ? dev::load_global(&p.mean[row]) : acc_t(0);
    const acc_t rstd = dev::load_global(&p.rstd[row]);
    acc_t xhat[VEC], dy[VEC], w[VEC];
    // One pass of the row: xhat, dy and the weight at element offset i, with the row sums' terms.
    auto load_row = [&](int64_t i, acc_t& sum_g, acc_t& sum_g_xhat) {
      load_vec<VEC>(p.x + row * p.cols, i, xhat);
      load_vec<VEC>(p.dy + row * p.cols, i, dy);
      load_weight(p, i, w);
      add_row_terms<T>(p, mean, rstd, xhat, dy, w, sum_g, sum_g_xhat);
    };
    acc_t sum_g = acc_t(0), sum_g_xhat = acc_t(0);
    for (int64_t c = dev::thread_x(); c < nvec; c += threads) load_row(c * VEC, sum_g, sum_g_xhat);
    row_sum2(sum_g, sum_g_xhat, threads, smem);
    const acc_t inv_cols = acc_t(1) / static_cast<acc_t>(p.cols);
    for (int64_t c = dev::thread_x(); c < nvec; c += threads) {
      acc_t unused_g = acc_t(0), unused_g_xhat = acc_t(0);
      load_row(c * VEC, unused_g, unused_g_xhat);
      if (p.dx != nullptr) store_dx<KIND>(p, row, c * VEC, xhat, dy, w, rstd, sum_g * inv_cols, sum_g_xhat * inv_cols);
      acc_t dy_xhat[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) dy_xhat[j] = p.rounding.template weight_term<T>(dy[j], xhat[j]);
      if (p.partial_dweight != nullptr) accumulate_partial(p.partial_dweight + slot * p.cols, c * VEC, dy_xhat);
      if (p.partial_dbias != nullptr) accumulate_partial(p.partial_dbias + slot * p.cols, c * VEC, dy);
    }
  }
}

// The backward's kernels by register tier, for launch_rows.
template <typename T, typename W, typename acc_t, typename R>
struct BackwardKernels {
  static constexpr RegisterBudget budget = for_accumulator(kBackwardBudget, sizeof(acc_t));
  template <NormKind K, int VEC, int ITEMS>
  static constexpr auto get() {
    if constexpr (ITEMS == 0) {
      return &norm_backward_multipass_kernel<T, W, acc_t, R, K, VEC>;
    } else {
      return &norm_backward_kernel<T, W, acc_t, R, K, VEC, ITEMS>;
    }
  }
};

}  // namespace torch_ln
