// The thin device layer the kernels are written against. Under nvcc it is
// CUDA; under a host compiler it is the SIMT emulation of
// csrc/emulated/simt_emulator.h, so the same kernel source runs on the CPU in
// the test-only emulated build.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "launch_plan.h"

#if defined(__CUDACC__)

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAMacros.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>

#define TLN_KERNEL __global__
// The most threads a kernel is launched with: the compiler keeps its registers
// within what a block of that size can have, so the launch cannot fail for lack of them.
// One resident block is enough: without it ptxas trades spills for occupancy
// (sm_90: 4-28 bytes around the division's slow-path call at 64 registers).
#define TLN_LAUNCH_BOUNDS(max_threads) __launch_bounds__(max_threads, 1)
#define TLN_DEVICE __device__ __forceinline__
// Fixed-size shared memory for the block.
#define TLN_STATIC_SHARED(type, name, count) __shared__ type name[count]

namespace torch_ln::dev {

using Dim3 = ::dim3;
using Stream = cudaStream_t;
constexpr int kWarpSize = 32;

TLN_DEVICE unsigned thread_x() { return threadIdx.x; }
TLN_DEVICE unsigned thread_y() { return threadIdx.y; }
TLN_DEVICE unsigned block_x() { return blockIdx.x; }
TLN_DEVICE unsigned block_y() { return blockIdx.y; }
TLN_DEVICE unsigned block_dim_x() { return blockDim.x; }
TLN_DEVICE unsigned block_dim_y() { return blockDim.y; }
TLN_DEVICE unsigned grid_dim_x() { return gridDim.x; }
TLN_DEVICE void sync_threads() { __syncthreads(); }

template <typename T>
TLN_DEVICE T shfl_xor(T value, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
}

// The launch's dynamic shared memory, as an array of T.
template <typename T>
TLN_DEVICE T* dynamic_shared() {
  extern __shared__ __align__(16) unsigned char tln_dynamic_smem[];
  return reinterpret_cast<T*>(tln_dynamic_smem);
}

// Global and shared memory accesses: plain ones here; the emulated build counts them.
struct Site {};
#define TLN_SITE \
  ::torch_ln::dev::Site {}
template <typename T>
TLN_DEVICE T load_global(const T* p, Site = TLN_SITE) {
  return *p;
}
// Vectors of 16-byte multiples are stored 16 bytes at a time, in PTX: a struct
// store is split into 32-bit ones before ptxas sees it (STG.32 x 4, not STG.128).
// No "memory" clobber, so later loads may be issued ahead of the store; the
// kernels never read a location back before a barrier (volatile asm and
// __syncthreads keep their order), and outputs never alias inputs.
template <typename T>
TLN_DEVICE void store_global(T* p, const T& v, Site = TLN_SITE) {
  if constexpr (sizeof(T) % 16 == 0 && alignof(T) >= 16) {
    unsigned w[sizeof(T) / 4];
    memcpy(w, &v, sizeof(T));
#pragma unroll
    for (size_t k = 0; k < sizeof(T) / 16; ++k) {
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<char*>(p) + 16 * k), "r"(w[4 * k]),
                   "r"(w[4 * k + 1]), "r"(w[4 * k + 2]), "r"(w[4 * k + 3]));
    }
  } else {
    *p = v;
  }
}
// *(base + offset) where `pred` holds, zeros elsewhere. 16-byte multiples load as predicated PTX: a row's
// loads under their bounds checks stay straight-line code, which ptxas issues together before their first use
// (as branches, each LDG sat in its own block beside its use: 2 of a bfloat16 row's 4 loads were in flight).
template <typename T>
TLN_DEVICE T load_global_if(bool pred, const T* base, int64_t offset, Site = TLN_SITE) {
  if constexpr (sizeof(T) % 16 == 0 && alignof(T) >= 16) {
    const char* p = reinterpret_cast<const char*>(base + offset);
    unsigned w[sizeof(T) / 4] = {};
#pragma unroll
    for (size_t k = 0; k < sizeof(T) / 16; ++k) {
      asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n @p ld.global.v4.b32 {%0, %1, %2, %3}, [%5];\n}"
                   : "+r"(w[4 * k]), "+r"(w[4 * k + 1]), "+r"(w[4 * k + 2]), "+r"(w[4 * k + 3])
                   : "r"(static_cast<int>(pred)), "l"(p + 16 * k));
    }
    T v;
    memcpy(&v, w, sizeof(T));
    return v;
  } else {
    return pred ? base[offset] : T{};
  }
}
template <typename T>
TLN_DEVICE T load_shared(const T* p, Site = TLN_SITE) {
  return *p;
}
template <typename T>
TLN_DEVICE void store_shared(T* p, const T& v, Site = TLN_SITE) {
  *p = v;
}

