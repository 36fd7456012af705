#include "simt_emulator.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_ln::emu {

namespace {

thread_local ThreadContext* current_thread = nullptr;

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "SIMT emulator: %s\n", message.c_str());
  std::abort();
}

std::vector<std::string> races;  // the current launch's shared-memory races (TORCH_LN_RACECHECK), the first few

// Emulated threads are fibers that the launching OS thread runs one at a time, round-robin: each runs until it
// waits at a barrier, then the next one runs. A switch is a user-space context swap (where OS threads cost a futex
// wake and a kernel context switch per thread and barrier), and a launch runs the same way every time.
class Fibers {
 public:
  Fibers(size_t count, std::function<void(size_t)> entry) : entry_(std::move(entry)), fibers_(count) {
    for (Fiber& f : fibers_) {
      f.mapping = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (f.mapping == MAP_FAILED) fail("cannot map a fiber stack");
      if (mprotect(f.mapping, kGuardBytes, PROT_NONE) != 0) fail("cannot protect a fiber stack's guard page");
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = stack_bottom(f);
      f.context.uc_stack.ss_size = kStackBytes;
      makecontext(&f.context, &Fibers::start, 0);
      // ASan's swapcontext interceptor clears the shadow of the stack the target context names on every switch,
      // which would erase a resumed fiber's live redzones; the fiber annotations below tell it the stacks instead.
      f.context.uc_stack = {};
    }
  }
  ~Fibers() {
    for (Fiber& f : fibers_) {
      // The fibers' last frames left redzones in ASan's shadow; a later mapping at these addresses must not inherit
      // them.
      unpoison(stack_bottom(f), kStackBytes);
      munmap(f.mapping, kGuardBytes + kStackBytes);
    }
  }
  Fibers(const Fibers&) = delete;
  Fibers& operator=(const Fibers&) = delete;

  // Runs every fiber to its end. A pass over the fibers in which none arrived at a barrier or ended is a deadlock.
  void run() {
    running = this;
    size_t live = fibers_.size();
    while (live > 0) {
      const uint64_t before = progress;
      for (current_ = 0; current_ < fibers_.size(); ++current_) {
        Fiber& f = fibers_[current_];
        if (f.finished) continue;
        void* fake_stack = nullptr;
        start_switch(&fake_stack, stack_bottom(f), kStackBytes);
        swapcontext(&scheduler_, &f.context);
        finish_switch(fake_stack, nullptr, nullptr);
        live -= f.finished;
      }
      if (live > 0 && progress == before) {
        std::string message = "deadlock: threads wait at a barrier that not every thread of the block reaches";
        for (const std::string& race : races) message += "\n  after a shared-memory race: " + race;
        fail(message);
      }
    }
    running = nullptr;
  }

  // Called by the running fiber: lets the others run until the scheduler comes back to it.
  static void yield() {
    Fibers& self = *running;
    Fiber& f = self.fibers_[self.current_];
    ThreadContext* const own = current_thread;
    start_switch(&f.fake_stack, self.scheduler_bottom_, self.scheduler_size_);
    swapcontext(&f.context, &self.scheduler_);
    finish_switch(f.fake_stack, &self.scheduler_bottom_, &self.scheduler_size_);
    current_thread = own;
  }

  // Arrivals at barriers and ended fibers, for the deadlock check.
  static inline uint64_t progress = 0;

 private:
  static constexpr size_t kGuardBytes = 4096;       // below each stack, unmapped: an overflow faults
  static constexpr size_t kStackBytes = 256 << 10;  // the kernels' frames, -O0 and sanitizer redzones included

  struct Fiber {
    ucontext_t context{};
    void* mapping = nullptr;
    void* fake_stack = nullptr;  // ASan's, across a switch
    bool finished = false;
  };

  static void* stack_bottom(Fiber& f) { return static_cast<char*>(f.mapping) + kGuardBytes; }

  static void start() {
    Fibers& self = *running;
    finish_switch(nullptr, &self.scheduler_bottom_, &self.scheduler_size_);
    const size_t index = self.current_;
    try {
      self.entry_(index);
    } catch (const std::exception& e) {
      fail(std::string("an emulated thread threw: ") + e.what());
    }
    self.fibers_[index].finished = true;
    ++progress;
    start_switch(nullptr, self.scheduler_bottom_, self.scheduler_size_);  // this fiber's stack is done
    setcontext(&self.scheduler_);
  }

  // AddressSanitizer's fiber annotations (no-ops without it).
  static void start_switch(void** fake_stack, const void* bottom, size_t size) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#else
    (void)fake_stack, (void)bottom, (void)size;
#endif
  }
  static void finish_switch(void* fake_stack, const void** bottom, size_t* size) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_stack, bottom, size);
#else
    (void)fake_stack, (void)bottom, (void)size;
#endif
  }

  static void unpoison(void* bottom, size_t size) {
#if defined(__SANITIZE_ADDRESS__)
    __asan_unpoison_memory_region(bottom, size);
#else
    (void)bottom, (void)size;
#endif
  }

  static inline thread_local Fibers* running = nullptr;

  std::function<void(size_t)> entry_;
  std::vector<Fiber> fibers_;
  size_t current_ = 0;
  ucontext_t scheduler_{};
  const void* scheduler_bottom_ = nullptr;
  size_t scheduler_size_ = 0;
};

// A reusable barrier for a fixed number of threads. Each arrival names the barrier it is (block start,
// __syncthreads, warp shuffle, block end): threads of one phase that name different barriers have diverged, which on
// a GPU is undefined behaviour, so it is an error here.
class Barrier {
 public:
  explicit Barrier(unsigned count) : count_(count) {}

  void arrive_and_wait(const char* what) {
    if (phase_name_ == nullptr) {
      phase_name_ = what;
    } else if (phase_name_ != what) {
      fail(std::string("divergent barrier: some threads reached '") + phase_name_ + "', others '" + what + "'");
    }
    ++Fibers::progress;
    if (++arrived_ == count_) {
      arrived_ = 0;
      phase_name_ = nullptr;
      ++generation_;
      return;
    }
    for (const uint64_t generation = generation_; generation_ == generation;) Fibers::yield();
  }

