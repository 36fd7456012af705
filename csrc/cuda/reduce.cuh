// Device helpers shared by the kernels: vector memory access and reductions (sums, the quantized outputs' amax)
// built in layers (thread -> warp -> row of warps -> cluster).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "../quantize.h"
#include "device.cuh"

namespace torch_ln {

// VEC elements moved by one aligned access (16 bytes for VEC = 16 / sizeof(T)).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <int VEC, typename acc_t, typename T>
TLN_DEVICE void to_acc(const Vec<T, VEC>& v, acc_t (&out)[VEC]) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = static_cast<acc_t>(v.v[j]);
}

// Loads VEC elements starting at element `i` of `p`, converted to acc_t.
template <int VEC, typename acc_t, typename T>
TLN_DEVICE void load_vec(const T* p, int64_t i, acc_t (&out)[VEC], dev::Site site = TLN_SITE) {
  to_acc(dev::load_global(reinterpret_cast<const Vec<T, VEC>*>(p + i), site), out);
}

// The VEC elements at element `i` of `p` as stored where `pred` holds, zeros elsewhere: the register kernels
// load a row's vectors so, before converting any (to_acc), so that the loads are in flight together.
template <int VEC, typename T>
TLN_DEVICE Vec<T, VEC> load_vec_if(bool pred, const T* p, int64_t i, dev::Site site = TLN_SITE) {
  return dev::load_global_if(pred, reinterpret_cast<const Vec<T, VEC>*>(p), i / VEC, site);
}

template <int VEC, typename acc_t, typename T>
TLN_DEVICE void store_vec(T* p, int64_t i, const acc_t (&in)[VEC], dev::Site site = TLN_SITE) {
  Vec<T, VEC> v;
#pragma unroll
  for (int j = 0; j < VEC; ++j) v.v[j] = static_cast<T>(in[j]);
  dev::store_global(reinterpret_cast<Vec<T, VEC>*>(p + i), v, site);
}

// How the threads of a block map onto rows in the register kernels: threads
// [r * tpr, (r + 1) * tpr) hold row r of the block's current tile of rows, and a
// thread's k-th vector is vector k * tpr + lane of the row, so that a warp's
// accesses are contiguous. Tiles advance by the grid's rows; the loop bound is
// uniform across the block, so every thread reaches each reduction.
struct RowLayout {
  int threads_per_row, lane, rows_per_block, row_in_block;

  TLN_DEVICE explicit RowLayout(int tpr)
      : threads_per_row(tpr),
        lane(dev::thread_x() % tpr),
        rows_per_block(dev::block_dim_x() / tpr),
        row_in_block(dev::thread_x() / tpr) {}

  TLN_DEVICE int64_t vector(int k) const { return int64_t{k} * threads_per_row + lane; }
};

// The reductions' combining steps: a sum, and the amax of the quantized outputs (NaN-propagating, fold_abs_max).
struct Plus {
  template <typename V>
  TLN_DEVICE V operator()(V a, V b) const {
    return a + b;
  }
};
struct AbsMax {
  template <typename V>
  TLN_DEVICE V operator()(V running, V v) const {
    return fold_abs_max(running, v);
  }
};

// v combined over the `width` lanes (a power of two <= 32) of each aligned lane group. The xor butterfly combines
// the same pairs in every lane, so every lane ends with the bitwise same result.
template <typename V, typename Combine = Plus>
TLN_DEVICE V warp_reduce(V v, int width, Combine combine = {}) {
  for (int offset = width / 2; offset > 0; offset /= 2) v = combine(v, dev::shfl_xor(v, offset));
  return v;
}

// Combines two values over the threads of one row: a row of `threads_per_row`
// threads starting at thread `row_in_block * threads_per_row` of the block.
// Rows of up to 32 threads reduce inside their warp; longer rows combine their
// warps' results through shared memory `smem` (2 per warp of the block), in warp
// order from `identity`, so the result is deterministic and identical in every
// thread. Every thread of the block must call it (it synchronizes the block when
// rows span several warps).
template <typename V, typename Combine = Plus>
TLN_DEVICE void row_reduce2(V& a, V& b, int threads_per_row, V* smem, Combine combine = {}, V identity = V(0)) {
  a = warp_reduce(a, threads_per_row < dev::kWarpSize ? threads_per_row : dev::kWarpSize, combine);
  b = warp_reduce(b, threads_per_row < dev::kWarpSize ? threads_per_row : dev::kWarpSize, combine);
  if (threads_per_row <= dev::kWarpSize) return;
  const int warp = dev::thread_x() / dev::kWarpSize;
  const int warps_per_row = threads_per_row / dev::kWarpSize;
  const int first_warp = warp / warps_per_row * warps_per_row;
  if (dev::thread_x() % dev::kWarpSize == 0) {
    dev::store_shared(&smem[2 * warp], a);
    dev::store_shared(&smem[2 * warp + 1], b);
  }
  dev::sync_threads();
  a = b = identity;
  for (int w = first_warp; w < first_warp + warps_per_row; ++w) {
    a = combine(a, dev::load_shared(&smem[2 * w]));
    b = combine(b, dev::load_shared(&smem[2 * w + 1]));
  }
  dev::sync_threads();  // smem is reused by the next reduction
}

template <typename acc_t>
TLN_DEVICE void row_sum2(acc_t& a, acc_t& b, int threads_per_row, acc_t* smem) {
  row_reduce2(a, b, threads_per_row, smem);
}

template <typename V, typename Combine = Plus>
TLN_DEVICE V row_reduce(V a, int threads_per_row, V* smem, Combine combine = {}) {
  V unused = V(0);
  row_reduce2(a, unused, threads_per_row, smem, combine);
  return a;
}

// Combines two values over a row's `blocks` blocks of a thread-block cluster, ranks first_rank.. (the cluster may
// hold several rows' groups of them): each block's results (row_reduce2), then every block combines the group's
// results in rank order from their shared memory, so all get the bitwise same values (sums, by default).
// Consecutive reductions alternate between two slots of `partials` (4 values): a slot is rewritten only after the
// cluster barrier of the reduction in between, which every block passes after it has read the slot. A template of
// the accumulator alone: the same code serves every kernel instance.
template <typename acc_t>
struct ClusterReduce2 {
  acc_t* partials;
  int blocks;
  unsigned first_rank = 0;
  int reductions = 0;

  template <typename Combine = Plus>
  TLN_DEVICE void operator()(acc_t& a, acc_t& b, int threads, acc_t* scratch, Combine combine = {}) {
    row_reduce2(a, b, threads, scratch, combine);
    if (blocks == 1) return;
    acc_t* slot = partials + 2 * (reductions++ & 1);
    if (dev::thread_x() == 0) {
      dev::store_shared(slot, a);
      dev::store_shared(slot + 1, b);
    }
    dev::cluster_sync();
    a = b = acc_t(0);
    for (int rank = 0; rank < blocks; ++rank) {
      const acc_t* remote = dev::cluster_shared(slot, first_rank + rank);
      a = combine(a, dev::load_shared(remote));
      b = combine(b, dev::load_shared(remote + 1));
    }
  }
};

}  // namespace torch_ln