// Thread-block clusters (sm_90; the launchers use them only where the device has them): this block's rank in its
// cluster, a barrier over the cluster's threads (shared-memory writes before it are seen by every block of the
// cluster after it), and `p`, a location in this block's shared memory, in the shared memory of block `rank`.
TLN_DEVICE unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return __clusterRelativeBlockRank();
#else
  return 0;
#endif
}
TLN_DEVICE void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
#else
  __trap();
#endif
}
template <typename T>
TLN_DEVICE const T* cluster_shared(const T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return static_cast<const T*>(__cluster_map_shared_rank(p, rank));
#else
  __trap();
  return p;
#endif
}

// mbarriers and st.async (sm_90), the cluster reductions' exchange (ClusterReduce2). An mbarrier, 8 bytes of the
// block's shared memory, completes a phase when the arrivals given at init have come and the bytes they expect have
// landed; its wait takes the parity of the phase to wait for. store_async_pair stores two values into block `rank`'s
// shared memory at the location `p` names in this block's, completing their bytes on that block's mbarrier `bar`.
#if defined(__CUDA_ARCH__)
TLN_DEVICE unsigned shared_address(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
TLN_DEVICE unsigned peer_shared_address(const void* p, unsigned rank) {
  unsigned address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(address) : "r"(shared_address(p)), "r"(rank));
  return address;
}
#endif
// Sets up the mbarrier and makes it visible to the cluster (a cluster barrier must follow before a peer uses it).
TLN_DEVICE void mbarrier_init(uint64_t* bar, unsigned arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  __trap();
#endif
}
TLN_DEVICE void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}
// An arrival that expects no bytes: the calling thread's release of what it read before it (to a thread that waits
// for the phase, then overwrites it).
TLN_DEVICE void mbarrier_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
#else
  __trap();
#endif
}
// Acquire at cluster scope: the peers' st.async bytes are visible after it.
TLN_DEVICE void mbarrier_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  }
#else
  __trap();
#endif
}
template <typename V>
TLN_DEVICE void store_async_pair(V* p, V a, V b, unsigned rank, uint64_t* bar) {
  static_assert(sizeof(V) == 4 || sizeof(V) == 8, "st.async moves pairs of 32- or 64-bit values");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned to = peer_shared_address(p, rank), peer_bar = peer_shared_address(bar, rank);
  if constexpr (sizeof(V) == 4) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(to),
                 "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(peer_bar)
                 : "memory");
  } else {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b64 [%0], {%1, %2}, [%3];" ::"r"(to),
                 "l"(__double_as_longlong(a)), "l"(__double_as_longlong(b)), "r"(peer_bar)
                 : "memory");
  }
#else
  __trap();
#endif
}

// cp.async.bulk (sm_90's copy engine): `bytes` (a multiple of 16, both addresses 16-byte aligned) of global memory at
// `src` copied into this block's shared memory at `dst`, completing those bytes on its mbarrier `bar`. The proxy fence
// first orders the block's earlier reads of `dst` (through a barrier the issuer passed) before the copy's writes.
template <typename T>
TLN_DEVICE void bulk_load_shared(void* dst, const T* src, unsigned bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
#else
  __trap();
#endif
}

// cp.async (sm_80): 16 bytes of global memory at `src` (16-byte aligned) copied into this block's shared memory at
// `dst`. The copy joins the thread's open group; copy_async_commit closes it, copy_async_wait<N> waits until at most
// the N most recent closed groups are in flight, after which the issuing thread sees their bytes (other threads: after
// a block barrier that follows the wait).
TLN_DEVICE void copy_async_16(void* dst, const void* src, Site = TLN_SITE) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)),
               "l"(__cvta_generic_to_global(src))
               : "memory");