  // Completed phases: an access after the n-th follows every access before it.
  uint64_t generation() const { return generation_; }

 private:
  const unsigned count_;
  unsigned arrived_ = 0;
  uint64_t generation_ = 0;
  const char* phase_name_ = nullptr;
};

struct Warp {
  Barrier barrier{kWarpSize};
  uint64_t lanes[kWarpSize] = {};
};

std::mutex launch_mutex;

constexpr uint64_t kSectorBytes = 32;
constexpr int kBanks = 32, kBankBytes = 4;
constexpr std::align_val_t kSharedAlignment{16};  // dynamic shared memory: __align__(16) in device.cuh
// H200 (the model's GPU): SMs and resident threads per SM, for the default
// number of blocks in flight.
constexpr int64_t kModelSms = 132, kModelThreadsPerSm = 2048;

struct Access {
  uintptr_t address;
  uint32_t bytes;
  bool store;
  Space space;
  Site site;
  // Bytes this thread accessed since it last touched this access's first
  // sector, or -1 if it never did in this block.
  int64_t reuse_distance;
};

// One emulated thread's accesses in the current block.
struct ThreadTrace {
  std::vector<Access> accesses;
  std::unordered_map<uint64_t, uint64_t> last_touch;  // sector -> `position` after touching it
  uint64_t position = 0;                              // bytes accessed so far
};

// Counters of one launch.
struct LaunchTraffic {
  uint64_t load_bytes = 0, store_bytes = 0, load_requests = 0, store_requests = 0;
  // Requests of a sector's worth of distinct bytes or more (the row and
  // parameter streams): their distinct bytes and the sectors they touch.
  uint64_t coalesced_bytes = 0, coalesced_sector_bytes = 0;
  uint64_t scalar_requests = 0;  // requests below a sector: per-row scalars, broadcasts
  uint64_t dram_read_bytes = 0, dram_write_bytes = 0;
  uint64_t shared_requests = 0, bank_conflicts = 0, barriers = 0;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;   // [begin, end) of every global access
  std::unordered_map<uint64_t, bool> sectors;            // every global sector touched -> dirty in L2
  std::vector<std::pair<uint64_t, uint64_t>> by_region;  // load and store bytes per region, then "other"
};

std::vector<Region> regions;  // sorted by begin

// The region an address falls in, or regions.size() for none.
size_t region_of(uintptr_t address) {
  auto it = std::upper_bound(regions.begin(), regions.end(), address,
                             [](uintptr_t a, const Region& r) { return a < r.begin; });
  if (it == regions.begin() || address >= std::prev(it)->end) return regions.size();
  return static_cast<size_t>(std::prev(it) - regions.begin());
}

bool counting = false;         // set between launches, under launch_mutex
std::atomic<uint64_t> occupancy_queries{0};  // since the last launch (count_occupancy_query)
double model_l2_bytes = 50e6;  // H200: 60 MB of L2, about 50 MB usable by one stream
int64_t model_concurrent_blocks = 0;
unsigned block_sample = 0;  // 0: run every block
std::vector<std::string> launch_log;

// The DRAM estimate, by sector. The first touch of a sector in a launch reads it
// from DRAM (a load) or leaves it dirty (a store; written back once at the end).
// A re-access by the same thread hits L2 unless the bytes the whole GPU touches
// in between exceed the L2: this thread's bytes in between x the threads of the
// block x the blocks in flight (every thread of every resident block streams at
// the same pace). A miss re-reads the sector (a load) and writes back the dirty
// copy it lost. A sector first touched by another thread (the parameters every
// row reads, a partial row another block wrote) is taken to be an L2 hit: such
// data is shared by the blocks in flight, so it stays hot.
void account_dram(LaunchTraffic& t, uint64_t sector, bool store, int64_t own_distance, double bytes_per_block_slot) {
  auto [it, first] = t.sectors.try_emplace(sector, false);
  bool& dirty = it->second;
  if (first) {
    if (!store) t.dram_read_bytes += kSectorBytes;
  } else if (own_distance >= 0 && own_distance * bytes_per_block_slot > model_l2_bytes) {
    if (dirty) t.dram_write_bytes += kSectorBytes;
    dirty = false;
    if (!store) t.dram_read_bytes += kSectorBytes;
  }
  if (store) dirty = true;
}

