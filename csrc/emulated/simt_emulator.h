// SIMT emulation of the CUDA execution model on the CPU, for testing the exact
// kernel code without a GPU (see csrc/cuda/device.cuh, which maps the kernels'
// device layer onto this file when compiled by a host compiler).
//
// Each CUDA thread of a block runs as its own OS thread; __syncthreads is a real
// barrier across the block's threads; warp shuffles exchange values between the
// 32 threads of a warp through a barrier; blocks run one after another. Dynamic
// shared memory is allocated with its exact size (so AddressSanitizer sees an
// overrun) and filled with NaN bytes before every block (so a read of shared
// memory nobody wrote shows up as a wrong result).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

namespace torch_ln::emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

constexpr int kWarpSize = 32;

class BlockState;

// What one emulated thread knows about itself; set by the emulator before the
// kernel body runs.
struct ThreadContext {
  Dim3 thread_idx, block_idx, block_dim, grid_dim;
  BlockState* block;
  unsigned linear_tid;
};

ThreadContext& this_thread();

// Block-wide barrier (__syncthreads).
void sync_threads();

// Exchanges 64-bit payloads within the calling thread's warp: every lane
// publishes `value` and receives the value of lane `src_lane`.
uint64_t warp_exchange(uint64_t value, unsigned src_lane);

// The launch's dynamic shared memory.
unsigned char* dynamic_shared_memory();

// Runs `body` as a grid of `grid` blocks of `block` threads. Launches are
// serialized; the threads of a block must be a multiple of the warp size.
void launch(Dim3 grid, Dim3 block, size_t dynamic_smem_bytes, const std::function<void()>& body);

// __shfl_xor_sync over the full warp: the value held by lane (this lane ^ lane_mask).
template <typename T>
T shfl_xor(T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "warp shuffles move at most 64 bits");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  const unsigned lane = this_thread().linear_tid % kWarpSize;
  bits = warp_exchange(bits, lane ^ static_cast<unsigned>(lane_mask));
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace torch_ln::emu
