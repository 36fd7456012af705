// Small launches that check the SIMT emulator itself (tests/emulated/test_emulator.py): argv[1] picks one.
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
