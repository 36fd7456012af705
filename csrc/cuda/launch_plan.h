// Launch planning: the one function that picks the thread layout of the row
// kernels from the row length. Plain host C++, shared by the CUDA build and the
// emulated build, so the emulation tests exercise the very same plans.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace torch_ln {

// What the plan needs to know about the device.
struct DeviceLimits {
  int num_sms;
  int max_threads_per_sm;
  size_t max_shared_per_block;  // dynamic shared memory a block may have (opted in beyond 48 KB)
};

constexpr int kVectorBytes = 16;        // one 128-bit load or store
constexpr int kRowsBlockThreads = 128;  // block size when several rows share a block
constexpr int kSmallItems = 2;          // vectors per thread for short rows

// How much of a row a thread keeps in registers, per kernel family. Sized by
// the register file (64K 32-bit registers per SM): a block of max_threads may
// use 65536 / max_threads registers a thread, and the values it holds must fit
// in them with room for addresses and indices (ptxas: no spills, no stack; the
// tests check it for every instantiation).
struct RegisterBudget {
  int elems;         // accumulator values per thread, for a 4-byte accumulator, in 16-byte vectors
  int scalar_elems;  // the same on the scalar path, where each value carries its own address and bounds check
  int max_threads;   // threads per row (and per block) at most; the kernels' launch bounds
};
// The forward holds x: 32 values a thread in up to 128 registers (512 threads;
// at 1024 threads, 64 registers do not hold 32 values and their addresses), 8
// on the scalar path (each value with its own address and bounds check).
constexpr RegisterBudget kForwardBudget{32, 8, 512};
// The backward holds x, dy, the weight and the running weight/bias gradient
// sums: 5 x 16 values a thread, so blocks stop at 512 threads to stay within the
// register file; 8 on the scalar path.
constexpr RegisterBudget kBackwardBudget{16, 8, 512};

// A budget for accumulators of `acc_bytes`: 8-byte (float64) values take two registers each.
constexpr RegisterBudget for_accumulator(RegisterBudget budget, int acc_bytes) {
  return {budget.elems * 4 / acc_bytes, budget.scalar_elems * 4 / acc_bytes, budget.max_threads};
}

// The register tiers a kernel is compiled for, in vectors per thread: kSmallItems
// and this one.
constexpr int large_items(int vec, RegisterBudget budget) {
  return std::max(kSmallItems, vec == 1 ? budget.scalar_elems : budget.elems / vec);
}

struct RowPlan {
  int vec;              // elements per access: a 16-byte vector, or 1 (the scalar path)
  int items;            // vectors per thread kept in registers; 0 means the multi-pass path
  int threads_per_row;  // a power of two; rows of <= 32 threads live inside one warp
  int rows_per_block;
  int64_t blocks;

  bool multipass() const { return items == 0; }
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

// Plans the row kernels for M rows of D elements of `elem_bytes` each.
// `vectorizable`: every pointer involved is 16-byte aligned and each row starts
// 16-byte aligned (D * elem_bytes % 16 == 0); otherwise the scalar path runs.
// Rows beyond the grid are handled by a grid-stride loop. The layout depends
// only on D, dtype and alignment, never on M: that makes a row's result
// independent of its batch.
inline RowPlan plan_rows(int64_t M, int64_t D, int elem_bytes, bool vectorizable, RegisterBudget budget) {
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
  } else {  // very long rows: a block per row, several passes over global memory
    p.items = 0;
    p.threads_per_row = budget.max_threads;
  }
  p.rows_per_block = std::max(1, kRowsBlockThreads / p.threads_per_row);
  p.blocks = std::max<int64_t>(1, std::min(ceil_div(M, p.rows_per_block), int64_t{1} << 30));
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

}  // namespace torch_ln
