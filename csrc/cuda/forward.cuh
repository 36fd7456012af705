// Forward kernels: y = (x - mean) * rstd * weight + bias, one template for
// LayerNorm and RMSNorm (RMSNorm is the same computation with mean = 0).
#pragma once

#include "../norm_kind.h"
#include "../row_strides.h"
#include "gate.cuh"
#include "launch_plan.h"
#include "quantize.cuh"
#include "reduce.cuh"
#include "rounding.cuh"
#include "shared_vectors.cuh"

namespace torch_ln {

// R: the element type of the normalized rows, T's or, after a residual add, residual_out's.
template <typename T, typename W, typename acc_t, typename R = T>
struct ForwardParams {
  const T* x;
  const W* weight;  // nullptr: no weight
  const W* bias;    // nullptr: no bias
  T* y;
  acc_t* mean;  // nullptr for RMSNorm
  acc_t* rstd;
  int64_t rows, cols;
  acc_t eps;
  int threads_per_row;
  const R* residual;  // nullptr: no residual add; otherwise the norm is of residual_out = x + residual
  R* residual_out;
  DeviceRounding<acc_t> rounding;
  bool staged_params;  // each block keeps the weight and bias (the shared-memory kernel: its slice) in shared memory
  int cluster_blocks;  // the shared-memory kernel: blocks a row is staged over (RowPlan::cluster_blocks)
  int64_t slice_vectors;
  RowStrides x_rows;  // where each row of x starts (cols apart, but for a strided view: ForwardArgs)
  // The *_quant operators (the kernels' QUANTIZED instances): y, as stored, quantized into quant.q in the kernel's
  // epilogue, y itself then stored only where y != nullptr. Dynamic scales come per row (quant_group_lanes == 0: the
  // row's threads reduce its amax) or per group of quant_group_lanes vectors (a power of two <= 32: consecutive lanes
  // of a warp hold a group, which reduce its amax by shuffles; quant_group_lanes in launch_forward_typed).
  QuantOutput quant = {};
  int quant_group_lanes = 0;
  // A gated RMSNorm (the kernels' GATED instances): the gate, and a grouped norm's groups as rows of their own.
  DeviceGate<T> gate = {};
  int bulk_stages = 0;  // the shared-memory kernel: its slice loaded by bulk copies in this many chunks (SliceRing)
  // The register kernel's prefetch of its next tiles (ThreadRing): its ring's stages (0: none; 2 or 3), and where in
  // the dynamic shared memory the ring starts (bytes, after the weight and bias copy and the row sums' room).
  int prefetch_stages = 0;
  size_t prefetch_offset = 0;
  bool prefetch_residual = false;  // the ring holds the residual's vectors too (else it is read as it is added)
};

// With a residual add, the row is x + residual rounded to R (as torch's add rounds): adds the residual's vector r to
// one vector of x, which keep_input then stores to residual_out.
template <typename R, int VEC, typename acc_t>
TLN_DEVICE void add_rounded(const acc_t (&r)[VEC], acc_t (&v)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] = static_cast<acc_t>(static_cast<R>(v[j] + r[j]));
}

// The residual's vector at element offset i added to one vector of x (add_rounded), read from global memory.
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void add_residual(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, acc_t (&v)[VEC]) {
  if (p.residual == nullptr) return;
  acc_t r[VEC];
  load_vec<VEC>(p.residual + row * p.cols, i, r);
  add_rounded<R>(r, v);
}

// A gate before the norm (GATED instances): one vector of the row as read (element offset i) times act(z).
template <bool GATED, int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void gate_input(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, acc_t (&v)[VEC]) {
  if constexpr (GATED) {
    if (p.gate.gates_input()) p.gate.multiply(row * p.cols + i, v);
  }
}

// The first read of one vector of a row (element offset i).
template <bool GATED = false, int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_input(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, acc_t (&v)[VEC]) {
  load_vec<VEC>(p.x + p.x_rows.offset(row), i, v);
  add_residual(p, row, i, v);
  gate_input<GATED>(p, row, i, v);
}

// Stores x + residual to residual_out (for the caller, and for the later passes); nothing without a residual.
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void keep_input(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, const acc_t (&v)[VEC]) {
  if (p.residual != nullptr) store_vec<VEC>(p.residual_out + row * p.cols, i, v);
}

// A later read of one vector of the row load_input read: x, or residual_out (the same thread wrote it, before
// the barrier of the row reduction in between).
template <bool GATED = false, int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_stored(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, acc_t (&v)[VEC]) {
  if (p.residual == nullptr) {
    load_vec<VEC>(p.x + p.x_rows.offset(row), i, v);
  } else {
    load_vec<VEC>(p.residual_out + row * p.cols, i, v);
  }
  gate_input<GATED>(p, row, i, v);
}

// rstd from a row's sum of squared deviations.
template <typename acc_t>
TLN_DEVICE acc_t rstd_from(acc_t squares, int64_t cols, acc_t eps) {
  return dev::rsqrt(squares / static_cast<acc_t>(cols) + eps);
}

// Sum of (x - mean)^2 over one vector (mean is 0 for RMSNorm).
template <int VEC, typename acc_t>
TLN_DEVICE acc_t squared_deviations(const acc_t (&v)[VEC], acc_t mean) {
  acc_t s = acc_t(0);
#pragma unroll
  for (int j = 0; j < VEC; ++j) s += (v[j] - mean) * (v[j] - mean);
  return s;
}