// One warp-wide request: the accesses of the lanes that made it.
void account_request(LaunchTraffic& t, const std::vector<const Access*>& lanes, double bytes_per_block_slot) {
  const Access& first = *lanes.front();
  for (const Access* a : lanes) {
    if (a->bytes != first.bytes || a->store != first.store) {
      fail(std::string("warp-divergent access sequence at ") + first.site.file + ":" + std::to_string(first.site.line) +
           ": lanes differ in width or direction");
    }
  }
  if (first.space == Space::Shared) {
    // Distinct 4-byte words per bank; a bank serves one word per cycle (the same word is a broadcast). Wide
    // accesses are served in phases of at most 128 bytes (kBanks words), as on the GPU: 8-byte ones a half-warp
    // at a time, 16-byte ones a quarter-warp, wider ones as several 16-byte accesses (LDS.128 each).
    const uint32_t piece = std::min<uint32_t>(first.bytes, 16);
    const size_t lanes_per_phase = std::max<size_t>(1, kBanks * kBankBytes / piece);
    t.shared_requests += 1;
    for (uint32_t offset = 0; offset < first.bytes; offset += piece) {
      for (size_t begin = 0; begin < lanes.size(); begin += lanes_per_phase) {
        std::vector<uintptr_t> words;
        for (size_t l = begin; l < std::min(lanes.size(), begin + lanes_per_phase); ++l) {
          const uintptr_t address = lanes[l]->address + offset;
          for (uintptr_t w = address / kBankBytes; w <= (address + piece - 1) / kBankBytes; ++w) words.push_back(w);
        }
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        int per_bank[kBanks] = {};
        for (uintptr_t w : words) ++per_bank[w % kBanks];
        t.bank_conflicts += *std::max_element(per_bank, per_bank + kBanks) - 1;
      }
    }
    return;
  }
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const Access* a : lanes) {
    (first.store ? t.store_bytes : t.load_bytes) += a->bytes;
    auto& region = t.by_region[region_of(a->address)];
    (first.store ? region.second : region.first) += a->bytes;
    ranges.emplace_back(a->address, a->address + a->bytes);
    t.ranges.emplace_back(a->address, a->address + a->bytes);
  }
  (first.store ? t.store_requests : t.load_requests) += 1;
  std::sort(ranges.begin(), ranges.end());
  uint64_t distinct = 0;
  uintptr_t covered = 0;
  for (auto [b, e] : ranges) {
    if (e > covered) distinct += e - std::max(b, covered), covered = e;
  }
  // Sectors of the request, each with the shortest own-thread reuse distance among the lanes touching it.
  std::unordered_map<uint64_t, int64_t> sectors;
  for (const Access* a : lanes) {
    for (uint64_t s = a->address / kSectorBytes; s <= (a->address + a->bytes - 1) / kSectorBytes; ++s) {
      auto [it, fresh] = sectors.try_emplace(s, a->reuse_distance);
      if (!fresh && a->reuse_distance >= 0 && (it->second < 0 || a->reuse_distance < it->second)) {
        it->second = a->reuse_distance;
      }
    }
  }
  if (distinct >= kSectorBytes) {
    t.coalesced_bytes += distinct;
    t.coalesced_sector_bytes += sectors.size() * kSectorBytes;
  } else {
    t.scalar_requests += 1;
  }
  for (auto [sector, distance] : sectors) account_dram(t, sector, first.store, distance, bytes_per_block_slot);
}

// A warp-wide request: the n-th access of the lanes from one source line.
struct RequestKey {
  const char* file;
  unsigned line;
  Space space;
  uint32_t occurrence;
  bool operator==(const RequestKey&) const = default;
};
struct RequestKeyHash {
  size_t operator()(const RequestKey& k) const {
    return std::hash<const void*>()(k.file) ^ (size_t{k.line} << 1) ^ (size_t(k.space) << 20) ^
           (size_t{k.occurrence} * 0x9E3779B97F4A7C15ull);
  }
};

std::string regions_json(const LaunchTraffic& t, double scale) {
  auto scaled = [scale](uint64_t v) { return std::to_string(static_cast<uint64_t>(std::llround(v * scale))); };
  std::string out;
  for (size_t i = 0; i < t.by_region.size(); ++i) {
    if (t.by_region[i].first + t.by_region[i].second == 0) continue;
    out += (out.empty() ? "\"" : ",\"") + (i < regions.size() ? regions[i].name : std::string("other")) + "\":[" +
           scaled(t.by_region[i].first) + "," + scaled(t.by_region[i].second) + "]";
  }
  return out;
}

std::string json_launch(const LaunchTraffic& t, const void* kernel, Dim3 grid, Dim3 block, size_t smem,
                        unsigned cluster, bool dependent, int64_t concurrent_blocks, double scale,
                        uint64_t occupancy_queries) {
  std::string name = "?";
  Dl_info info;
  if (dladdr(kernel, &info) != 0 && info.dli_sname != nullptr) name = info.dli_sname;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges = t.ranges;
  std::sort(ranges.begin(), ranges.end());
  uint64_t unique = 0;
  uintptr_t covered = 0;
  for (auto [b, e] : ranges) {
    if (e > covered) unique += e - std::max(b, covered), covered = e;
  }
  uint64_t dirty_at_end = 0;
  for (const auto& [sector, dirty] : t.sectors) dirty_at_end += dirty;
  auto field = [scale](const char* key, uint64_t v) {
    return std::string(",\"") + key + "\":" + std::to_string(static_cast<uint64_t>(std::llround(v * scale)));
  };
  const std::string shape = ",\"grid\":" + std::to_string(uint64_t{grid.x} * grid.y * grid.z) +
                            ",\"block_threads\":" + std::to_string(uint64_t{block.x} * block.y * block.z) +
                            ",\"dynamic_smem\":" + std::to_string(smem) + ",\"cluster\":" + std::to_string(cluster) +
                            ",\"dependent\":" + (dependent ? "true" : "false") +
                            ",\"occupancy_queries\":" + std::to_string(occupancy_queries);
  return std::string("{\"kernel\":\"") + name + "\"" + shape + field("load_bytes", t.load_bytes) +
         field("store_bytes", t.store_bytes) + field("load_requests", t.load_requests) +
         field("store_requests", t.store_requests) + field("coalesced_bytes", t.coalesced_bytes) +
         field("coalesced_sector_bytes", t.coalesced_sector_bytes) + field("scalar_requests", t.scalar_requests) +
         field("unique_bytes", unique) + field("dram_read_bytes", t.dram_read_bytes) +
         field("dram_write_bytes", t.dram_write_bytes + dirty_at_end * kSectorBytes) +
         field("shared_requests", t.shared_requests) + field("bank_conflicts", t.bank_conflicts) +
         field("barriers", t.barriers) + ",\"concurrent_blocks\":" + std::to_string(concurrent_blocks) +
         ",\"regions\":{" + regions_json(t, scale) + "}}";
}

}  // namespace