#else
  __trap();
#endif
}
// The same for 4 bytes (both addresses 4-byte aligned), through L1 (cp.async.ca: the only form for under 16 bytes).
TLN_DEVICE void copy_async_4(void* dst, const void* src, Site = TLN_SITE) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_address(dst)), "l"(__cvta_generic_to_global(src))
               : "memory");
#else
  __trap();
#endif
}
TLN_DEVICE void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  __trap();
#endif
}
template <int N>
TLN_DEVICE void copy_async_wait(Site = TLN_SITE) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#else
  __trap();
#endif
}

// Programmatic dependent launch (sm_90): a kernel launched by launch_dependent may start while the kernel ahead of
// it on the stream is still running; it waits here (for that kernel's end and its memory) before touching its output.
TLN_DEVICE void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the dependent launch after this kernel begin once every block has come here: what a block does after it
// (its last stores) overlaps that launch, which still waits for them (wait_for_prior_grid).
TLN_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

TLN_DEVICE float rsqrt(float x) { return ::rsqrtf(x); }
TLN_DEVICE double rsqrt(double x) { return ::rsqrt(x); }
// The full-precision exponential (as torch's silu and sigmoid take it), not __expf's approximation.
TLN_DEVICE float exp(float x) { return ::expf(x); }
TLN_DEVICE double exp(double x) { return ::exp(x); }
// A product rounded on its own, never fused into a following add.
TLN_DEVICE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
TLN_DEVICE double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// How many blocks of `threads` threads and `smem_bytes` of dynamic shared memory
// an SM of the current device holds at once, by the kernel's registers and
// shared memory (the occupancy API).
template <typename... Params>
int resident_blocks_per_sm(void (*kernel)(Params...), int threads, size_t smem_bytes, const DeviceLimits& /*device*/) {
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes));
  return blocks;
}

// Lets the kernel launch with more than the default 48 KB of dynamic shared memory, up to the device's
// `max_bytes` (always the same value, so that concurrent launches never lower each other's limit).
template <typename... Params>
void allow_dynamic_shared(void (*kernel)(Params...), size_t bytes, size_t max_bytes) {
  if (bytes <= 48 * 1024) return;
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_bytes)));
}

