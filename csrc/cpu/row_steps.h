// The building blocks of the CPU kernels (norm_cpu_kernels.h): what a step of a row is (kU vectors of acc_t), its
// loads, conversions and stores (streaming ones included), and the row reductions in an order fixed by element index.
// Included only by norm_cpu_kernels.h, inside its AVX2 target region, after at::vec.
#pragma once

#ifndef TORCH_LN_CPU_KERNELS
#error "row_steps.h is part of norm_cpu_kernels.h: include that instead"
#endif

namespace torch_ln {
namespace {

using at::vec::Vectorized;

// A step is kU vectors of acc_t: kU independent accumulators hide the add latency in the row reductions.
constexpr int kU = 4;
template <typename A>
constexpr int64_t kStep = kU * Vectorized<A>::size();
template <typename A>
using Group = std::array<Vectorized<A>, kU>;

// Below this many steps a row segment is summed in one loop, above it in halves (see sum_steps).
constexpr int64_t kLeafSteps = 16;

// GCC leaves some at::vec helpers and per-step lambdas out of line (a call and register spills per vector);
// flattening the per-row functions inlines everything into their loops.
#if defined(__GNUC__)
#define TORCH_LN_FLATTEN __attribute__((flatten))
#else
#define TORCH_LN_FLATTEN
#endif

// Requests the cache lines of one step at p: the last pass over a row runs from cache, and pulling in the next
// row meanwhile keeps memory busy.
template <typename A, typename S>
void prefetch_step(const S* p) {
#if defined(__GNUC__)
  for (size_t offset = 0; offset < kStep<A> * sizeof(S); offset += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + offset);
  }
#endif
}

// Elements [0, n) of one step (n <= kStep) at p, as acc_t vectors; lanes past n are zero. Unaligned loads, so
// the arithmetic never depends on where a row sits in memory.
template <typename A, typename S>
Group<A> load_group(const S* p, int64_t n) {
  using VA = Vectorized<A>;
  constexpr int64_t V = VA::size();
  Group<A> g;
  if constexpr (std::is_same_v<S, A>) {
    for (const auto i : c10::irange(kU)) g[i] = VA::loadu(p + i * V, std::clamp<int64_t>(n - i * V, 0, V));
  } else {  // half/bfloat16 to float
    if (n < kStep<A>) {
      S padded[kStep<A>] = {};
      std::copy_n(p, n, padded);
      return load_group<A>(padded, kStep<A>);
    }
    for (const auto i : c10::irange(kU)) at::vec::load_to_float<S>(p + i * V, g[i]);
  }
  return g;
}

#ifdef TORCH_LN_TARGET_AVX2
// AVX-512 BF16's VCVTNE2PS2BF16 rounds 16 floats to bfloat16 (to nearest even) in one instruction where AVX2 takes
// about 16 (0.03 against 0.09 ns an element on the dev VM's AMD EPYC). The kernels stay AVX2 code: the instruction
// is inline assembly behind a run-time check of the CPU.
const bool kHasAvx512Bf16 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl");
}();

// lo and hi rounded to bfloat16 into `out`, where VCVTNE2PS2BF16 gives at::vec's bits (torch's rounding): it treats
// denormal inputs as zero and keeps NaN payloads, so vectors with a lane below the smallest normal magnitude (zeros
// included: one compare) or NaN are left to at::vec (false).
inline bool round_to_bfloat16_avx512(const Vectorized<float>& lo, const Vectorized<float>& hi,
                                     Vectorized<c10::BFloat16>& out) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 min_normal = _mm256_set1_ps(std::numeric_limits<float>::min());
  // Not >= the smallest normal (unordered: NaN too).
  const __m256 special = _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(lo, magnitude), min_normal, _CMP_NGE_UQ),
                                      _mm256_cmp_ps(_mm256_and_ps(hi, magnitude), min_normal, _CMP_NGE_UQ));
  if (!_mm256_testz_ps(special, special)) return false;
  __m256i rounded;
  asm("vcvtne2ps2bf16 %1, %2, %0" : "=x"(rounded) : "x"(static_cast<__m256>(lo)), "x"(static_cast<__m256>(hi)));
  out = rounded;
  return true;
}
#endif