// The shared-memory race check (TORCH_LN_RACECHECK=1): each byte of shared memory remembers its last write and up to
// two reads since. An access by another thread that no barrier separates from a conflicting one (write after write,
// read after write, write after read) is a race: on a GPU its result would depend on the threads' timing. Accesses
// of one block are separated by a completed barrier of the block or of its cluster, accesses of different blocks of
// a cluster (distributed shared memory) by a completed cluster barrier, or by an mbarrier phase (below). Warp shuffles
// order nothing.
// An mbarrier phase orders what its arrivals and its stores' issuers did before them (the accesses of their blocks
// before their last block barrier, and what they knew so; an arriving thread's own accesses before its arrival too)
// before what its waiters do after their wait. Bytes an st.async stored are unwritten for every thread until it has
// waited for the phase they complete (only the issuer may overwrite them before). Conservative where an ordering runs
// through a block barrier after another thread's wait: the kernels have every thread wait.
struct SharedAccess {
  uint32_t rank = 0, tid = 0;  // block rank in the cluster, thread in the block
  uint64_t block_generation = 0, cluster_generation = 0;
  bool valid = false;
  const void* mbarrier = nullptr;  // an st.async's bytes: visible after a wait for phase `phase` of this mbarrier
  uint64_t phase = 0;
  bool copy_in_flight = false;  // a cp.async's bytes before the issuer's wait: off limits to every thread
  uint64_t epoch = 0;           // the accessing thread's mbarrier arrivals before it (ThreadOrder::arrivals)
};

// What a thread knows to be ordered before it through mbarriers: per block rank of the cluster, the block generation
// below which that block's accesses happen before it; per thread that arrived on a phase it waited for, the epoch
// below which that thread's accesses do; and per mbarrier the phases it has waited for. Its own arrivals so far: the
// epoch of its accesses now.
struct ThreadOrder {
  std::vector<uint64_t> known;                           // by rank
  std::unordered_map<uint64_t, uint64_t> arrived;        // thread_key(rank, tid) -> epoch bound
  std::vector<std::pair<const void*, uint64_t>> waited;  // mbarrier -> phases completed when it last waited
  uint64_t arrivals = 0;
};

// An mbarrier's state: the arrivals a phase expects and those still pending, the bytes still to land (negative where
// stores came before the arrival that expects them), the phases completed, and the knowledge (ThreadOrder::known) its
// current phase gathers and the last two phases passed on.
struct Mbarrier {
  unsigned arrivals = 0, pending = 0;
  int64_t bytes_pending = 0;
  uint64_t completed = 0;
  std::vector<uint64_t> gathering, passed[2];
  std::unordered_map<uint64_t, uint64_t> gathering_arrived, passed_arrived[2];  // ThreadOrder::arrived's
};
struct ByteShadow {
  SharedAccess write, reads[2];
};

// A thread's cp.async copies not yet waited for: the open group's [address, bytes) ranges, then the closed groups',
// oldest first.
struct AsyncCopies {
  using Ranges = std::vector<std::pair<uintptr_t, size_t>>;
  Ranges open;
  std::vector<Ranges> closed;
};

const bool racecheck = [] {
  const char* on = std::getenv("TORCH_LN_RACECHECK");
  return on != nullptr && std::string(on) != "0";
}();
std::unordered_map<uintptr_t, ByteShadow> static_shadow;  // static shared arrays (TLN_STATIC_SHARED), per launch

class BlockState {
 public:
  BlockState(unsigned threads, size_t smem_bytes)
      : barrier(threads),
        warps(threads / kWarpSize),
        smem(smem_bytes > 0 ? static_cast<unsigned char*>(::operator new(smem_bytes, kSharedAlignment)) : nullptr),
        smem_bytes(smem_bytes),
        traces(threads),
        orders(threads),
        copies(threads) {}

  // Groups each warp's accesses into requests and counts them; clears the traces.
  void account(LaunchTraffic& t, double bytes_per_block_slot) {
    t.barriers += syncs;
    syncs = 0;
    for (size_t w = 0; w < warps.size(); ++w) {
      std::unordered_map<RequestKey, size_t, RequestKeyHash> index;  // -> position in `requests`
      std::vector<std::vector<const Access*>> requests;
      for (unsigned lane = 0; lane < kWarpSize; ++lane) {
        std::unordered_map<RequestKey, uint32_t, RequestKeyHash> occurrences;
        for (const Access& a : traces[w * kWarpSize + lane].accesses) {
          RequestKey key{a.site.file, a.site.line, a.space, 0};
          key.occurrence = occurrences[key]++;
          auto [it, fresh] = index.try_emplace(key, requests.size());
          if (fresh) requests.emplace_back();
          requests[it->second].push_back(&a);
        }
      }
      for (const auto& lanes : requests) account_request(t, lanes, bytes_per_block_slot);
    }
    for (ThreadTrace& trace : traces) trace = ThreadTrace{};
  }

  Barrier barrier;
  std::vector<Warp> warps;
  // Exactly the launch's bytes (ASan catches an access past them), 16-byte aligned as the kernels declare it.
  struct AlignedDelete {
    void operator()(unsigned char* p) const { ::operator delete(p, kSharedAlignment); }
  };
  std::unique_ptr<unsigned char, AlignedDelete> smem;
  size_t smem_bytes;
  std::vector<ThreadTrace> traces;
  uint64_t syncs = 0;              // __syncthreads of the current block
  std::vector<ByteShadow> shadow;  // the race check's record of each dynamic shared byte (allocated on first use)
  std::unordered_map<uintptr_t, Mbarrier> mbarriers;  // by address, those the current block set up
  std::vector<ThreadOrder> orders;                    // by thread: the race check's mbarrier orderings
  std::vector<AsyncCopies> copies;                    // by thread: its cp.async copies in flight
};

// The blocks of one cluster, run together: their states and the barrier over all their threads (a launch without
// clusters runs clusters of one block).
class ClusterState {
 public:
  ClusterState(unsigned size, unsigned threads, size_t smem_bytes) : barrier(size * threads) {
    for (unsigned b = 0; b < size; ++b) blocks.push_back(std::make_unique<BlockState>(threads, smem_bytes));
  }

  Barrier barrier;
  std::vector<std::unique_ptr<BlockState>> blocks;
};

