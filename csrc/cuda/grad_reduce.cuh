// Reduces the backward's partial weight/bias gradients, [blocks, cols] in
// float32 (float64), to [cols] in the parameter dtype: each column sums its
// partial rows in a fixed order, so the result is the same bits on every run.
#pragma once

#include <cstdint>

#include "device.cuh"
#include "reduce.cuh"

namespace torch_ln {

constexpr int kReduceVectors = 32;  // column vectors per block: one warp-wide coalesced read per partial row
constexpr int kReduceStripes = 16;  // stripes of partial rows per block, added in order at the end

// blockIdx.y selects the gradient: 0 for dweight, 1 for dbias. VEC columns a
// thread: 16 bytes of acc_t when they divide the columns, else 1.
template <typename acc_t, typename W, int VEC>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(kReduceVectors* kReduceStripes)
    reduce_partials_kernel(const acc_t* partial_dweight, const acc_t* partial_dbias, W* dweight, W* dbias,
                           int64_t partial_rows, int64_t cols) {
  dev::wait_for_prior_grid();  // launched while the row kernel that writes the partial rows ends
  const acc_t* partial = dev::block_y() == 0 ? partial_dweight : partial_dbias;
  W* out = dev::block_y() == 0 ? dweight : dbias;
  if (partial == nullptr) return;  // the whole block leaves together
  // Element j of each stripe's vectors together: a warp's accesses fall in distinct banks.
  TLN_STATIC_SHARED(acc_t, stripes, kReduceStripes * VEC * kReduceVectors);
  const int64_t v = int64_t{dev::block_x()} * kReduceVectors + dev::thread_x();
  const bool in_row = v < cols / VEC;
  acc_t sum[VEC] = {};
  if (in_row) {
    // Unrolled: 16 rows' loads in flight before their adds, which stay in row order (256 bytes a thread: the grid
    // has only 2 x cols / 128 blocks, so each thread must keep many loads in flight to stream at copy speed).
#pragma unroll 16
    for (int64_t r = dev::thread_y(); r < partial_rows; r += kReduceStripes) {
      acc_t part[VEC];
      load_vec<VEC>(partial + r * cols, v * VEC, part);
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum[j] += part[j];
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    dev::store_shared(&stripes[(dev::thread_y() * VEC + j) * kReduceVectors + dev::thread_x()], sum[j]);
  }
  dev::sync_threads();
  if (dev::thread_y() == 0 && in_row) {
    acc_t total[VEC] = {};
    for (int s = 0; s < kReduceStripes; ++s) {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        total[j] += dev::load_shared(&stripes[(s * VEC + j) * kReduceVectors + dev::thread_x()]);
    }
    store_vec<VEC>(out, v * VEC, total);
  }
}

}  // namespace torch_ln
