// Why a cache: glibc's malloc maps every allocation of 32 MiB or more anew and unmaps it on free (and trims and
// regrows its heap for smaller ones), so without one each call's output is fresh memory that faults in page by
// page, and on the 2-core dev VM the faults cost more than the kernel (float32 LayerNorm forward, 32 MiB: ~30 ms of
// faults against 12-17 ms of work). Freed outputs of 1 MiB or more wait here for the next call of the same size,
// most recent first, up to a cap (TORCH_LN_OUTPUT_CACHE_MB, default 256; 0 turns the cache off); beyond it the
// oldest go back to the system.
#include "output_cache.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch_ln/torch_ln.h>

#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "../norm.h"

namespace torch_ln {

namespace {

constexpr size_t kMinCachedBytes = size_t{1} << 20;  // below: few pages to fault, and malloc's heap mostly keeps them

size_t capacity_from_env() {
  const char* setting = std::getenv("TORCH_LN_OUTPUT_CACHE_MB");
  if (setting == nullptr || *setting == '\0') return size_t{256} << 20;
  char* end = nullptr;
  const long long mib = std::strtoll(setting, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && mib >= 0, "torch_ln: expected TORCH_LN_OUTPUT_CACHE_MB to be a number of MiB >= 0,",
                    " but got TORCH_LN_OUTPUT_CACHE_MB='", setting, "'");
  return static_cast<size_t>(mib) << 20;
}

class OutputCache final : public c10::Allocator {
 public:
  // Never destroyed: tensors may free their storage after static destructors ran.
  static OutputCache& instance() {
    static auto* cache = new OutputCache();
    return *cache;
  }

  const size_t capacity = capacity_from_env();

  // A block from the cache, else from c10's CPU allocator; the tensor's storage owns it through a Block.
  c10::DataPtr allocate(size_t bytes) override {
    std::optional<Block> cached = take(bytes);
    auto* block = new Block(cached ? std::move(*cached) : Block{c10::GetDefaultCPUAllocator()->allocate(bytes), bytes});
    return {block->memory.get(), block, &release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  int64_t clear() {
    std::deque<Block> blocks;
    size_t bytes = 0;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
      bytes = std::exchange(cached_bytes_, 0);
    }
    return static_cast<int64_t>(bytes);  // the blocks are freed as `blocks` goes
  }

  int64_t cached_bytes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(cached_bytes_);
  }

 private:
  struct Block {
    c10::DataPtr memory;  // from c10's CPU allocator, which frees it
    size_t bytes;
  };

  // A cached block of exactly `bytes`, the most recently freed; none when there is none.
  std::optional<Block> take(size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->bytes == bytes) {
        Block block = std::move(*it);
        cached_bytes_ -= bytes;
        free_.erase(it);
        return block;
      }
    }
    return std::nullopt;
  }

  // The deleter of the storage of every tensor from this allocator (on any thread).
  static void release(void* context) {
    const std::unique_ptr<Block> block(static_cast<Block*>(context));
    instance().keep(std::move(*block));
  }

  // Caches the block, then returns the oldest ones beyond the cap to the system.
  void keep(Block block) {
    if (block.bytes > capacity) return;  // a cached tensor resized beyond the cap: freed here
    std::deque<Block> evicted;           // freed when it goes, outside the lock: munmap can take a while
    const std::lock_guard<std::mutex> lock(mutex_);
    cached_bytes_ += block.bytes;
    free_.push_front(std::move(block));
    while (cached_bytes_ > capacity) {
      cached_bytes_ -= free_.back().bytes;
      evicted.push_back(std::move(free_.back()));
      free_.pop_back();
    }
  }

  std::mutex mutex_;
  std::deque<Block> free_;  // most recently freed first
  size_t cached_bytes_ = 0;
};

}  // namespace

at::Tensor empty_cpu_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  OutputCache& cache = OutputCache::instance();
  const size_t bytes = c10::multiply_integers(sizes) * options.dtype().itemsize();
  if (bytes < kMinCachedBytes || bytes > cache.capacity) {
    return empty_contiguous(sizes, options);
  }
  return at::detail::empty_generic(sizes, &cache, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   options.dtype().toScalarType(), at::MemoryFormat::Contiguous);
}

int64_t empty_output_cache() { return OutputCache::instance().clear(); }

int64_t output_cache_bytes() { return OutputCache::instance().cached_bytes(); }

}  // namespace torch_ln
