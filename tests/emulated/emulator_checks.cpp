// Small launches that check the SIMT emulator itself (tests/emulated/test_emulator.py): argv[1] picks one.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "simt_emulator.h"

using namespace torch_ln::emu;

int main(int argc, char** argv) {
  const char* check = argc > 1 ? argv[1] : "";
  if (std::strcmp(check, "dependent") == 0 || std::strcmp(check, "dependent_waits") == 0) {
    // A dependent launch (programmatic dependent launch) reads global memory, after wait_for_prior_grid or not.
    const bool waits = std::strcmp(check, "dependent_waits") == 0;
    static int prior_output = 7;
    const auto read = [&] {
      if (waits) wait_for_prior_grid();
      record_access(Space::Global, &prior_output, sizeof(prior_output), false, {__FILE__, __LINE__});
    };
    launch({2}, {32}, 0, nullptr, read, 1, true);
    std::printf("read\n");
    return 0;
  }
  if (std::strcmp(check, "race") == 0 || std::strcmp(check, "race_synced") == 0) {
    // Thread 40 reads what thread 3 wrote to shared memory, with a barrier between or not (TORCH_LN_RACECHECK=1).
    const bool synced = std::strcmp(check, "race_synced") == 0;
    const auto exchange = [&] {
      auto* word = reinterpret_cast<int*>(dynamic_shared_memory());
      const unsigned tid = this_thread().linear_tid;
      if (tid == 3) record_access(Space::Shared, word, sizeof(int), true, {__FILE__, __LINE__});
      if (synced) sync_threads();
      if (tid == 40) record_access(Space::Shared, word, sizeof(int), false, {__FILE__, __LINE__});
    };
    try {
      launch({1}, {64}, sizeof(int), nullptr, exchange);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    std::printf("no race\n");
    return 0;
  }
  if (std::strncmp(check, "exchange", 8) == 0) {
    // The blocks of each cluster add their values as ClusterReduce2 (csrc/cuda/reduce.cuh) does, round after round:
    // thread 0 of every block stores the block's value by st.async into slot `rank` of every block's current half of
    // the slots, completing on that block's mbarrier of the half; every thread waits on its own, then adds the slots
    // in rank order. The variants break it: "exchange_early_read" reads before its wait, "exchange_unsynced_init"
    // stores into peers with no cluster barrier after their mbarrier_init, "exchange_one_slot" reuses one half every
    // round (a fast block's next store may land before a slow thread's read), "exchange_short" expects a byte that
    // never comes (its wait would hang).
    constexpr unsigned kCluster = 4, kRounds = 5;
    struct Exchange {
      uint64_t arrived[2];
      long values[2][kCluster];
    };
    const bool early = std::strcmp(check, "exchange_early_read") == 0;
    const bool unsynced = std::strcmp(check, "exchange_unsynced_init") == 0;
    const bool one_slot = std::strcmp(check, "exchange_one_slot") == 0;
    const unsigned extra_byte = std::strcmp(check, "exchange_short") == 0 ? 1 : 0;
    long total = 0;
    const auto body = [&] {
      auto* exchange = reinterpret_cast<Exchange*>(dynamic_shared_memory());
      const ThreadContext& t = this_thread();
      const Site site{__FILE__, __LINE__};
      if (t.linear_tid == 0) {
        for (uint64_t& arrived : exchange->arrived) mbarrier_init(&arrived, 1, site);
      }
      if (!unsynced) cluster_sync();
      for (unsigned round = 0; round < kRounds; ++round) {
        const unsigned half = one_slot ? 0 : round & 1;
        const unsigned parity = (one_slot ? round : round / 2) & 1;
        uint64_t* arrived = &exchange->arrived[half];
        if (t.linear_tid == 0) {
          mbarrier_arrive_expect_tx(arrived, kCluster * sizeof(long) + extra_byte, site);
          const long value = 1000 * round + 10 * t.block_idx.x + t.cluster_rank;
          for (unsigned rank = 0; rank < kCluster; ++rank) {
            store_async(&exchange->values[half][t.cluster_rank], &value, sizeof(value), rank, arrived, site);
          }
        }
        if (!early) mbarrier_wait(arrived, parity, site);
        long sum = 0;
        for (const long& value : exchange->values[half]) {
          record_access(Space::Shared, &value, sizeof(value), false, site);
          sum += value;
        }
        if (early) mbarrier_wait(arrived, parity, site);
        if (t.linear_tid == 33) total += sum;
        sync_threads();  // as the in-block reduction before each exchange does
      }
    };
    try {
      launch({8}, {64}, sizeof(Exchange), nullptr, body, kCluster);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    std::printf("total %ld\n", total);
    return 0;
  }
  if (std::strncmp(check, "bulk", 4) == 0) {
    // A ring of two stages streams chunks of global memory through shared memory as the shared-memory kernels' bulk
    // loads do (SliceRing, csrc/cuda/shared_vectors.cuh): thread 0 copies chunk i into stage i % 2 by
    // bulk_load_shared, completing on the stage's mbarrier; every thread waits for it (parity (i / 2) % 2) and adds
    // it; a block barrier after the reads frees the stage for chunk i + 2, or ("bulk_empty") every thread arrives on
    // the stage's second mbarrier after its reads and thread 0 waits for that phase before the refill. The variants
    // break it: "bulk_early_read" reads before its wait, "bulk_no_release" refills a stage with no barrier after the
    // reads of it, "bulk_empty_early" arrives before its reads, "bulk_misaligned" copies from an address off 16 bytes.
    constexpr unsigned kChunks = 6, kValues = 4, kThreads = 64;
    struct Ring {
      uint64_t full[2], empty[2];
      long stage[2][kValues];
    };
    alignas(16) static long data[kChunks * kValues + 1];
    for (unsigned i = 0; i < kChunks * kValues; ++i) data[i] = i + 1;
    const bool early = std::strcmp(check, "bulk_early_read") == 0;
    const bool no_release = std::strcmp(check, "bulk_no_release") == 0;
    const bool early_arrival = std::strcmp(check, "bulk_empty_early") == 0;
    const bool empty = early_arrival || std::strcmp(check, "bulk_empty") == 0;
    const unsigned offset = std::strcmp(check, "bulk_misaligned") == 0 ? 1 : 0;
    long total = 0;
    const auto body = [&] {
      auto* ring = reinterpret_cast<Ring*>(dynamic_shared_memory());
      const ThreadContext& t = this_thread();
      const Site site{__FILE__, __LINE__};
      const auto issue = [&](unsigned i) {
        uint64_t* full = &ring->full[i % 2];
        mbarrier_arrive_expect_tx(full, sizeof(ring->stage[0]), site);
        bulk_load_shared(ring->stage[i % 2], data + i * kValues + offset, sizeof(ring->stage[0]), full, site);
      };
      if (t.linear_tid == 0) {
        for (uint64_t& full : ring->full) mbarrier_init(&full, 1, site);
        for (uint64_t& stage_empty : ring->empty) mbarrier_init(&stage_empty, kThreads, site);
        issue(0);
        issue(1);
      }
      sync_threads();
      for (unsigned i = 0; i < kChunks; ++i) {
        const unsigned parity = (i / 2) % 2;
        if (!early) mbarrier_wait(&ring->full[i % 2], parity, site);
        if (early_arrival) mbarrier_arrive(&ring->empty[i % 2], site);
        long sum = 0;
        for (const long& value : ring->stage[i % 2]) {
          record_access(Space::Shared, &value, sizeof(value), false, site);
          sum += value;
        }
        if (early) mbarrier_wait(&ring->full[i % 2], parity, site);
        if (t.linear_tid == 33) total += sum;
        if (empty) {
          if (!early_arrival) mbarrier_arrive(&ring->empty[i % 2], site);
          if (t.linear_tid == 0) mbarrier_wait(&ring->empty[i % 2], parity, site);
        } else if (!no_release) {
          sync_threads();
        }
        if (t.linear_tid == 0 && i + 2 < kChunks) issue(i + 2);
      }
    };
    try {
      launch({3}, {kThreads}, sizeof(Ring), nullptr, body);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    std::printf("total %ld\n", total);
    return 0;
  }
  if (std::strncmp(check, "copy", 4) == 0) {
    // Each thread streams its own 16 bytes of every chunk through a two-stage ring of its own slots by cp.async, as
    // the register backward prefetches its next tile (csrc/cuda/backward.cuh): chunk i + 1 copied into stage
    // (i + 1) % 2 as one group, then a wait for all but that group, then chunk i read. Variants: "copy_early_read"
    // reads before the wait, "copy_neighbour" reads the next thread's slot (no barrier), "copy_unwaited" leaves the
    // last group in flight, "copy_misaligned" copies from off 16 bytes.
    constexpr unsigned kChunks = 5, kThreads = 64;
    alignas(16) static long data[kChunks * kThreads * 2 + 1];
    for (unsigned i = 0; i < kChunks * kThreads * 2; ++i) data[i] = i + 1;
    const bool early = std::strcmp(check, "copy_early_read") == 0;
    const unsigned neighbour = std::strcmp(check, "copy_neighbour") == 0 ? 1 : 0;
    const bool unwaited = std::strcmp(check, "copy_unwaited") == 0;
    const unsigned offset = std::strcmp(check, "copy_misaligned") == 0 ? 1 : 0;
    long total = 0;
    const auto body = [&] {
      auto* slots = reinterpret_cast<long (*)[kThreads][2]>(dynamic_shared_memory());  // [stage][thread][2 longs]
      const unsigned tid = this_thread().linear_tid;
      const Site site{__FILE__, __LINE__};
      const auto issue = [&](unsigned i) {
        copy_async(slots[i % 2][tid], data + (i * kThreads + tid) * 2 + offset, 16, site);
        copy_async_commit();
      };
      issue(0);
      long sum = 0;
      for (unsigned i = 0; i < kChunks; ++i) {
        if (i + 1 < kChunks) issue(i + 1);
        if (!early && !(unwaited && i + 1 == kChunks)) copy_async_wait(i + 1 < kChunks ? 1 : 0, site);
        for (const long& value : slots[i % 2][(tid + neighbour) % kThreads]) {
          record_access(Space::Shared, &value, sizeof(value), false, site);
          sum += value;
        }
        if (early) copy_async_wait(i + 1 < kChunks ? 1 : 0, site);
      }
      if (tid == 33) total += sum;
    };
    try {
      launch({3}, {kThreads}, 2 * kThreads * 2 * sizeof(long), nullptr, body);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
    std::printf("total %ld\n", total);
    return 0;
  }
  long sum = 0;
  const auto body = [&] {
    const unsigned tid = this_thread().linear_tid;
    if (std::strcmp(check, "deadlock") == 0 && tid == 3) return;  // never reaches the block's barrier
    if (std::strcmp(check, "divergent") == 0) {
      if (tid != 3) cluster_sync();  // thread 3 goes on to the end of the block instead
      return;
    }
    sync_threads();
    sum += shfl_xor(static_cast<long>(tid), 1);  // the lanes' values, swapped in pairs
    cluster_sync();
  };
  launch({6}, {64}, 0, nullptr, body, 2);  // 3 clusters of 2 blocks of 64 threads
  std::printf("sum %ld\n", sum);
}
