// SIMT emulation of the CUDA execution model on the CPU, for testing the exact
// kernel code without a GPU (see csrc/cuda/device.cuh, which maps the kernels'
// device layer onto this file when compiled by a host compiler).
//
// Each CUDA thread of a block runs as its own fiber (a user-space context with
// its own stack), one at a time on the launching OS thread, switching at
// barriers; __syncthreads is a real barrier across the block's threads; warp shuffles exchange values between the
// 32 threads of a warp through a barrier; blocks run one after another, except
// that the blocks of a thread-block cluster run together, with a real cluster
// barrier and each other's shared memory mapped (distributed shared memory). Dynamic
// shared memory is allocated with its exact size (so AddressSanitizer sees an
// overrun) and filled with NaN bytes before every block (so a read of shared
// memory nobody wrote shows up as a wrong result).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace torch_ln::emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

constexpr int kWarpSize = 32;

class BlockState;
class ClusterState;

// The source line of a memory access.
struct Site {
  const char* file;
  unsigned line;
};

// What one emulated thread knows about itself; set by the emulator before the
// kernel body runs.
struct ThreadContext {
  Dim3 thread_idx, block_idx, block_dim, grid_dim;
  BlockState* block;
  unsigned linear_tid;
  ClusterState* cluster;
  unsigned cluster_rank;     // the block's rank in its cluster (0 without clusters)
  bool awaiting_prior_grid;  // a dependent launch's thread before wait_for_prior_grid: global memory is off limits
};

ThreadContext& this_thread();

// Block-wide barrier (__syncthreads).
void sync_threads();

// Exchanges 64-bit payloads within the calling thread's warp: every lane
// publishes `value` and receives the value of lane `src_lane`.
uint64_t warp_exchange(uint64_t value, unsigned src_lane);

// The launch's dynamic shared memory.
unsigned char* dynamic_shared_memory();

// Barrier over every thread of the calling thread's cluster (barrier.cluster).
void cluster_sync();

// `p`, a location in the calling block's dynamic shared memory, in the shared memory of block `rank` of its
// cluster (cluster.map_shared_rank); aborts for an address outside it or a rank outside the cluster.
const void* map_shared_rank(const void* p, unsigned rank);

// mbarriers (sm_90's shared-memory transaction barriers), named by the address of their 8 bytes in the calling
// block's dynamic shared memory (the emulator keeps their state beside it). A phase completes when it has had the
// arrivals given at init and every byte it expects (arrive_expect_tx) has landed (store_async); the next phase then
// begins. A wait returns once the phase of parity `parity` has completed. The race check orders what a thread does
// after its wait after everything the phase's arrivals and stores did before them. mbarrier_arrive: an arrival that
// expects no bytes (a consumer's release of what it read).
void mbarrier_init(void* bar, unsigned arrivals, Site site);
void mbarrier_arrive_expect_tx(void* bar, unsigned bytes, Site site);
void mbarrier_arrive(void* bar, Site site);
void mbarrier_wait(void* bar, unsigned parity, Site site);

// st.async: `bytes` of `src` stored at `dst` in the shared memory of block `rank` of the cluster, completing that many
// bytes on its mbarrier `bar` (`dst` and `bar` given as locations in the calling block's dynamic shared memory, as
// map_shared_rank takes them). The bytes land at once, but the race check takes them as unwritten for any thread
// until it has waited for the phase they complete. Not counted as traffic: its lanes store into other blocks' shared
// memory, a few bytes per cluster reduction, with no bank conflict between them.
void store_async(void* dst, const void* src, size_t bytes, unsigned rank, void* bar, Site site);

// cp.async.bulk (global -> shared): `bytes` of global memory at `src` copied to `dst` in the calling block's dynamic
// shared memory, completing that many bytes on the block's mbarrier `bar`; addresses and size multiples of 16 bytes
// (else it aborts). The bytes land at once; the race check takes them as unwritten, as store_async's. Counted as the
// issuing thread's global loads, 128 bytes at a time (no shared-memory requests: the copy engine writes them).
void bulk_load_shared(void* dst, const void* src, size_t bytes, void* bar, Site site);