// g as vectors of S: g itself, or for half/bfloat16 each pair of float vectors converted (rounded) into one.
template <typename A, typename S>
auto pack(const Group<A>& g) {
  if constexpr (std::is_same_v<S, A>) {
    return g;
  } else {
    std::array<Vectorized<S>, kU / 2> packed;
    for (const auto i : c10::irange(kU / 2)) {
#ifdef TORCH_LN_TARGET_AVX2
      if constexpr (std::is_same_v<S, c10::BFloat16>) {
        if (kHasAvx512Bf16 && round_to_bfloat16_avx512(g[2 * i], g[2 * i + 1], packed[i])) continue;
      }
#endif
      packed[i] = at::vec::convert_from_float<S>(g[2 * i], g[2 * i + 1]);
    }
    return packed;
  }
}

// pack's result back as acc_t vectors.
template <typename A, typename S, typename Packed>
Group<A> unpack(const Packed& packed) {
  if constexpr (std::is_same_v<S, A>) {
    return packed;
  } else {
    Group<A> g;
    for (const auto i : c10::irange(kU / 2)) std::tie(g[2 * i], g[2 * i + 1]) = at::vec::convert_to_float<S>(packed[i]);
    return g;
  }
}

// Streaming (non-temporal) stores write an output around the caches: no read of each line before it is
// overwritten, and the inputs keep their place in the cache. They pay off once a call's rows (inputs and outputs)
// would not stay in the last-level cache for their next reader anyway, and cost where they would: the cached output
// is there for the next layer (and for the same call's next run). Measured on the 2-core dev VM (AMD EPYC, 32 MiB
// L3), one process, time streaming / cached: float32 forward with 16 MiB of rows (x and y) 0.98 where the L3 served
// it and 1.2-1.6 in the processes where it did not; 24 MiB 0.9-1.0; 32 MiB 0.78-0.85; float32 backward (x, dy and
// dx) 12 MiB 0.97, 24 MiB 0.66; bfloat16 forward 16 MiB 1.0, 32 MiB 0.85-1.0. (The earlier rule, from 1 MiB of
// output per thread, streamed the 16 MiB forward: 0.82-0.97x torch in the processes the L3 did not serve.) The cost:
// a forward followed at once by its backward (a benchmark's fwd+bwd; in a model the layers between evict x anyway)
// found x in cache more often when y streamed: float32 8 MiB 1.08-1.19x the time with y cached.
constexpr int64_t kStreamingRowBytes = int64_t{16} << 20;
constexpr int64_t kStreamAlignment = 32;  // bytes: one AVX register

// Whether a call whose rows (what it reads and writes row by row) take `row_bytes` streams its outputs.
bool use_streaming_stores(int64_t row_bytes) {
#ifdef TORCH_LN_TARGET_AVX2
  return row_bytes > kStreamingRowBytes;
#else
  return false;
#endif
}

// Elements from p to the next kStreamAlignment boundary: a row's first step, after which its whole steps can stream.
template <typename S>
int64_t elements_to_alignment(const S* p) {
  const auto misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % kStreamAlignment);
  return (kStreamAlignment - misalignment) % kStreamAlignment / static_cast<int64_t>(sizeof(S));
}

// Streaming stores are weakly ordered: a thread ends its writes with a fence before others may read them.
void finish_streaming(bool streaming) {
#ifdef TORCH_LN_TARGET_AVX2
  if (streaming) _mm_sfence();
#endif
}

#ifdef TORCH_LN_TARGET_AVX2
inline __m256i register_bits(__m256 v) { return _mm256_castps_si256(v); }
inline __m256i register_bits(__m256d v) { return _mm256_castpd_si256(v); }
inline __m256i register_bits(__m256i v) { return v; }
#endif

// Stores the first n (<= kStep) elements of pack's result to p; streaming when asked and the step is whole and
// aligned.
template <typename S, typename Packed>
void store_packed(S* p, const Packed& packed, int64_t n, bool streaming = false) {
  constexpr int64_t V = Packed::value_type::size();
#ifdef TORCH_LN_TARGET_AVX2
  if (streaming && n == V * static_cast<int64_t>(packed.size()) &&
      reinterpret_cast<uintptr_t>(p) % kStreamAlignment == 0) {
    for (const auto i : c10::irange(packed.size())) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p + i * V), register_bits(packed[i]));
    }
    return;
  }