template <int VEC, typename acc_t>
TLN_DEVICE acc_t vector_sum(const acc_t (&v)[VEC]) {
  acc_t s = acc_t(0);
#pragma unroll
  for (int j = 0; j < VEC; ++j) s += v[j];
  return s;
}

// Normalizes vector c of a row into out, reading the weight and bias (where the row has them) from `params`:
// GlobalParams or the block's StagedParams or SlicedParams.
template <int VEC, typename T, typename W, typename acc_t, typename R, typename Params>
TLN_DEVICE void normalize(const ForwardParams<T, W, acc_t, R>& p, int64_t c, const acc_t (&v)[VEC], acc_t mean,
                          acc_t rstd, const Params& params, acc_t (&out)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = (v[j] - mean) * rstd;
  if (p.weight != nullptr) {
    acc_t w[VEC];
    params.load_weight(c, w);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = p.rounding.template to_input<T>(out[j]) * p.rounding.weight(w[j]);
  }
  if (p.bias != nullptr) {
    acc_t b[VEC];
    params.load_bias(c, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] += b[j];
  }
}

// A gate after the norm (GATED instances): one normalized vector (element offset i) times act(z).
template <bool GATED, int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void gate_output(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t i, acc_t (&out)[VEC]) {
  if constexpr (GATED) {
    if (!p.gate.gates_output()) return;
    if (rounds_weighted<T, W>(p)) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[j] = static_cast<acc_t>(static_cast<T>(out[j]));
    }
    p.gate.multiply(row * p.cols + i, out);
  }
}

// Normalizes vector c of a row (gated after the norm where GATED says) and stores it to y.
template <bool GATED = false, int VEC, typename T, typename W, typename acc_t, typename R, typename Params>
TLN_DEVICE void normalize_and_store(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t c,
                                    const acc_t (&v)[VEC], acc_t mean, acc_t rstd, const Params& params) {
  acc_t out[VEC];
  normalize(p, c, v, mean, rstd, params, out);
  gate_output<GATED>(p, row, c * VEC, out);
  store_vec<VEC>(p.y + row * p.cols, c * VEC, out);
}

// max |y| over vector c of a row, y as stored (rounded to T): the values that are quantized.
template <int VEC, typename T, typename W, typename acc_t, typename R, typename Params>
TLN_DEVICE acc_t stored_abs_max(const ForwardParams<T, W, acc_t, R>& p, int64_t c, const acc_t (&v)[VEC], acc_t mean,
                                acc_t rstd, const Params& params) {
  acc_t out[VEC];
  normalize(p, c, v, mean, rstd, params, out);
  float stored[VEC];
  return stored_floats<T>(out, stored);
}

// Whether the row's scale is dynamic per row (per token): its amax is reduced over the row before any vector is
// quantized.
template <typename T, typename W, typename acc_t, typename R>
TLN_DEVICE bool per_row_scale(const ForwardParams<T, W, acc_t, R>& p) {
  return p.quant.spec.dynamic && p.quant_group_lanes == 0;
}

// The inverse of the scale that a row's vectors are quantized with: the static scale's, or (per_row_scale) that of
// the scale from the row's amax `row_abs_max` (reduced over the row), which the thread where `writes` stores; 0 for
// per-group scales (store_quantized finds each group's).
template <typename T, typename W, typename acc_t, typename R>
TLN_DEVICE float row_inverse_scale(const ForwardParams<T, W, acc_t, R>& p, int64_t row, bool writes,
                                   acc_t row_abs_max) {
  if (!p.quant.spec.dynamic) return 1.0f / dev::load_global(p.quant.static_scale);
  if (p.quant_group_lanes > 0) return 0.0f;
  const float scale = dynamic_scale(static_cast<float>(row_abs_max), p.quant.spec);
  if (writes) dev::store_global(p.quant.scales + row * p.quant.spec.scale_row_stride, scale);
  return 1.0f / scale;
}

// Normalizes vector c of a row (where `in`: the thread holds one), stores it to y where y is asked for, and its
// quantized codes to q, with `row_inverse` or, for per-group scales, the scale of its group, whose amax the group's
// lanes reduce together: every lane of the warp calls this (with in false where it holds no vector).
template <int VEC, typename T, typename W, typename acc_t, typename R, typename Params>
TLN_DEVICE void store_quantized(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t c, bool in,
                                const acc_t (&v)[VEC], acc_t mean, acc_t rstd, const Params& params,
                                float row_inverse) {
  acc_t out[VEC] = {};
  if (in) {
    normalize(p, c, v, mean, rstd, params, out);
    if (p.y != nullptr) store_vec<VEC>(p.y + row * p.cols, c * VEC, out);
  }
  float stored[VEC];
  const acc_t amax = stored_floats<T>(out, stored);
  float inverse = row_inverse;
  if (p.quant_group_lanes > 0) {
    const float scale =
        dynamic_scale(static_cast<float>(warp_reduce(amax, p.quant_group_lanes, AbsMax{})), p.quant.spec);
    const int64_t group = c / p.quant_group_lanes;
    if (in && c % p.quant_group_lanes == 0) {
      dev::store_global(p.quant.scales + row * p.quant.spec.scale_row_stride + group * p.quant.spec.scale_group_stride,
                        scale);
    }
    inverse = 1.0f / scale;
  }
  if (in) store_codes<VEC>(p.quant, row * p.cols + c * VEC, stored, inverse);
}