// cudaLaunchKernelEx's configuration of a launch with one attribute (`attribute`, which must outlive it).
inline cudaLaunchConfig_t launch_config(Dim3 grid, Dim3 block, size_t smem_bytes, Stream stream,
                                        cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

// A launch of clusters of `cluster` blocks along x; `attribute` is its storage.
inline cudaLaunchConfig_t cluster_config(Dim3 grid, Dim3 block, size_t smem_bytes, Stream stream, unsigned cluster,
                                         cudaLaunchAttribute& attribute) {
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return launch_config(grid, block, smem_bytes, stream, attribute);
}

// How many clusters of `cluster` blocks (of `threads` threads and `smem_bytes` each) the device holds at once.
// Clusters of more than 8 blocks (the portable size) need the kernel's opt-in first (sm_90: up to 16).
template <typename... Params>
int resident_clusters(void (*kernel)(Params...), unsigned cluster, int threads, size_t smem_bytes,
                      const DeviceLimits& /*device*/) {
  if (cluster > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute attribute{};
  const cudaLaunchConfig_t config =
      cluster_config({cluster}, {static_cast<unsigned>(threads)}, smem_bytes, 0, cluster, attribute);
  int clusters = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  return clusters;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) and checks the launch.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t smem_bytes, Stream stream, Args&&... args) {
  kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether `kernel`, as loaded for the current device, was compiled for sm_90 or later, where its
// wait_for_prior_grid waits (a compute_80 build JIT-compiled for an H100 has none): cached per device.
template <typename... Params>
bool waits_for_prior_grid(void (*kernel)(Params...)) {
  static std::array<std::atomic<signed char>, C10_COMPILE_TIME_MAX_GPUS> known{};  // 0: not asked yet
  std::atomic<signed char>& known_here = known.at(c10::cuda::current_device());
  if (known_here.load(std::memory_order_relaxed) == 0) {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    known_here.store(attributes.ptxVersion >= 90 ? 1 : -1, std::memory_order_relaxed);
  }
  return known_here.load(std::memory_order_relaxed) > 0;
}

// launch(), as a programmatic dependent launch where the kernel waits for it (wait_for_prior_grid): its launch
// overlaps the end of the kernel before it on the stream instead of following it.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t smem_bytes, Stream stream,
                      Args&&... args) {
  if (!waits_for_prior_grid(kernel))
    return launch(kernel, grid, block, smem_bytes, stream, std::forward<Args>(args)...);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  const cudaLaunchConfig_t config = launch_config(grid, block, smem_bytes, stream, attribute);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// The same launch in clusters of `cluster` blocks along x (grid.x a multiple of it).
template <typename... Params, typename... Args>
void launch_clusters(void (*kernel)(Params...), unsigned cluster, Dim3 grid, Dim3 block, size_t smem_bytes,
                     Stream stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  const cudaLaunchConfig_t config = cluster_config(grid, block, smem_bytes, stream, cluster, attribute);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace torch_ln::dev

#else  // SIMT emulation on the CPU

#include <cmath>
#include <source_location>

#include "../emulated/simt_emulator.h"

#define TLN_KERNEL
#define TLN_LAUNCH_BOUNDS(max_threads)
#define TLN_DEVICE inline
// One array shared by every emulated thread; blocks run one at a time (except the blocks of a cluster, which
// must use dynamic shared memory), so per-block semantics hold.
#define TLN_STATIC_SHARED(type, name, count) static type name[count]

namespace torch_ln::dev {

using Dim3 = emu::Dim3;
struct Stream {};
constexpr int kWarpSize = emu::kWarpSize;

inline unsigned thread_x() { return emu::this_thread().thread_idx.x; }
inline unsigned thread_y() { return emu::this_thread().thread_idx.y; }
inline unsigned block_x() { return emu::this_thread().block_idx.x; }
inline unsigned block_y() { return emu::this_thread().block_idx.y; }
inline unsigned block_dim_x() { return emu::this_thread().block_dim.x; }
inline unsigned block_dim_y() { return emu::this_thread().block_dim.y; }
inline unsigned grid_dim_x() { return emu::this_thread().grid_dim.x; }
inline void sync_threads() { emu::sync_threads(); }

template <typename T>
T shfl_xor(T value, int lane_mask) {
  return emu::shfl_xor(value, lane_mask);
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(emu::dynamic_shared_memory());
}

// Every access reports to the launch's traffic counters (simt_emulator.h), tagged
// with the source line it comes from: a warp's accesses are grouped by line.
using Site = std::source_location;
#define TLN_SITE ::std::source_location::current()
template <typename T>
T load_global(const T* p, Site site = TLN_SITE) {
  emu::record_access(emu::Space::Global, p, sizeof(T), false, {site.file_name(), site.line()});
  return *p;
}
template <typename T>
void store_global(T* p, const T& v, Site site = TLN_SITE) {
  emu::record_access(emu::Space::Global, p, sizeof(T), true, {site.file_name(), site.line()});
  *p = v;
}
template <typename T>
T load_global_if(bool pred, const T* base, int64_t offset, Site site = TLN_SITE) {
  return pred ? load_global(base + offset, site) : T{};
}
template <typename T>
T load_shared(const T* p, Site site = TLN_SITE) {
  emu::record_access(emu::Space::Shared, p, sizeof(T), false, {site.file_name(), site.line()});
  return *p;
}
template <typename T>
void store_shared(T* p, const T& v, Site site = TLN_SITE) {
  emu::record_access(emu::Space::Shared, p, sizeof(T), true, {site.file_name(), site.line()});
  *p = v;
}

inline void wait_for_prior_grid() { emu::wait_for_prior_grid(); }
inline void allow_dependent_launch() {}  // the emulator runs launches one after another

inline unsigned cluster_rank() { return emu::this_thread().cluster_rank; }
inline void cluster_sync() { emu::cluster_sync(); }
template <typename T>
const T* cluster_shared(const T* p, unsigned rank) {
  return reinterpret_cast<const T*>(emu::map_shared_rank(p, rank));
}

inline void mbarrier_init(uint64_t* bar, unsigned arrivals, Site site = TLN_SITE) {
  emu::mbarrier_init(bar, arrivals, {site.file_name(), site.line()});
}
inline void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes, Site site = TLN_SITE) {
  emu::mbarrier_arrive_expect_tx(bar, bytes, {site.file_name(), site.line()});
}
inline void mbarrier_arrive(uint64_t* bar, Site site = TLN_SITE) {
  emu::mbarrier_arrive(bar, {site.file_name(), site.line()});
}
inline void mbarrier_wait(uint64_t* bar, unsigned parity, Site site = TLN_SITE) {
  emu::mbarrier_wait(bar, parity, {site.file_name(), site.line()});
}
template <typename V>
void store_async_pair(V* p, V a, V b, unsigned rank, uint64_t* bar, Site site = TLN_SITE) {
  const V pair[2] = {a, b};
  emu::store_async(p, pair, sizeof(pair), rank, bar, {site.file_name(), site.line()});
}

template <typename T>
void bulk_load_shared(void* dst, const T* src, unsigned bytes, uint64_t* bar, Site site = TLN_SITE) {
  emu::bulk_load_shared(dst, src, bytes, bar, {site.file_name(), site.line()});
}

inline void copy_async_16(void* dst, const void* src, Site site = TLN_SITE) {
  emu::copy_async(dst, src, 16, {site.file_name(), site.line()});
}
inline void copy_async_4(void* dst, const void* src, Site site = TLN_SITE) {
  emu::copy_async(dst, src, 4, {site.file_name(), site.line()});
}
inline void copy_async_commit() { emu::copy_async_commit(); }
template <int N>
void copy_async_wait(Site site = TLN_SITE) {
  emu::copy_async_wait(N, {site.file_name(), site.line()});
}

inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float exp(float x) { return std::exp(x); }
inline double exp(double x) { return std::exp(x); }
template <typename T>
T mul_rn(T a, T b) {  // host builds compile with -ffp-contract=off
  return a * b;
}

// The emulated device has no registers to count: blocks are limited by its threads per SM and, where the device
// sets it, its shared memory per SM (each block's own and the hardware's reserve).
template <typename... Params>
int resident_blocks_per_sm(void (*)(Params...), int threads, size_t smem_bytes, const DeviceLimits& device) {
  emu::count_occupancy_query();
  const int by_threads = device.max_threads_per_sm / threads;
  if (device.shared_per_sm == 0) return by_threads;
  return std::min(by_threads, static_cast<int>(device.shared_per_sm / (smem_bytes + kReservedSharedPerBlock)));
}

// The emulated launch takes any size: the launchers keep within DeviceLimits::max_shared_per_block themselves.
template <typename... Params>
void allow_dynamic_shared(void (*)(Params...), size_t, size_t) {}

// Blocks an SM as resident_blocks_per_sm.
template <typename... Params>
int resident_clusters(void (*kernel)(Params...), unsigned cluster, int threads, size_t smem_bytes,
                      const DeviceLimits& device) {
  return device.num_sms * resident_blocks_per_sm(kernel, threads, smem_bytes, device) / static_cast<int>(cluster);
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t smem_bytes, Stream, Args&&... args) {
  emu::launch(grid, block, smem_bytes, reinterpret_cast<const void*>(kernel), [&] { kernel(args...); });
}

template <typename... Params, typename... Args>
void launch_clusters(void (*kernel)(Params...), unsigned cluster, Dim3 grid, Dim3 block, size_t smem_bytes, Stream,
                     Args&&... args) {
  emu::launch(grid, block, smem_bytes, reinterpret_cast<const void*>(kernel), [&] { kernel(args...); }, cluster);
}

// Always dependent: the emulator checks that the kernel waits before it touches global memory.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t smem_bytes, Stream, Args&&... args) {
  emu::launch(grid, block, smem_bytes, reinterpret_cast<const void*>(kernel), [&] { kernel(args...); }, 1, true);
}

}  // namespace torch_ln::dev

#endif