#endif
  for (const auto i : c10::irange(packed.size())) packed[i].store(p + i * V, std::clamp<int64_t>(n - i * V, 0, V));
}

// Stores the first n (<= kStep) elements of g to p, converting to S.
template <typename A, typename S>
void store_group(S* p, const Group<A>& g, int64_t n) {
  store_packed(p, pack<A, S>(g), n);
}

// store_group, streaming when asked and the step is whole and aligned.
template <typename A, typename S>
void store_output(S* p, const Group<A>& g, int64_t n, bool streaming) {
  store_packed(p, pack<A, S>(g), n, streaming);
}

// Calls f(j, count) for consecutive steps covering [0, n): first `head` elements (if any), then whole steps; only
// the last may be partial. Only elementwise passes take a head: the reductions keep their order.
template <typename A, typename F>
void for_each_step(int64_t n, const F& f, int64_t head = 0) {
  int64_t j = std::min(head, n);
  if (j > 0) f(0, j);
  for (; j + kStep<A> <= n; j += kStep<A>) f(j, kStep<A>);
  if (j < n) f(j, n - j);
}

template <typename A, size_t S>
using Sums = std::array<Group<A>, S>;

// Lane-wise sums of term(j, kStep) over `steps` full steps from element j0, added in halves: the rounding error
// grows with log(D) instead of D, which keeps e.g. the mean of a large-offset row accurate.
template <typename A, size_t S, typename Term>
TORCH_LN_FLATTEN Sums<A, S> sum_steps(int64_t j0, int64_t steps, const Term& term) {
  if (steps > kLeafSteps) {
    const int64_t half = steps / 2;
    Sums<A, S> acc = sum_steps<A, S>(j0, half, term);
    const Sums<A, S> rest = sum_steps<A, S>(j0 + half * kStep<A>, steps - half, term);
    for (const auto s : c10::irange(S))
      for (const auto i : c10::irange(kU)) acc[s][i] += rest[s][i];
    return acc;
  }
  // The leaf's sums of its own, not shared with the merge above (whose come back through memory): GCC then keeps
  // them in registers instead of zeroing them with `rep stos` and reloading them.
  Sums<A, S> acc;
  for (auto& group : acc)
    for (auto& v : group) v = Vectorized<A>(A(0));
  for (const auto k : c10::irange(steps)) {
    const Sums<A, S> t = term(j0 + k * kStep<A>, kStep<A>);
    for (const auto s : c10::irange(S))
      for (const auto i : c10::irange(kU)) acc[s][i] += t[s][i];
  }
  return acc;
}

// The S row sums of the per-element terms term(j, count) -> Sums<A, S> (count elements from j) over [0, n). The
// order of additions depends only on n.
template <typename A, size_t S, typename Term>
std::array<A, S> row_sums(int64_t n, const Term& term) {
  using VA = Vectorized<A>;
  constexpr int64_t V = VA::size();
  Sums<A, S> acc = sum_steps<A, S>(0, n / kStep<A>, term);
  if (const int64_t tail = n % kStep<A>) {
    const Sums<A, S> t = term(n - tail, tail);
    for (const auto s : c10::irange(S))
      for (const auto i : c10::irange(kU)) {
        // Lanes past the row end may hold nonzero terms (x - mean of a zero lane): drop them.
        const int64_t valid = std::clamp<int64_t>(tail - i * V, 0, V);
        if (valid > 0) acc[s][i] += valid == V ? t[s][i] : VA::set(VA(A(0)), t[s][i], valid);
      }
  }
  std::array<A, S> out;
  for (const auto s : c10::irange(S)) {
    const VA v = (acc[s][0] + acc[s][1]) + (acc[s][2] + acc[s][3]);
    out[s] = at::vec::vec_reduce_all<A>([](const VA& p, const VA& q) { return p + q; }, v);
  }
  return out;
}

// Calls f(std::true_type) or f(std::false_type): a runtime flag as a compile-time one, so the per-element loops
// carry no branches for absent weight/bias or unrequested outputs.
template <typename F>
void with_flag(bool flag, const F& f) {
  flag ? f(std::true_type{}) : f(std::false_type{});
}

}  // namespace
}  // namespace torch_ln