// The quantized epilogue of the kernels that walk a row (or a block's slice of it) in strides of the block's
// threads: vectors [first, first + count) of the row, vector c read by load(c, v). Dynamic per-row scales from the
// threads' amax combined over the row by `reduce`, stored where `writes` (row_inverse_scale). The vectors go in
// rounds of the block's threads, so that every lane of a warp reaches the group reductions. (Named functions, not
// lambdas, hold the branches here and below: gcov merges a lambda's instances into one line, which the branch gate
// would then need every instance to cover.)
template <int VEC, typename T, typename W, typename acc_t, typename R, typename Params, typename Load, typename Reduce>
TLN_DEVICE void store_quantized_strided(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t first,
                                        int64_t count, acc_t mean, acc_t rstd, const Params& params, Load load,
                                        bool writes, Reduce reduce) {
  acc_t v[VEC] = {};
  acc_t amax = acc_t(0);
  if (per_row_scale(p)) {
    for (int64_t c = dev::thread_x(); c < count; c += dev::block_dim_x()) {
      load(c, v);
      amax = fold_abs_max(amax, stored_abs_max(p, first + c, v, mean, rstd, params));
    }
    amax = reduce(amax);
  }
  const float row_inverse = row_inverse_scale(p, row, writes, amax);
  for (int64_t base = 0; base < count; base += dev::block_dim_x()) {
    const int64_t c = base + dev::thread_x();
    const bool in = c < count;
    if (in) load(c, v);
    store_quantized(p, row, first + c, in, v, mean, rstd, params, row_inverse);
  }
}

// The register kernel's quantized epilogue for one row (row_in_block's row of the tile; every thread of the block:
// the row and group reductions).
template <int VEC, int ITEMS, typename T, typename W, typename acc_t, typename R, typename Params>
TLN_DEVICE void store_quantized_row(const ForwardParams<T, W, acc_t, R>& p, const RowLayout& layout, int64_t row,
                                    bool active, int64_t nvec, const acc_t (&v)[ITEMS][VEC], acc_t mean, acc_t rstd,
                                    const Params& params, acc_t* smem) {
  acc_t amax = acc_t(0);
  if (per_row_scale(p)) {
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (active && layout.vector(k) < nvec) {
        amax = fold_abs_max(amax, stored_abs_max(p, layout.vector(k), v[k], mean, rstd, params));
      }
    }
    amax = row_reduce(amax, p.threads_per_row, smem, AbsMax{});
  }
  const float row_inverse = row_inverse_scale(p, row, active && layout.lane == 0, amax);
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int64_t c = layout.vector(k);
    store_quantized(p, row, c, active && c < nvec, v[k], mean, rstd, params, row_inverse);
  }
}

// The weight and bias read from global memory, vector c at a time.
template <typename W, int VEC>
struct GlobalParams {
  const W* weight;
  const W* bias;

  template <typename acc_t>
  TLN_DEVICE void load_weight(int64_t c, acc_t (&w)[VEC]) const {
    load_vec<VEC>(weight, c * VEC, w);
  }
  template <typename acc_t>
  TLN_DEVICE void load_bias(int64_t c, acc_t (&b)[VEC]) const {
    load_vec<VEC>(bias, c * VEC, b);
  }
};

// The register kernel's copy of the weight and bias rows in shared memory: the same columns serve every row of
// the block, so they are read from global memory once per block instead of once per row. Shared memory holds the
// weight row, then the bias row (each only where the row has it), then the row-sum scratch.
template <typename W, int VEC>
struct StagedParams {
  SharedVectors<W, VEC> weight, bias;

  // Unused, and smem may be null, where !p.staged_params.
  template <typename T, typename acc_t, typename R>
  TLN_DEVICE StagedParams(const ForwardParams<T, W, acc_t, R>& p, unsigned char* smem)
      : weight{reinterpret_cast<typename SharedVectors<W, VEC>::Piece*>(smem), p.cols / VEC},
        bias{reinterpret_cast<typename SharedVectors<W, VEC>::Piece*>(
                 smem + (p.staged_params && p.weight != nullptr ? SharedVectors<W, VEC>::bytes(p.cols / VEC) : 0)),
             p.cols / VEC} {}

  // Fills the copy from global memory (every thread of the block; a barrier follows before any row reads it).
  template <typename T, typename acc_t, typename R>
  TLN_DEVICE void fill(const ForwardParams<T, W, acc_t, R>& p) const {
    for (int64_t c = dev::thread_x(); c < weight.count; c += dev::block_dim_x()) {
      if (p.weight != nullptr) weight.store(c, dev::load_global(reinterpret_cast<const Vec<W, VEC>*>(p.weight) + c));
      if (p.bias != nullptr) bias.store(c, dev::load_global(reinterpret_cast<const Vec<W, VEC>*>(p.bias) + c));
    }
  }

  template <typename acc_t>
  TLN_DEVICE void load_weight(int64_t c, acc_t (&w)[VEC]) const {
    weight.load(c, w);
  }
  template <typename acc_t>
  TLN_DEVICE void load_bias(int64_t c, acc_t (&b)[VEC]) const {
    bias.load(c, b);
  }
};