ThreadContext& this_thread() {
  if (current_thread == nullptr) fail("a device function ran outside an emulated kernel");
  return *current_thread;
}

namespace {

uint64_t block_generation(const ThreadContext& t) { return t.block->barrier.generation(); }

// The block of the calling thread's cluster whose dynamic shared memory holds [address, address + bytes), or null.
BlockState* owner_of(const ThreadContext& t, uintptr_t address, size_t bytes) {
  for (const auto& block : t.cluster->blocks) {
    const auto base = reinterpret_cast<uintptr_t>(block->smem.get());
    if (address >= base && address + bytes <= base + block->smem_bytes) return block.get();
  }
  return nullptr;
}

ThreadOrder& order_of(const ThreadContext& t) { return t.block->orders[t.linear_tid]; }

uint64_t thread_key(uint32_t rank, uint32_t tid) { return uint64_t{rank} << 32 | tid; }

// The calling thread's record of the phases of `mbarrier` completed when it last waited on it, or null.
uint64_t* find_waited(const ThreadContext& t, const void* mbarrier) {
  for (auto& [bar, phases] : order_of(t).waited) {
    if (bar == mbarrier) return &phases;
  }
  return nullptr;
}

uint64_t waited_phases(const ThreadContext& t, const void* mbarrier) {
  const uint64_t* phases = find_waited(t, mbarrier);
  return phases != nullptr ? *phases : 0;
}

// Whether `a` is absent, the calling thread's own, or ordered before the calling thread's access (a `store` or not).
bool before_barrier(const SharedAccess& a, const ThreadContext& t, bool store = false) {
  if (!a.valid) return true;
  const bool own = a.rank == t.cluster_rank && a.tid == t.linear_tid;
  if (a.mbarrier != nullptr) return waited_phases(t, a.mbarrier) > a.phase || (own && store);
  if (own || t.cluster->barrier.generation() != a.cluster_generation) return true;
  const ThreadOrder& order = order_of(t);
  const auto arrived = order.arrived.find(thread_key(a.rank, a.tid));
  if (arrived != order.arrived.end() && arrived->second > a.epoch) return true;
  if (a.rank == t.cluster_rank) return block_generation(t) != a.block_generation;
  const std::vector<uint64_t>& known = order.known;
  return a.rank < known.size() && known[a.rank] > a.block_generation;
}

// "file:line, thread T of block rank R": the calling thread's access at `site`.
std::string where(const ThreadContext& t, Site site) {
  return std::string(site.file) + ":" + std::to_string(site.line) + ", thread " + std::to_string(t.linear_tid) +
         " of block rank " + std::to_string(t.cluster_rank);
}

// Keeps the launch's first few distinct races.
void report_race(std::string message) {
  if (races.size() < 4 && std::find(races.begin(), races.end(), message) == races.end()) {
    races.push_back(std::move(message));
  }
}

// The calling thread's access now. `mbarrier`, `phase`: an st.async's store, completing that phase; `in_flight`: a
// cp.async's store, before its wait.
SharedAccess access_now(const ThreadContext& t, const void* mbarrier = nullptr, uint64_t phase = 0,
                        bool in_flight = false) {
  return {t.cluster_rank, t.linear_tid, block_generation(t), t.cluster->barrier.generation(), true, mbarrier,
          phase,          in_flight,    order_of(t).arrivals};
}

void check_byte(ByteShadow& byte, const ThreadContext& t, bool store, Site site, const SharedAccess& now) {
  auto race = [&](const char* kind, const SharedAccess& other) {
    report_race(std::string(kind) + " at " + where(t, site) + " after thread " + std::to_string(other.tid) +
                " of block rank " + std::to_string(other.rank));
  };
  if (byte.write.copy_in_flight) {
    race(store ? "write before the wait for a cp.async" : "read before the wait for a cp.async", byte.write);
  } else if (!before_barrier(byte.write, t, store)) {
    race(store ? "write after write" : "read after write", byte.write);
  }
  if (store) {
    for (const SharedAccess& read : byte.reads) {
      if (!before_barrier(read, t, store)) race("write after read", read);
    }
    byte = ByteShadow{now, {}};
    return;
  }
  // Kept: two reads no barrier has ordered yet, which a later write by a third thread races with.
  for (SharedAccess& read : byte.reads) {
    if (before_barrier(read, t)) {
      read = now;
      return;
    }
  }
}

// The race check's record of byte `i` of [address, address + bytes): in the dynamic shared memory of the calling
// thread's block or of a cluster peer, else in a static shared array.
class ShadowBytes {
 public:
  ShadowBytes(const ThreadContext& t, uintptr_t address, size_t bytes) : address_(address) {
    if (BlockState* block = owner_of(t, address, bytes)) {
      if (block->shadow.empty()) block->shadow.resize(block->smem_bytes);
      dynamic_ = &block->shadow[address - reinterpret_cast<uintptr_t>(block->smem.get())];
    }
  }
  ByteShadow& operator[](size_t i) const { return dynamic_ != nullptr ? dynamic_[i] : static_shadow[address_ + i]; }

 private:
  uintptr_t address_;
  ByteShadow* dynamic_ = nullptr;
};

void check_shared_access(const ThreadContext& t, uintptr_t address, size_t bytes, bool store, Site site,
                         const SharedAccess& now) {
  const ShadowBytes shadow(t, address, bytes);
  for (size_t i = 0; i < bytes; ++i) check_byte(shadow[i], t, store, site, now);
}

}  // namespace

bool racecheck_enabled() { return racecheck; }

void sync_threads() {
  ThreadContext& t = this_thread();
  if (counting && t.linear_tid == 0) ++t.block->syncs;
  t.block->barrier.arrive_and_wait("__syncthreads");
}

void cluster_sync() {
  ThreadContext& t = this_thread();
  if (counting && t.linear_tid == 0) ++t.block->syncs;
  t.cluster->barrier.arrive_and_wait("cluster barrier");
}

