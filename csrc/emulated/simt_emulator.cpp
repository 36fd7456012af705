#include "simt_emulator.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace torch_ln::emu {

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "SIMT emulator: %s\n", message.c_str());
  std::abort();
}

// Counts completed barrier phases; the watchdog of a launch reads it.
std::atomic<uint64_t> barrier_phases{0};

// A reusable barrier for a fixed number of threads, on atomics (a futex wait):
// releasing a phase wakes the waiters without making them queue on a mutex.
// Each arrival names the barrier it is (block start, __syncthreads, warp
// shuffle, block end): threads of one phase that name different barriers have
// diverged, which on a GPU is undefined behaviour, so it is an error here.
class Barrier {
 public:
  explicit Barrier(unsigned count) : count_(count) {}

  void arrive_and_wait(const char* what) {
    const uint64_t generation = generation_.load(std::memory_order_acquire);
    const char* expected = nullptr;
    if (!phase_name_.compare_exchange_strong(expected, what) && expected != what) {
      fail(std::string("divergent barrier: some threads reached '") + expected + "', others '" + what + "'");
    }
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == count_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_name_.store(nullptr, std::memory_order_relaxed);
      barrier_phases.fetch_add(1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      generation_.notify_all();
      return;
    }
    generation_.wait(generation, std::memory_order_acquire);
  }

 private:
  const unsigned count_;
  std::atomic<unsigned> arrived_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<const char*> phase_name_{nullptr};
};

// A kernel whose threads wait at a barrier some never reach hangs a GPU; here
// the launch's watchdog aborts with a message once no barrier has completed
// for this long.
constexpr auto kDeadlockTimeout = std::chrono::seconds(300);

class Watchdog {
 public:
  Watchdog() : thread_([this] { watch(); }) {}
  ~Watchdog() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    uint64_t seen = barrier_phases.load();
    while (!wake_.wait_for(lock, kDeadlockTimeout, [this] { return done_; })) {
      const uint64_t now = barrier_phases.load();
      if (now == seen) fail("deadlock: threads wait at a barrier that not every thread of the block reaches");
      seen = now;
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;
};

struct Warp {
  Barrier barrier{kWarpSize};
  uint64_t lanes[kWarpSize] = {};
};

thread_local ThreadContext* current_thread = nullptr;

std::mutex launch_mutex;

}  // namespace

class BlockState {
 public:
  BlockState(unsigned threads, size_t smem_bytes) : barrier(threads), warps(threads / kWarpSize), smem(smem_bytes) {}

  Barrier barrier;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;
};

ThreadContext& this_thread() {
  if (current_thread == nullptr) fail("a device function ran outside an emulated kernel");
  return *current_thread;
}

void sync_threads() { this_thread().block->barrier.arrive_and_wait("__syncthreads"); }

uint64_t warp_exchange(uint64_t value, unsigned src_lane) {
  ThreadContext& t = this_thread();
  Warp& warp = t.block->warps[t.linear_tid / kWarpSize];
  warp.lanes[t.linear_tid % kWarpSize] = value;
  warp.barrier.arrive_and_wait("warp shuffle (publish)");
  const uint64_t received = warp.lanes[src_lane % kWarpSize];
  warp.barrier.arrive_and_wait("warp shuffle (read)");
  return received;
}

unsigned char* dynamic_shared_memory() {
  auto& smem = this_thread().block->smem;
  return smem.empty() ? nullptr : smem.data();
}

void launch(Dim3 grid, Dim3 block, size_t dynamic_smem_bytes, const std::function<void()>& body) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || threads % kWarpSize != 0) {
    throw std::invalid_argument("SIMT emulator: a block needs a multiple of 32 threads, at most 1024; got " +
                                std::to_string(threads));
  }
  const std::lock_guard<std::mutex> serialize(launch_mutex);
  BlockState state(threads, dynamic_smem_bytes);
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;

  auto run_thread = [&](unsigned tid) {
    ThreadContext ctx{
        {tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)}, {}, block, grid, &state, tid};
    current_thread = &ctx;
    for (uint64_t b = 0; b < blocks; ++b) {
      ctx.block_idx = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                       static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y))};
      // Shared memory is uninitialized on a GPU: poison it for each block.
      if (tid == 0 && !state.smem.empty()) std::memset(state.smem.data(), 0xFF, state.smem.size());
      state.barrier.arrive_and_wait("block start");
      body();
      state.barrier.arrive_and_wait("block end");
    }
    current_thread = nullptr;
  };

  const Watchdog watchdog;
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned tid = 0; tid < threads; ++tid) pool.emplace_back(run_thread, tid);
  for (auto& t : pool) t.join();
}

}  // namespace torch_ln::emu