// The shared-memory kernel's slice of the weight and bias in shared memory: vectors [first, first + count) of
// each row, filled once per block (each thread fills the vectors it later reads: no barrier).
template <typename W, int VEC>
struct SlicedParams {
  SharedVectors<W, VEC> weight, bias;
  int64_t first;

  template <typename T, typename acc_t, typename R>
  TLN_DEVICE void fill(const ForwardParams<T, W, acc_t, R>& p, int64_t count) const {
    for (int64_t c = dev::thread_x(); c < count; c += dev::block_dim_x()) {
      if (p.weight != nullptr)
        weight.store(c, dev::load_global(reinterpret_cast<const Vec<W, VEC>*>(p.weight) + first + c));
      if (p.bias != nullptr) bias.store(c, dev::load_global(reinterpret_cast<const Vec<W, VEC>*>(p.bias) + first + c));
    }
  }

  template <typename acc_t>
  TLN_DEVICE void load_weight(int64_t c, acc_t (&w)[VEC]) const {
    weight.load(c - first, w);
  }
  template <typename acc_t>
  TLN_DEVICE void load_bias(int64_t c, acc_t (&b)[VEC]) const {
    bias.load(c - first, b);
  }
};

// A thread's loads of x for one row of a register kernel's tile (tile + layout.row_in_block of the batch's rows):
// its vectors as stored, predicated (none beyond the rows or the row), all issued before the first use.
template <int VEC, int ITEMS, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_tile_row(const ForwardParams<T, W, acc_t, R>& p, const RowLayout& layout, const GroupWalk& walk,
                              int64_t tile, int64_t batch_rows, Vec<T, VEC> (&raw)[ITEMS]) {
  const bool active = tile + layout.row_in_block < batch_rows;
  const T* x_row = p.x + p.x_rows.offset(walk.row(tile + layout.row_in_block));
  const int64_t nvec = p.cols / VEC;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    raw[k] = load_vec_if<VEC>(active && layout.vector(k) < nvec, x_row, layout.vector(k) * VEC);
  }
}

// The register forward's prefetch ring (ThreadRing): each thread's vectors of x and, with a residual add where the
// launcher has room for them (p.prefetch_residual), of the residual (its stages after x's), for the tiles ahead.
template <typename T, typename R, int VEC, int ITEMS>
struct RowPrefetch {
  ThreadRing<T, VEC, ITEMS> x;
  ThreadRing<R, VEC, ITEMS> residual;

  TLN_DEVICE RowPrefetch(unsigned char* base, int stages, int64_t block_threads)
      : x(base, stages, block_threads),
        residual(base + ThreadRing<T, VEC, ITEMS>::bytes(stages, block_threads), stages, block_threads) {}
};

// Copies a thread's vectors of x (and of the residual) for its row of a register kernel's tile into `stage` of its
// prefetch ring (none beyond the rows: the group stays empty).
template <int VEC, int ITEMS, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void copy_tile(const RowPrefetch<T, R, VEC, ITEMS>& ring, const ForwardParams<T, W, acc_t, R>& p,
                          const GroupWalk& walk, const RowLayout& layout, int64_t tile, int64_t batch_rows, int stage) {
  if (tile + layout.row_in_block >= batch_rows) return;
  const int64_t row = walk.row(tile + layout.row_in_block);
  ring.x.copy(p.x + p.x_rows.offset(row), layout, p.cols / VEC, stage);
  if (p.prefetch_residual) ring.residual.copy(p.residual + row * p.cols, layout, p.cols / VEC, stage);
}