// cp.async (sm_80): `bytes` (4, 8 or 16, both addresses aligned to it) of global memory at `src` copied to `dst` in
// the calling block's dynamic shared memory. The copy joins the thread's open group; copy_async_commit closes the
// group, and copy_async_wait(n) returns once at most the n most recent closed groups are still in flight. The bytes
// land at once; the race check takes any access to them, by any thread, the issuer's included, as a race until the
// issuer's wait covers their group, and after it as the issuer's store. Counted as the issuer's global load. A thread
// that ends its block with copies not waited for aborts.
void copy_async(void* dst, const void* src, size_t bytes, Site site);
void copy_async_commit();
void copy_async_wait(unsigned pending, Site site);

// Runs `body` as a grid of `grid` blocks of `block` threads, in clusters of
// `cluster` blocks along x (grid.x a multiple of it). Launches are serialized;
// the threads of a block must be a multiple of the warp size. `kernel` names
// the launch in the traffic log (its symbol). A `dependent` launch (programmatic
// dependent launch: on a GPU it may start before the kernel ahead of it ends)
// aborts where a thread touches global memory before wait_for_prior_grid.
void launch(Dim3 grid, Dim3 block, size_t dynamic_smem_bytes, const void* kernel, const std::function<void()>& body,
            unsigned cluster = 1, bool dependent = false);

// griddepcontrol.wait: from here on the calling thread may read what the kernel before a dependent launch wrote.
void wait_for_prior_grid();

// Traffic counters. Every global and shared access of a kernel reports here with
// the source line it comes from. At the end of each block the accesses of each
// warp are grouped into warp-wide requests: the n-th access a lane makes from a
// source line joins the n-th access of every other lane of the warp from that
// line (what one instruction of a warp does on a GPU; the kernels' access
// sequences are warp-uniform, and a group whose lanes disagree on the access's
// width or direction aborts). Per launch: requested bytes, 32-byte sectors,
// unique bytes, a DRAM estimate, shared-memory bank conflicts and barriers; see
// simt_emulator.cpp for the L2 model behind the DRAM estimate.
enum class Space { Global, Shared };
void record_access(Space space, const void* address, size_t bytes, bool store, Site site);

// Whether the shared-memory race check is on (TORCH_LN_RACECHECK=1 when the library loads): every shared access is
// checked against the others of its launch, and a launch with a race throws, naming it (simt_emulator.cpp).
bool racecheck_enabled();

// The emulated occupancy API's queries (dev::resident_blocks_per_sm): each launch's record ("occupancy_queries") has
// those asked since the launch before it, what a GPU's host would have paid for (the launchers remember their
// answers: launch_common.h's remembered).
void count_occupancy_query();

// Counting is off unless switched on (the kernel model and the traffic tests):
// the other emulated runs pay nothing for it.
void set_counting(bool on);

// The L2 model of the DRAM estimate: `l2_bytes` of cache shared by
// `concurrent_blocks` blocks in flight (0: as many as fit on an H200 by threads
// alone, at most the grid).
void set_l2_model(double l2_bytes, int64_t concurrent_blocks);

// For the kernel model only: run just the first `blocks` blocks of each row of
// a grid (0: all) and scale the counters to the whole grid. Valid for launches
// whose blocks along x do alike work on disjoint data (the backward's reduce);
// the results of the skipped blocks are never computed.
void set_block_sample(unsigned blocks);

// Names address ranges [begin, end) (a tensor each): every launch then also
// reports the bytes it loads and stores in each, and in none of them ("other").
struct Region {
  std::string name;
  uintptr_t begin, end;
};
void set_regions(std::vector<Region> regions);

// The counters of every launch since the last call, as a JSON list (one object
// per launch); clears them.
std::string take_launch_log();

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