const void* map_shared_rank(const void* p, unsigned rank) {
  ThreadContext& t = this_thread();
  if (rank >= t.cluster->blocks.size()) {
    fail("map_shared_rank: rank " + std::to_string(rank) + " in a cluster of " +
         std::to_string(t.cluster->blocks.size()) + " blocks");
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.block->smem.get());
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  if (address < base || address >= base + t.block->smem_bytes) {
    fail("map_shared_rank: the address is not in the block's dynamic shared memory");
  }
  return t.cluster->blocks[rank]->smem.get() + (address - base);
}

namespace {

constexpr size_t kMbarrierBytes = 8;
constexpr size_t kBulkAlignment = 16;  // cp.async.bulk's addresses and sizes
constexpr size_t kBulkLineBytes = 128;

// The mbarrier at `bar` in `owner`'s shared memory (null: whichever block of the calling thread's cluster holds it).
Mbarrier& mbarrier_at(const ThreadContext& t, const void* bar, BlockState* owner = nullptr) {
  const auto address = reinterpret_cast<uintptr_t>(bar);
  if (owner == nullptr) owner = owner_of(t, address, kMbarrierBytes);
  if (owner == nullptr) fail("an mbarrier outside the cluster's dynamic shared memory");
  auto it = owner->mbarriers.find(address);
  if (it == owner->mbarriers.end()) fail("an mbarrier used before mbarrier_init");
  return it->second;
}

// What the calling thread passes on to the current phase of `m`: what it knows, and that its block's accesses before
// its last block barrier come before it.
void pass_on(const ThreadContext& t, Mbarrier& m) {
  m.gathering.resize(t.cluster->blocks.size(), 0);
  const std::vector<uint64_t>& known = order_of(t).known;
  for (size_t r = 0; r < known.size(); ++r) m.gathering[r] = std::max(m.gathering[r], known[r]);
  m.gathering[t.cluster_rank] = std::max(m.gathering[t.cluster_rank], block_generation(t));
}

// An arrival of the calling thread on the current phase of `m`: what it passes on, its own accesses so far among it
// (those of a lower epoch than its accesses after it).
void arrive(const ThreadContext& t, Mbarrier& m) {
  if (racecheck) {  // only the race check reads the ordering
    pass_on(t, m);
    m.gathering_arrived[thread_key(t.cluster_rank, t.linear_tid)] = ++order_of(t).arrivals;
  }
  --m.pending;
}

// Counts an arrival or a store as progress, and completes the phase where nothing is pending.
void complete_if_done(Mbarrier& m) {
  ++Fibers::progress;
  if (m.pending > 0 || m.bytes_pending > 0) return;
  if (m.bytes_pending < 0) fail("an mbarrier phase got more bytes than its arrivals expect");
  m.passed[m.completed & 1] = std::move(m.gathering);
  m.gathering.clear();
  m.passed_arrived[m.completed & 1] = std::move(m.gathering_arrived);
  m.gathering_arrived.clear();
  ++m.completed;
  m.pending = m.arrivals;
}

}  // namespace

void record_access(Space space, const void* address, size_t bytes, bool store, Site site) {
  if (space == Space::Global && this_thread().awaiting_prior_grid) {
    fail(std::string("a dependent launch touched global memory before wait_for_prior_grid at ") + site.file + ":" +
         std::to_string(site.line));
  }
  if (racecheck && space == Space::Shared) {
    check_shared_access(this_thread(), reinterpret_cast<uintptr_t>(address), bytes, store, site,
                        access_now(this_thread()));
  }
  if (!counting) return;
  ThreadContext& t = this_thread();
  ThreadTrace& trace = t.block->traces[t.linear_tid];
  const auto a = reinterpret_cast<uintptr_t>(address);
  int64_t distance = -1;
  if (space == Space::Global) {
    trace.position += bytes;
    const uint64_t sector = a / kSectorBytes;
    auto [it, fresh] = trace.last_touch.try_emplace(sector, trace.position);
    if (!fresh) distance = static_cast<int64_t>(trace.position - it->second);
    it->second = trace.position;
  }
  trace.accesses.push_back({a, static_cast<uint32_t>(bytes), store, space, site, distance});
}

void mbarrier_init(void* bar, unsigned arrivals, Site site) {
  ThreadContext& t = this_thread();
  const auto address = reinterpret_cast<uintptr_t>(bar);
  if (owner_of(t, address, kMbarrierBytes) != t.block) fail("mbarrier_init: not in the block's dynamic shared memory");
  if (arrivals == 0) fail("mbarrier_init: a phase needs at least one arrival");
  if (racecheck) check_shared_access(t, address, kMbarrierBytes, true, site, access_now(t));
  Mbarrier& m = t.block->mbarriers[address];
  m = Mbarrier{};
  m.arrivals = m.pending = arrivals;
}

void mbarrier_arrive_expect_tx(void* bar, unsigned bytes, Site site) {
  ThreadContext& t = this_thread();
  Mbarrier& m = mbarrier_at(t, bar);
  if (racecheck) check_shared_access(t, reinterpret_cast<uintptr_t>(bar), kMbarrierBytes, false, site, access_now(t));
  arrive(t, m);
  m.bytes_pending += bytes;
  complete_if_done(m);
}

void mbarrier_arrive(void* bar, Site site) {
  ThreadContext& t = this_thread();
  Mbarrier& m = mbarrier_at(t, bar);
  if (racecheck) check_shared_access(t, reinterpret_cast<uintptr_t>(bar), kMbarrierBytes, false, site, access_now(t));
  arrive(t, m);
  complete_if_done(m);
}