// Rows held in registers: ITEMS vectors of VEC elements per thread (laid out by
// RowLayout), read from global memory once. A block walks many rows (its grid is
// one wave, launch_forward_typed), reading the weight and bias from its shared
// copy when p.staged_params (the launcher's choice: the copy fits the device's
// shared memory without lowering the occupancy), from global memory otherwise.
// With p.prefetch_stages (the launcher's choice: forward_ring_wanted, and room without fewer blocks resident), each
// thread copies its vectors of x (and of a residual) for the tiles ahead into its own slots of a ring in shared
// memory by cp.async (RowPrefetch) and reads this tile's back from there: 2 tiles in flight with 3 stages, during
// this row's reductions and stores. Without a ring, where the next row as stored fits beside this one
// (prefetches_next_row), its loads are issued as soon as this row's are converted. Otherwise the unit's loads are
// idle for each row's reduce-and-store time.
// QUANTIZED (here and in the long-row kernels): the *_quant operators' instance (p.quant), a template argument so
// that the plain kernels keep their registers (a runtime branch raised them by up to 24). GATED (here and in the
// multi-pass kernel): the gated RMSNorm's instance (p.gate), whose blocks walk the rows of one group (GroupWalk).
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC, int ITEMS, bool QUANTIZED,
          bool GATED>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(gated_budget(kForwardBudget, GATED).max_threads)
    norm_forward_kernel(ForwardParams<T, W, acc_t, R> p) {
  constexpr bool kPrefetch = prefetches_next_row(ITEMS * VEC * sizeof(T));
  const GroupWalk walk = group_walk<GATED>(p);
  unsigned char* shared = dev::dynamic_shared<unsigned char>();
  const StagedParams<W, VEC> staged(p, shared);
  acc_t* smem = reinterpret_cast<acc_t*>(
      shared + (p.staged_params ? staged_params_bytes(p.cols, p.weight != nullptr, p.bias != nullptr, sizeof(W)) : 0));
  const RowLayout layout(p.threads_per_row);
  const int64_t nvec = p.cols / VEC;  // VEC > 1 only when it divides cols
  const int64_t batch_rows = p.rows / walk.groups;
  const int64_t tile_step = walk.units * layout.rows_per_block;
  const int64_t first_tile = walk.unit * layout.rows_per_block;
  constexpr bool kRing = ring_prefetches(VEC, sizeof(acc_t), GATED);
  const int stages = kRing ? p.prefetch_stages : 0;
  const RowPrefetch<T, R, VEC, ITEMS> ring(shared + p.prefetch_offset, stages, dev::block_dim_x());
  const RingWalk ring_walk(ring, p, walk, layout, tile_step, batch_rows, stages);
  if constexpr (kRing) ring_walk.fill(first_tile);
  // x as stored, converted after. (Without a ring a residual is read vector by vector as it is added: float32 rows
  // would spill holding both x and the residual as stored.)
  Vec<T, VEC> raw[ITEMS];
  const bool register_prefetch = kPrefetch && stages == 0;
  if (register_prefetch) load_tile_row(p, layout, walk, first_tile, batch_rows, raw);
  if (p.staged_params) {
    staged.fill(p);
    dev::sync_threads();
  }
  int stage = 0;
  for (int64_t tile = first_tile; tile < batch_rows; tile += tile_step, stage = next_stage(stage, stages)) {
    const bool active = tile + layout.row_in_block < batch_rows;
    const int64_t row = walk.row(tile + layout.row_in_block);
    if constexpr (kRing) {
      if (stages > 0) ring_walk.turn(tile, stage);
    }
    if (!kPrefetch && stages == 0) load_tile_row(p, layout, walk, tile, batch_rows, raw);
    acc_t v[ITEMS][VEC];
    acc_t sum = acc_t(0);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (active && layout.vector(k) < nvec) {
        if (stages > 0) {
          ring.x.load(stage, k, v[k]);
        } else {
          to_acc(raw[k], v[k]);
        }
        if (kRing && p.prefetch_residual) {
          acc_t r[VEC];
          ring.residual.load(stage, k, r);
          add_rounded<R>(r, v[k]);
        } else {
          add_residual(p, row, layout.vector(k) * VEC, v[k]);
        }
        gate_input<GATED>(p, row, layout.vector(k) * VEC, v[k]);
        keep_input(p, row, layout.vector(k) * VEC, v[k]);
        sum += vector_sum(v[k]);
      }
    }
    if (register_prefetch) load_tile_row(p, layout, walk, tile + tile_step, batch_rows, raw);
    const acc_t mean =
        KIND == NormKind::LayerNorm ? row_reduce(sum, p.threads_per_row, smem) / static_cast<acc_t>(p.cols) : acc_t(0);
    // Two-pass variance over the registers: no E[x^2] - E[x]^2 cancellation.
    acc_t squares = acc_t(0);
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      if (active && layout.vector(k) < nvec) squares += squared_deviations(v[k], mean);
    }
    const acc_t rstd = rstd_from(row_reduce(squares, p.threads_per_row, smem), p.cols, p.eps);
    if (active && layout.lane == 0) {
      if (p.mean != nullptr) dev::store_global(&p.mean[row], mean);
      dev::store_global(&p.rstd[row], rstd);
    }
    if constexpr (QUANTIZED) {  // every thread: the row and group reductions
      if (p.staged_params) {
        store_quantized_row<VEC, ITEMS>(p, layout, row, active, nvec, v, mean, rstd, staged, smem);
      } else {
        store_quantized_row<VEC, ITEMS>(p, layout, row, active, nvec, v, mean, rstd,
                                        GlobalParams<W, VEC>{p.weight, p.bias}, smem);
      }
      continue;
    }
    if (!active) continue;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
      const int64_t c = layout.vector(k);
      if (c >= nvec) continue;
      if (p.staged_params) {
        normalize_and_store<GATED>(p, row, c, v[k], mean, rstd, staged);
      } else {
        normalize_and_store<GATED>(p, row, c, v[k], mean, rstd, GlobalParams<W, VEC>{p.weight, p.bias});
      }
    }
  }
}

