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

// Combines two values over a row's `blocks` blocks of a thread-block cluster, a group of consecutive ranks (the
// cluster may hold several rows' groups of them): each block's results (row_reduce2, which leaves them in every
// thread), then thread r of each block stores them by st.async into its rank's slot in block r of the group,
// completing on that block's mbarrier (thread 0 arrives on its own, expecting the group's bytes), and every block
// combines the group's results in rank order from its own shared memory after its wait, so all get the bitwise same
// values (sums, by default). No cluster barrier per reduction: those fence the GPU (MEMBAR.ALL.GPU) and hold the
// cluster's blocks in lockstep. Consecutive reductions alternate between two halves of the exchange, each with its
// mbarrier: a block stores into a peer's half for reduction n + 2 only after its reduction n + 1 completed, which
// needed the peer's results of n + 1, which the peer sends after its block barrier following its reads of that half
// for reduction n (row_reduce2 synchronizes the block; the race check holds the kernels to it). A template of the
// accumulator alone: the same code serves every kernel instance.
template <typename acc_t>
struct ClusterReduce2 {
  // Per half: every block's results have landed; then, per half and rank, a pair of results (result()).
  uint64_t* arrived;
  int blocks;
  int reductions = 0;

  // Every thread of the cluster, before the first reduction: the mbarriers set up and seen by every peer. `room`:
  // the exchange's place in shared memory (SharedRowLayout::exchange).
  TLN_DEVICE ClusterReduce2(void* room, int blocks) : arrived(static_cast<uint64_t*>(room)), blocks(blocks) {
    if (blocks == 1) return;
    if (dev::thread_x() == 0) {
      dev::mbarrier_init(&arrived[0], 1);
      dev::mbarrier_init(&arrived[1], 1);
    }
    dev::cluster_sync();
  }

  TLN_DEVICE acc_t* result(int half, int rank) const {
    return reinterpret_cast<acc_t*>(arrived + 2) + 2 * (half * blocks + rank);
  }

  template <typename Combine = Plus>
  TLN_DEVICE void operator()(acc_t& a, acc_t& b, int threads, acc_t* scratch, Combine combine = {}) {
    row_reduce2(a, b, threads, scratch, combine);
    if (blocks == 1) return;
    const int half = reductions & 1;
    const unsigned parity = (reductions >> 1) & 1;  // the phase of this half's mbarrier that this reduction completes
    ++reductions;
    uint64_t* landed = &arrived[half];
    if (dev::thread_x() == 0) dev::mbarrier_arrive_expect_tx(landed, static_cast<unsigned>(blocks * 2 * sizeof(acc_t)));
    if (dev::thread_x() < static_cast<unsigned>(blocks)) {  // thread r sends to the group's block r
      const unsigned in_group = dev::cluster_rank() % blocks;
      dev::store_async_pair(result(half, static_cast<int>(in_group)), a, b,
                            dev::cluster_rank() - in_group + dev::thread_x(), landed);
    }
    dev::mbarrier_wait(landed, parity);
    a = b = acc_t(0);
    for (int rank = 0; rank < blocks; ++rank) {
      const acc_t* pair = result(half, rank);
      a = combine(a, dev::load_shared(pair));
      b = combine(b, dev::load_shared(pair + 1));
    }
  }
};

}  // namespace torch_ln