void mbarrier_wait(void* bar, unsigned parity, Site site) {
  ThreadContext& t = this_thread();
  Mbarrier& m = mbarrier_at(t, bar);  // stays put: the map's elements never move
  if (racecheck) check_shared_access(t, reinterpret_cast<uintptr_t>(bar), kMbarrierBytes, false, site, access_now(t));
  // The phase waited for: the first of that parity the thread has not waited for (the kernels' threads wait for every
  // phase of the mbarriers they use). Where later phases completed before the wait, a parity wait cannot tell them
  // apart (on a GPU it returns for the wrong phase or hangs): the producer ran two phases ahead of this reader.
  uint64_t* waited = find_waited(t, bar);  // stays put: only this thread adds to its record, below
  const uint64_t seen = waited != nullptr ? *waited : 0;
  const uint64_t phase = seen + ((seen & 1) != (parity & 1));
  while ((m.completed & 1) == (parity & 1)) Fibers::yield();
  if (racecheck && m.completed != phase + 1) {
    report_race("mbarrier phase " + std::to_string(phase) + " overtaken at " + where(t, site) + ": " +
                std::to_string(m.completed) + " phases had completed when it waited for it");
  }
  if (racecheck) {
    ThreadOrder& order = order_of(t);
    const std::vector<uint64_t>& passed = m.passed[phase & 1];
    order.known.resize(std::max(order.known.size(), passed.size()), 0);
    for (size_t r = 0; r < passed.size(); ++r) order.known[r] = std::max(order.known[r], passed[r]);
    for (const auto& [thread, epoch] : m.passed_arrived[phase & 1]) {
      uint64_t& bound = order.arrived[thread];
      bound = std::max(bound, epoch);
    }
  }
  if (waited != nullptr) {
    *waited = phase + 1;
  } else {
    order_of(t).waited.emplace_back(bar, phase + 1);
  }
}

namespace {

// An asynchronous copy of `bytes` from `src` into `dst`, in the shared memory of `owner`, completing that many bytes
// on its mbarrier `bar`: the bytes land at once, unwritten for the race check until a wait for their phase.
void copy_completing(const ThreadContext& t, BlockState* owner, void* dst, const void* src, size_t bytes, void* bar,
                     Site site) {
  Mbarrier& m = mbarrier_at(t, bar, owner);
  if (racecheck) {
    check_shared_access(t, reinterpret_cast<uintptr_t>(bar), kMbarrierBytes, false, site, access_now(t));
    check_shared_access(t, reinterpret_cast<uintptr_t>(dst), bytes, true, site, access_now(t, bar, m.completed));
    pass_on(t, m);
  }
  std::memcpy(dst, src, bytes);
  m.bytes_pending -= static_cast<int64_t>(bytes);
  complete_if_done(m);
}

}  // namespace

void store_async(void* dst, const void* src, size_t bytes, unsigned rank, void* bar, Site site) {
  ThreadContext& t = this_thread();
  void* remote = const_cast<void*>(map_shared_rank(dst, rank));
  void* remote_bar = const_cast<void*>(map_shared_rank(bar, rank));
  copy_completing(t, t.cluster->blocks[rank].get(), remote, src, bytes, remote_bar, site);
}

void bulk_load_shared(void* dst, const void* src, size_t bytes, void* bar, Site site) {
  ThreadContext& t = this_thread();
  const auto to = reinterpret_cast<uintptr_t>(dst), from = reinterpret_cast<uintptr_t>(src);
  if (to % kBulkAlignment != 0 || from % kBulkAlignment != 0 || bytes == 0 || bytes % kBulkAlignment != 0) {
    fail("bulk_load_shared: addresses and size must be non-zero multiples of 16 bytes; got dst % 16 = " +
         std::to_string(to % kBulkAlignment) + ", src % 16 = " + std::to_string(from % kBulkAlignment) + ", " +
         std::to_string(bytes) + " bytes");
  }
  if (owner_of(t, to, bytes) != t.block) fail("bulk_load_shared: dst is not in the block's dynamic shared memory");
  // The global reads, a 128-byte line at a time (the copy engine's requests), as the issuing thread's.
  for (size_t offset = 0; offset < bytes; offset += kBulkLineBytes) {
    record_access(Space::Global, static_cast<const unsigned char*>(src) + offset,
                  std::min(kBulkLineBytes, bytes - offset), false, site);
  }
  copy_completing(t, t.block, dst, src, bytes, bar, site);
}

void copy_async(void* dst, const void* src, size_t bytes, Site site) {
  ThreadContext& t = this_thread();
  const auto to = reinterpret_cast<uintptr_t>(dst), from = reinterpret_cast<uintptr_t>(src);
  if ((bytes != 4 && bytes != 8 && bytes != 16) || to % bytes != 0 || from % bytes != 0) {
    fail("copy_async: 4, 8 or 16 bytes at addresses aligned to them; got " + std::to_string(bytes) +
         " bytes, dst % 16 = " + std::to_string(to % 16) + ", src % 16 = " + std::to_string(from % 16));
  }
  if (owner_of(t, to, bytes) != t.block) fail("copy_async: dst is not in the block's dynamic shared memory");
  record_access(Space::Global, src, bytes, false, site);
  std::memcpy(dst, src, bytes);
  if (racecheck) check_shared_access(t, to, bytes, true, site, access_now(t, nullptr, 0, true));
  t.block->copies[t.linear_tid].open.emplace_back(to, bytes);
}

void copy_async_commit() {
  ThreadContext& t = this_thread();
  AsyncCopies& copies = t.block->copies[t.linear_tid];
  copies.closed.push_back(std::move(copies.open));
  copies.open.clear();
}

void copy_async_wait(unsigned pending, Site site) {
  ThreadContext& t = this_thread();
  AsyncCopies& copies = t.block->copies[t.linear_tid];
  const size_t done = copies.closed.size() > pending ? copies.closed.size() - pending : 0;
  if (racecheck) {  // the waited copies' bytes: the issuer's stores, made now (any access since the copy was a race)
    for (size_t g = 0; g < done; ++g) {
      for (const auto& [address, bytes] : copies.closed[g]) {
        const ShadowBytes shadow(t, address, bytes);
        for (size_t i = 0; i < bytes; ++i) shadow[i] = ByteShadow{access_now(t), {}};
      }
    }
  }
  copies.closed.erase(copies.closed.begin(), copies.closed.begin() + static_cast<std::ptrdiff_t>(done));
}