// Rows too long for registers: a block per row, three passes over the row
// (sum, squared deviations, normalize); the later passes mostly hit L2.
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC, bool QUANTIZED, bool GATED>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(gated_budget(kForwardBudget, GATED).max_threads)
    norm_forward_multipass_kernel(ForwardParams<T, W, acc_t, R> p) {
  const GroupWalk walk = group_walk<GATED>(p);
  acc_t* smem = dev::dynamic_shared<acc_t>();
  const int threads = dev::block_dim_x();
  const int64_t nvec = p.cols / VEC;
  for (int64_t batch_row = walk.unit; batch_row < p.rows / walk.groups; batch_row += walk.units) {
    const int64_t row = walk.row(batch_row);
    acc_t v[VEC];
    acc_t mean = acc_t(0);
    if (KIND == NormKind::LayerNorm) {
      acc_t sum = acc_t(0);
      for (int64_t c = dev::thread_x(); c < nvec; c += threads) {
        load_input(p, row, c * VEC, v);
        keep_input(p, row, c * VEC, v);
        sum += vector_sum(v);
      }
      mean = row_reduce(sum, threads, smem) / static_cast<acc_t>(p.cols);
    }
    acc_t squares = acc_t(0);
    for (int64_t c = dev::thread_x(); c < nvec; c += threads) {
      if (KIND == NormKind::LayerNorm) {
        load_stored(p, row, c * VEC, v);
      } else {  // RMSNorm's first pass
        load_input<GATED>(p, row, c * VEC, v);
        keep_input(p, row, c * VEC, v);
      }
      squares += squared_deviations(v, mean);
    }
    const acc_t rstd = rstd_from(row_reduce(squares, threads, smem), p.cols, p.eps);
    if (dev::thread_x() == 0) {
      if (p.mean != nullptr) dev::store_global(&p.mean[row], mean);
      dev::store_global(&p.rstd[row], rstd);
    }
    const GlobalParams<W, VEC> params{p.weight, p.bias};
    if constexpr (QUANTIZED) {
      store_quantized_strided<VEC>(
          p, row, 0, nvec, mean, rstd, params, [&](int64_t c, acc_t(&w)[VEC]) { load_stored(p, row, c * VEC, w); },
          dev::thread_x() == 0, [&](acc_t amax) { return row_reduce(amax, threads, smem, AbsMax{}); });
    } else {  // (not a `continue` above: nvcc found the loop below unreachable in the QUANTIZED instances, #128-D)
      for (int64_t c = dev::thread_x(); c < nvec; c += threads) {
        load_stored<GATED>(p, row, c * VEC, v);
        normalize_and_store<GATED>(p, row, c, v, mean, rstd, params);
      }
    }
  }
}

// One round of the shared-memory kernel's loads of its slice of a row (vectors [first, first + count) of the row):
// vectors base, base + threads, ... (kSharedRowUnroll of them) as stored, none past the slice or the rows.
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_slice_round(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t first, int64_t count,
                                 int64_t base, Vec<T, VEC> (&raw)[kSharedRowUnroll]) {
  const bool active = row < p.rows;
  const int64_t x_start = p.x_rows.offset(row) + first * VEC;
#pragma unroll
  for (int k = 0; k < kSharedRowUnroll; ++k) {
    const int64_t c = base + int64_t{k} * dev::block_dim_x();
    raw[k] = load_vec_if<VEC>(active && c < count, p.x, x_start + c * VEC);
  }
}

// The bulk copies of chunks [from, to) of `row`'s slice (its first vector `first`) into the start of the block's
// shared memory, by thread 0 (`producer`), none past the last row. (Not a lambda in the kernel: the coverage gate
// counts a lambda's branch arms over all the kernel's instances together, and instances without bulk loads never
// call it.)
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void load_slice_chunks(const SliceRing& ring, const ForwardParams<T, W, acc_t, R>& p, unsigned char* shared,
                                  int64_t first, bool producer, int64_t row, int from, int to) {
  ring.load(producer && row < p.rows, from, to, SliceRing::Stream{shared, p.x + p.x_rows.offset(row) + first * VEC});
}

// Normalizes vector c of a block's slice (whose first vector is `first`) and stores it to y, with the weight and bias
// from the block's copy where p.staged_params, from global memory otherwise.
template <int VEC, typename T, typename W, typename acc_t, typename R>
TLN_DEVICE void normalize_slice_vector(const ForwardParams<T, W, acc_t, R>& p, int64_t row, int64_t first, int64_t c,
                                       const acc_t (&v)[VEC], acc_t mean, acc_t rstd,
                                       const SlicedParams<W, VEC>& params) {
  if (p.staged_params) {
    normalize_and_store(p, row, first + c, v, mean, rstd, params);
  } else {
    normalize_and_store(p, row, first + c, v, mean, rstd, GlobalParams<W, VEC>{p.weight, p.bias});
  }
}

