// Reduces the backward's partial weight/bias gradients, [slots, cols] in
// float32 (float64), to [cols] in the parameter dtype: each column sums its
// slots in a fixed order, so the result is the same bits on every run.
#pragma once

#include <cstdint>

#include "device.cuh"

namespace torch_ln {

constexpr int kReduceCols = 32;  // columns per block: one warp-wide coalesced read per slot
constexpr int kReduceRows = 8;   // slot stripes per block, added in order at the end

// blockIdx.y selects the gradient: 0 for dweight, 1 for dbias.
template <typename acc_t, typename W>
TLN_KERNEL void TLN_LAUNCH_BOUNDS(kReduceCols* kReduceRows)
    reduce_partials_kernel(const acc_t* partial_dweight, const acc_t* partial_dbias, W* dweight, W* dbias,
                           int64_t slots, int64_t cols) {
  const acc_t* partial = dev::block_y() == 0 ? partial_dweight : partial_dbias;
  W* out = dev::block_y() == 0 ? dweight : dbias;
  if (partial == nullptr) return;  // the whole block leaves together
  TLN_STATIC_SHARED(acc_t, stripes, kReduceRows * kReduceCols);
  const int64_t col = int64_t{dev::block_x()} * kReduceCols + dev::thread_x();
  acc_t sum = acc_t(0);
  if (col < cols) {
    for (int64_t s = dev::thread_y(); s < slots; s += kReduceRows) sum += dev::load_global(&partial[s * cols + col]);
  }
  dev::store_shared(&stripes[dev::thread_y() * kReduceCols + dev::thread_x()], sum);
  dev::sync_threads();
  if (dev::thread_y() == 0 && col < cols) {
    acc_t total = acc_t(0);
    for (int r = 0; r < kReduceRows; ++r) total += dev::load_shared(&stripes[r * kReduceCols + dev::thread_x()]);
    dev::store_global(&out[col], static_cast<W>(total));
  }
}

}  // namespace torch_ln