void count_occupancy_query() { occupancy_queries.fetch_add(1, std::memory_order_relaxed); }

void set_counting(bool on) {
  const std::lock_guard<std::mutex> serialize(launch_mutex);
  counting = on;
}

void set_l2_model(double l2_bytes, int64_t concurrent_blocks) {
  const std::lock_guard<std::mutex> serialize(launch_mutex);
  model_l2_bytes = l2_bytes;
  model_concurrent_blocks = concurrent_blocks;
}

void set_block_sample(unsigned blocks) {
  const std::lock_guard<std::mutex> serialize(launch_mutex);
  block_sample = blocks;
}

void set_regions(std::vector<Region> named) {
  const std::lock_guard<std::mutex> serialize(launch_mutex);
  std::sort(named.begin(), named.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
  regions = std::move(named);
}

std::string take_launch_log() {
  const std::lock_guard<std::mutex> serialize(launch_mutex);
  std::string out = "[";
  for (size_t i = 0; i < launch_log.size(); ++i) out += (i ? ",\n" : "") + launch_log[i];
  launch_log.clear();
  return out + "]";
}

uint64_t warp_exchange(uint64_t value, unsigned src_lane) {
  ThreadContext& t = this_thread();
  Warp& warp = t.block->warps[t.linear_tid / kWarpSize];
  warp.lanes[t.linear_tid % kWarpSize] = value;
  warp.barrier.arrive_and_wait("warp shuffle (publish)");
  const uint64_t received = warp.lanes[src_lane % kWarpSize];
  warp.barrier.arrive_and_wait("warp shuffle (read)");
  return received;
}

unsigned char* dynamic_shared_memory() { return this_thread().block->smem.get(); }

void wait_for_prior_grid() { this_thread().awaiting_prior_grid = false; }

void launch(Dim3 grid, Dim3 block, size_t dynamic_smem_bytes, const void* kernel, const std::function<void()>& body,
            unsigned cluster, bool dependent) {
  const unsigned threads = block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || threads % kWarpSize != 0) {
    throw std::invalid_argument("SIMT emulator: a block needs a multiple of 32 threads, at most 1024; got " +
                                std::to_string(threads));
  }
  if (cluster == 0 || grid.x % cluster != 0) {
    throw std::invalid_argument("SIMT emulator: grid.x must be a multiple of the cluster size; got grid.x " +
                                std::to_string(grid.x) + ", cluster " + std::to_string(cluster));
  }
  const std::lock_guard<std::mutex> serialize(launch_mutex);
  const uint64_t queries = occupancy_queries.exchange(0, std::memory_order_relaxed);
  ClusterState state(cluster, threads, dynamic_smem_bytes);
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  const int64_t concurrent_blocks =
      model_concurrent_blocks > 0
          ? model_concurrent_blocks
          : std::min<int64_t>(blocks, kModelSms * std::max<int64_t>(1, kModelThreadsPerSm / threads));
  // Global bytes per byte one thread accesses, across the GPU (see account_dram).
  const double bytes_per_block_slot = static_cast<double>(threads) * concurrent_blocks;
  // With sampling on, only the first blocks of each grid row run (whole clusters), and the counters are scaled to
  // the whole grid.
  const unsigned sampled_x =
      block_sample > 0 ? std::min<unsigned>(grid.x, (block_sample + cluster - 1) / cluster * cluster) : grid.x;
  LaunchTraffic traffic;
  traffic.by_region.resize(regions.size() + 1);

  // Thread `tid` of the block of rank `rank` in each cluster, the clusters one after another.
  auto run_thread = [&](unsigned rank, unsigned tid) {
    BlockState& own = *state.blocks[rank];
    ThreadContext ctx{{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)},
                      {},
                      block,
                      grid,
                      &own,
                      tid,
                      &state,
                      rank,
                      false};
    current_thread = &ctx;
    for (uint64_t b = rank; b < blocks; b += cluster) {
      if (b % grid.x >= sampled_x) continue;  // the same for every block of the cluster
      ctx.block_idx = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                       static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y))};
      // Shared memory is uninitialized on a GPU: poison it for each block.
      if (tid == 0 && own.smem) std::memset(own.smem.get(), 0xFF, own.smem_bytes);
      if (tid == 0) own.mbarriers.clear();
      own.orders[tid] = ThreadOrder{};
      own.copies[tid] = AsyncCopies{};
      ctx.awaiting_prior_grid = dependent;  // every block of a dependent launch waits for itself
      state.barrier.arrive_and_wait("block start");
      body();
      const AsyncCopies& copies = own.copies[tid];
      if (!copies.open.empty() || std::any_of(copies.closed.begin(), copies.closed.end(),
                                              [](const AsyncCopies::Ranges& group) { return !group.empty(); })) {
        fail("thread " + std::to_string(tid) + " ended its block with cp.async copies it never waited for");
      }
      state.barrier.arrive_and_wait("block end");
      // The other threads wait at the next block start (or the join) meanwhile.
      if (rank == 0 && tid == 0 && counting) {
        for (auto& each : state.blocks) each->account(traffic, bytes_per_block_slot);
      }
    }
    current_thread = nullptr;
  };

  races.clear();
  static_shadow.clear();
  Fibers(size_t{cluster} * threads, [&](size_t i) { run_thread(i / threads, i % threads); }).run();
  if (!races.empty()) {
    std::string message = "SIMT emulator: shared-memory race (TORCH_LN_RACECHECK)";
    for (const std::string& race : races) message += "\n  " + race;
    races.clear();
    throw std::runtime_error(message);
  }
  if (counting)
    launch_log.push_back(json_launch(traffic, kernel, grid, block, dynamic_smem_bytes, cluster, dependent,
                                     concurrent_blocks, static_cast<double>(grid.x) / sampled_x, queries));
}

}  // namespace torch_ln::emu