// Rows too long for registers, staged in shared memory: a row per block, or per thread-block cluster of
// p.cluster_blocks (sm_90), each block holding p.slice_vectors of it (its slice) as R, the type of the normalized
// row (x's, or residual_out's after a residual add: the row exactly as normalized, in the fewest bytes), and, where
// p.staged_params, its slice of the weight and bias, copied once. x is read once, kSharedRowUnroll vectors a thread
// at a time, all in flight before the first is used; the statistics come from shared memory (corrected two-pass); y is
// written once. A thread reads back only the vectors it staged, so the staging needs no barrier (bulk loads: each
// chunk's two mbarriers, SliceRing; the quantized instances refill the slice whole after a block barrier). A
// bulk-loaded slice of at most kSharedRowUnroll rounds of the block's threads is read from shared memory once, into
// registers, and its chunks released for the next row's copies at once: that row's loads are in flight during this
// row's reductions and normalize pass, which read the registers. The grid is the clusters the device holds at once,
// each walking rows.
template <typename T, typename W, typename acc_t, typename R, NormKind KIND, int VEC, bool QUANTIZED>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(kSharedRowThreads) norm_forward_shared_kernel(ForwardParams<T, W, acc_t, R> p) {
  using RowPieces = typename SharedVectors<R, VEC>::Piece;
  using ParamPieces = typename SharedVectors<W, VEC>::Piece;
  unsigned char* shared = dev::dynamic_shared<unsigned char>();
  const int param_rows = p.staged_params ? int{p.weight != nullptr} + int{p.bias != nullptr} : 0;
  const SharedRowLayout layout(p.slice_vectors * VEC, p.cluster_blocks, sizeof(R), param_rows, sizeof(W), sizeof(acc_t),
                               0, 0, p.bulk_stages);
  const SharedVectors<R, VEC> slice{reinterpret_cast<RowPieces*>(shared), p.slice_vectors};
  acc_t* scratch = reinterpret_cast<acc_t*>(shared + layout.scratch);
  const int cluster = p.cluster_blocks;
  const int threads = dev::block_dim_x();
  const RowSlice mine = row_slice(p.cols / VEC, p.slice_vectors, cluster);
  const int64_t first = mine.first, count = mine.count;  // of the row, in vectors
  const SlicedParams<W, VEC> params{
      {reinterpret_cast<ParamPieces*>(shared + layout.weight), p.slice_vectors},
      {reinterpret_cast<ParamPieces*>(shared + (p.weight != nullptr ? layout.bias : layout.weight)), p.slice_vectors},
      first};
  if (p.staged_params) params.fill(p, count);
  // Bulk loads where the slice's layout is the row's as stored (a row as loaded, 16-byte vectors).
  constexpr bool kBulkable = std::is_same_v<R, T> && VEC * sizeof(T) == kVectorBytes;
  const bool bulk = kBulkable && p.bulk_stages > 0;
  const SliceRing ring(shared + layout.stages, count, p.bulk_stages, threads);
  const bool producer = dev::thread_x() == 0;
  if (bulk && producer) ring.init(threads);
  ClusterReduce2<acc_t> cluster_reduce2(shared + layout.exchange, cluster);
  if (bulk) dev::sync_threads();  // the ring's mbarriers, before anyone waits on them
  const int64_t row_step = dev::grid_dim_x() / cluster;
  // The slice's first round of loads (kSharedRowUnroll vectors a thread) of the row the block walks next is issued
  // as soon as this row's are staged: it is in flight during this row's reductions and its normalize pass. With bulk
  // loads, every chunk of the block's first row instead; where the slice is kept in registers (`kept`), `raw` holds
  // this row's vectors, vector thread + k x threads in raw[k] (R is T there).
  const bool kept = !QUANTIZED && bulk && count <= int64_t{kSharedRowUnroll} * threads;
  Vec<T, VEC> raw[kSharedRowUnroll];
  if (!bulk) load_slice_round(p, dev::block_x() / cluster, first, count, dev::thread_x(), raw);
  if (bulk) load_slice_chunks<VEC>(ring, p, shared, first, producer, dev::block_x() / cluster, 0, p.bulk_stages);
  unsigned parity = 0;  // of the ring's phases for this row
  for (int64_t row = dev::block_x() / cluster; row < p.rows; row += row_step, parity ^= 1) {
    acc_t sum = acc_t(0);
    acc_t v[VEC];
    if constexpr (kBulkable) {
      if (kept) {  // round by round (chunks are whole rounds), each chunk waited for before its first round
        int waited = 0;
#pragma unroll
        for (int k = 0; k < kSharedRowUnroll; ++k) {
          ring.wait_through_round(waited, k, threads, parity);
          const int64_t c = dev::thread_x() + int64_t{k} * threads;
          if (c >= count) continue;
          slice.load(c, raw[k].v);
          to_acc(raw[k], v);
          sum += vector_sum(v);
        }  // (every chunk with vectors begins at a round: the empty ones need no wait)
        for (int k = 0; k < p.bulk_stages; ++k) {
          ring.release(k, parity, producer);  // chunk k read by every thread (thread 0 waits for that)
          load_slice_chunks<VEC>(ring, p, shared, first, producer, row + row_step, k, k + 1);
        }
      }
    }
    for (int k = 0; bulk && !kept && k < p.bulk_stages; ++k) {
      ring.wait(k, parity);
      for (int64_t c = ring.begin(k) + dev::thread_x(); c < ring.end(k); c += threads) {
        slice.load(c, v);
        sum += vector_sum(v);
      }
    }
    for (int64_t base = dev::thread_x(); !bulk && base < count; base += int64_t{kSharedRowUnroll} * threads) {
      if (base != dev::thread_x()) load_slice_round(p, row, first, count, base, raw);  // rounds after the first
#pragma unroll
      for (int k = 0; k < kSharedRowUnroll; ++k) {
        const int64_t c = base + int64_t{k} * threads;
        if (c >= count) break;
        to_acc(raw[k], v);
        add_residual(p, row, (first + c) * VEC, v);
        keep_input(p, row, (first + c) * VEC, v);
        Vec<R, VEC> as_row;
#pragma unroll
        for (int j = 0; j < VEC; ++j) as_row.v[j] = static_cast<R>(v[j]);  // exact: v holds values of R
        slice.store(c, as_row);
        sum += vector_sum(v);
      }
    }
    if (!bulk) load_slice_round(p, row + row_step, first, count, dev::thread_x(), raw);
    acc_t mean = acc_t(0), unused = acc_t(0);
    if (KIND == NormKind::LayerNorm) {
      cluster_reduce2(sum, unused, threads, scratch);
      mean = sum / static_cast<acc_t>(p.cols);
    }
    // Corrected two-pass variance (Chan, Golub and LeVeque): the deviations from the first mean sum to the row's
    // count times that mean's rounding error; added back, the mean is exact to rounding even for a large mean and a
    // small spread (rows of 16K+ values), and the squares lose only that error's square (never E[x^2] - E[x]^2).
    acc_t deviations = acc_t(0), squares = acc_t(0);
    const auto add_deviations = [&](const acc_t(&v)[VEC]) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        deviations += v[j] - mean;
        squares += (v[j] - mean) * (v[j] - mean);
      }
    };
    if (kept) {
#pragma unroll
      for (int k = 0; k < kSharedRowUnroll; ++k) {
        if (dev::thread_x() + int64_t{k} * threads >= count) break;
        to_acc(raw[k], v);
        add_deviations(v);
      }
    }
    for (int64_t c = dev::thread_x(); !kept && c < count; c += threads) {
      slice.load(c, v);
      add_deviations(v);
    }
    cluster_reduce2(deviations, squares, threads, scratch);
    if (KIND == NormKind::LayerNorm) {
      mean += deviations / static_cast<acc_t>(p.cols);
      squares -= deviations * deviations / static_cast<acc_t>(p.cols);
    }
    const acc_t rstd = rstd_from(squares, p.cols, p.eps);
    if (first == 0 && dev::thread_x() == 0) {
      if (p.mean != nullptr) dev::store_global(&p.mean[row], mean);
      dev::store_global(&p.rstd[row], rstd);
    }
    if constexpr (QUANTIZED) {
      const auto load = [&](int64_t c, acc_t(&w)[VEC]) { slice.load(c, w); };
      const auto reduce = [&](acc_t amax) {
        acc_t ignored = acc_t(0);
        cluster_reduce2(amax, ignored, threads, scratch, AbsMax{});
        return amax;
      };
      const bool writes = first == 0 && dev::thread_x() == 0;
      if (p.staged_params) {
        store_quantized_strided<VEC>(p, row, first, count, mean, rstd, params, load, writes, reduce);
      } else {
        store_quantized_strided<VEC>(p, row, first, count, mean, rstd, GlobalParams<W, VEC>{p.weight, p.bias}, load,
                                     writes, reduce);
      }
      if (bulk) dev::sync_threads();  // the slice read: the next row's chunks may land
      if (bulk) load_slice_chunks<VEC>(ring, p, shared, first, producer, row + row_step, 0, p.bulk_stages);
      continue;
    }
    if (kept) {  // from registers (the chunks already refilled)
#pragma unroll
      for (int k = 0; k < kSharedRowUnroll; ++k) {
        const int64_t c = dev::thread_x() + int64_t{k} * threads;
        if (c >= count) break;
        to_acc(raw[k], v);
        normalize_slice_vector(p, row, first, c, v, mean, rstd, params);
      }
      continue;
    }
    // By chunks of the ring (the whole slice as one without bulk loads): a chunk read by the block is refilled with
    // the next row's at once.
    const int chunks = bulk ? p.bulk_stages : 1;
    for (int k = 0; k < chunks; ++k) {
      for (int64_t c = (bulk ? ring.begin(k) : 0) + dev::thread_x(); c < (bulk ? ring.end(k) : count); c += threads) {
        slice.load(c, v);
        normalize_slice_vector(p, row, first, c, v, mean, rstd, params);
      }
      if (!bulk) continue;
      ring.release(k, parity, producer);  // chunk k read by every thread (thread 0 waits for that)
      load_slice_chunks<VEC>(ring, p, shared, first, producer, row + row_step, k, k + 1);
    }
  }
  // No barrier before exiting: no block reads another's shared memory, every store into a block completes a phase
  // the block waits for, and no bulk load is issued past the block's last row.
}

// The forward's kernels by register tier, for launch_rows; QUANTIZED: their *_quant instances; GATED: the gated
// RMSNorm's, which has no LayerNorm form and no shared-memory path (its long rows take the multi-pass kernel): null
// kernels there, which its plans never launch.
template <typename T, typename W, typename acc_t, typename R, bool QUANTIZED = false, bool GATED = false>
struct ForwardKernels {
  static constexpr RegisterBudget budget = for_accumulator(gated_budget(kForwardBudget, GATED), sizeof(acc_t));
  using Kernel = void (*)(ForwardParams<T, W, acc_t, R>);
  template <NormKind K, int VEC, int ITEMS>
  static constexpr Kernel get() {
    if constexpr (GATED && K == NormKind::LayerNorm) {
      return nullptr;
    } else if constexpr (ITEMS == 0) {
      return &norm_forward_multipass_kernel<T, W, acc_t, R, K, VEC, QUANTIZED, GATED>;
    } else {
      return &norm_forward_kernel<T, W, acc_t, R, K, VEC, ITEMS, QUANTIZED, GATED>;
    }
  }
  template <NormKind K, int VEC>
  static constexpr Kernel shared_row(const RowPlan&) {
    if constexpr (GATED) {
      return nullptr;
    } else {
      return &norm_forward_shared_kernel<T, W, acc_t, R, K, VEC, QUANTIZED>;
    }
  }
};

}  // namespace torch_ln
