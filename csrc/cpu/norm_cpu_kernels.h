// CPU kernels of LayerNorm and RMSNorm: one template over NormKind, vectorized with at::vec, parallel over rows.
// Their building blocks (a row's steps, loads, stores, fixed-order sums) are in row_steps.h; here: the per-thread rows,
// the forward and the backward (one struct, which share its parameter and rounding helpers), and the entry points.
// Compiled by one file per input dtype (norm_cpu_<dtype>.cpp), so that the dtypes compile in parallel (one file of
// all of them took 12 minutes on a 2-core host).
//
// Reproducibility: a row's statistics, output and input gradient depend only on that row and D (every reduction
// runs in an order fixed by element index), and the weight/bias gradients are summed over a fixed number of row
// chunks in a fixed order, so results are bitwise identical run to run, whatever the batch or thread count.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dispatch.h"
#include "norm_cpu.h"

// at::vec selects its SIMD implementation from CPU_CAPABILITY_* macros that only torch's own build defines; without
// them Vectorized is a plain array loop. Unless the build picked a capability, compile the kernels below for
// AVX2+FMA (every x86-64 CPU since 2013-2015) and check the CPU at run time. The private namespace name keeps these
// inline at::vec functions apart from libtorch's; sleef.h declares its AVX2 functions only under the ISA macros,
// which the target pragma does not define.
#if !defined(CPU_CAPABILITY) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TORCH_LN_TARGET_AVX2 1
#define CPU_CAPABILITY torch_ln_avx2
#define CPU_CAPABILITY_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#if !defined(__AVX2__)
#define TORCH_LN_DEFINED_ISA_MACROS
#define __AVX__ 1
#define __AVX2__ 1
#endif
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#ifdef TORCH_LN_TARGET_AVX2
#include <immintrin.h>
#endif

#ifdef TORCH_LN_DEFINED_ISA_MACROS
#undef __AVX__
#undef __AVX2__
#endif

#define TORCH_LN_CPU_KERNELS
#include "row_steps.h"
// after row_steps.h, whose steps it uses
#include "quantize_row.h"

namespace torch_ln {
namespace {

// LayerNorm rows up to this size (as acc_t) get their statistics in two passes (the mean, then the variance
// around it), the second from cache; longer ones in one read (row_moments, cascaded Welford), so the forward reads
// memory twice in all, not three times: up to half a core's L2 (the row must survive the output stream between
// passes). Half/bfloat16 rows up to NormCpu::kConvertOnceRowBytes are converted once, into a per-thread acc_t row that
// the later passes read.
// Measured on the 2-core dev VM, float32 forward, 8 MiB of input, default malloc, against torch:
// D=1024/4096/16384 1.31x/1.29x/1.21x with two passes, 1.02x/0.83x/0.87x with one read (Welford's divisions
// and merges cost more than loads from L1/L2); bfloat16, single thread, 1 MiB: D=4096/8192 0.89x/~1.0x with one
// read, 1.4x/1.35x converted once (a 4 KiB stack buffer limited that to 1024 elements before). The same limit holds
// after a residual add (whose later passes read h, or a per-thread copy of it), so that the fused ops' statistics are
// bitwise those of the plain norm of residual_out.
constexpr int64_t kTwoPassRowBytes = 512 * 1024;

// The forward's last pass over a row of up to this many bytes of inputs (x, and the residual) requests the next
// row, so that memory stays busy while this one is normalized from cache. Measured on the 2-core dev VM (LayerNorm
// forward, default malloc, 2 threads, time with / without in one process): bfloat16 at 8-16 MiB, D = 1024..16384,
// 0.77-0.91 (its converting last pass leaves memory idle longest); float32 at 16 MiB, D = 1024 / 4096, 0.83; the
// fused add 0.90-0.99; at 1 MiB (in cache) 0.98-1.04. Longer rows: the next row evicts this one from a core's L2
// (float32, one thread, D = 16384 / 65536: 1.34 / 1.16).
constexpr int64_t kPrefetchRowBytes = 32 * 1024;

// What a thread keeps in a ThreadRow: the row being normalized (InputRow::kept), the weight and the bias as acc_t; the
// backward's partial weight/bias gradient rows; the quantized forward's y row where y itself is not asked for
// (kQuantized).
enum class RowUse { kKept, kWeight, kBias, kPartials, kQuantized };

// A per-thread row of n values of type E, uninitialized, for one RowUse. Rows up to kReusedBytes reuse one buffer per
// thread and use for the life of the thread (virtual memory until touched): allocating (and zero-filling) one per call
// cost more than a call of a few long rows (bfloat16 forward, 4 rows of 131072, converted once then, in a fresh process
// with default malloc: 0.61 ms against torch's 0.16, each call's 512 KiB row mapped anew and faulted in). Longer rows
// get one for the call.
template <typename E, RowUse kUse, int64_t kReusedBytes = kTwoPassRowBytes>
class ThreadRow {
 public:
  explicit ThreadRow(int64_t n) {
    if (n == 0) return;  // no row kept
    if (n * static_cast<int64_t>(sizeof(E)) <= kReusedBytes) {
      static thread_local const std::unique_ptr<E[]> reused(new E[kReusedBytes / sizeof(E)]);
      data_ = reused.get();
    } else {
      owned_.reset(new E[n]);
      data_ = owned_.get();
    }
  }
  E* data() const { return data_; }

 private:
  std::unique_ptr<E[]> owned_;
  E* data_ = nullptr;
};

template <NormKind K, typename Types>
struct NormCpu {
  using T = typename Types::input_t;
  using W = typename Types::param_t;
  using A = typename Types::acc_t;
  using R = typename Types::row_t;  // the normalized rows: x's type, or after a residual add, residual_out's
  using VA = Vectorized<A>;
  static constexpr bool kCentered = K == NormKind::LayerNorm;  // RMSNorm: mean fixed at 0

  // Whether the forward converts a row once into InputRow::kept, which its later passes read: half/bfloat16 rows
  // without a residual, up to kConvertOnceRowBytes as acc_t. Longer rows are read (and converted) in each pass: the
  // converted row would double their footprint in a core's L2. Measured on the 2-core dev VM, bfloat16 forward, one
  // thread, 1 MiB of input, ms converted once / in each pass: D=1024 0.20/0.28, 4096 0.25/0.29, 16384 0.22/0.25,
  // 32768 0.22-0.24/0.24, 65536 0.28/0.25, 131072 0.31/0.20.
  static constexpr int64_t kConvertOnceRowBytes = 128 * 1024;
  static constexpr bool converts_once(bool has_residual, int64_t D) {
    return !std::is_same_v<R, A> && !has_residual && D * static_cast<int64_t>(sizeof(A)) <= kConvertOnceRowBytes;
  }

  // Rows per parallel task: about kGrainElements elements.
  static constexpr int64_t kGrainElements = 32768;

  // xhat = (x - mean) * rstd: subtracting first keeps it accurate for rows far from zero mean.
  static Group<A> normalize(Group<A> v, A mean, A rstd) {
    for (auto& e : v) e = kCentered ? (e - VA(mean)) * VA(rstd) : e * VA(rstd);
    return v;
  }

  // Whether param_as_acc converts a parameter (into a row of the thread's) rather than reading it in place.
  static bool converts_param(double offset) { return !std::is_same_v<W, A> || offset != 0; }

  // Rows of a forward task up to which half/bfloat16 parameters (without an offset) are widened to acc_t as the rows
  // read them, rather than converted into the thread's acc_t rows first: for a few rows the conversion, D values per
  // parameter and thread, costs more than widening each row's loads (a shift for bfloat16). Both give the same
  // (exact) acc_t values. Measured on the 2-core dev VM, bfloat16 LayerNorm forward with bfloat16 weight and bias,
  // 2 threads, one process, time widened / converted, tasks of M / 2 rows: 1 MiB 4 x 131072 0.84, 8 x 65536 0.91,
  // 32 x 16384 1.00, 128 x 4096 1.08, 512 x 1024 1.06; 8 MiB 4096 x 1024 1.10, 1024 x 4096 1.07.
  static constexpr int64_t kWidenParamRows = 8;
  static bool widens_params(int64_t task_rows, double offset) {
    return !std::is_same_v<W, A> && offset == 0 && task_rows <= kWidenParamRows;
  }

  // A (contiguous) parameter as acc_t, the offset added in acc_t (Gemma's 1 + weight): in place where converts_param
  // says so, else converted into `row`. Forward tasks of more than kWidenParamRows rows convert their own copy per
  // thread (converting once per call through as_acc cost two more parallel regions and allocations); the backward
  // converts once per call (as_acc).
  static const A* param_as_acc(const at::Tensor& param, double offset, A* row) {
    if (!converts_param(offset)) return param.const_data_ptr<A>();
    const int64_t n = param.numel();
    at::vec::convert(param.const_data_ptr<W>(), row, n);
    if (offset != 0) {
      const A added = static_cast<A>(offset);
      for (const auto j : c10::irange(n)) row[j] += added;
    }
    return row;
  }

  // A parameter as a contiguous acc_t tensor (itself when it already is one), converted as param_as_acc does, so
  // that the backward's row loops never convert it: once per call rather than once per row. Undefined stays undefined.
  static at::Tensor as_acc(const at::Tensor& param, double offset = 0) {
    if (!param.defined() || !converts_param(offset)) return param;
    at::Tensor row = at::empty({param.numel()}, param.options().dtype(c10::CppTypeToScalarType<A>::value));
    param_as_acc(param, offset, row.mutable_data_ptr<A>());
    return row;
  }

  // Rounds v to the input dtype and back when `round` (Llama-style rounding); nothing to do when that is acc_t. In
  // place, not as `round ? rounded(v) : v`: GCC copies such a select of Groups through the stack in 16-byte halves
  // and reloads them whole (a store-forwarding stall per vector: the float32 backward ran at half torch's speed).
  static void round_to_input_if(Group<A>& v, bool round) {
    if constexpr (!std::is_same_v<T, A>) {
      if (round) v = unpack<A, T>(pack<A, T>(v));
    }
  }

  // g = dy * w (dy without weight).
  template <bool HasW, typename P>
  static Group<A> times_weight(Group<A> dy, const P* w, int64_t c) {
    if constexpr (HasW) {
      const Group<A> wv = load_group<A>(w, c);
      for (const auto i : c10::irange(kU)) dy[i] = dy[i] * wv[i];
    }
    return dy;
  }

  // ---- the gate of a gated RMSNorm (GateArgs) ----

  // A row's (or group's) gate z: act(z) and its slope d act / dz, in acc_t, as torch computes them in float32:
  // silu(z) = z / (1 + exp(-z)), sigmoid(z) = 1 / (1 + exp(-z)), silu' = s (1 + z (1 - s)), sigmoid' = s (1 - s).
  struct RowGate {
    const T* z;  // from the row's (group's) first element; null: no gate
    bool before;
    GateActivation activation;

    bool gates_input() const { return z != nullptr && before; }
    bool gates_output() const { return z != nullptr && !before; }

    // act(z) of elements [j, j + c), and with `slope`, its derivative (else left unset).
    Group<A> act(int64_t j, int64_t c, Group<A>* slope = nullptr) const {
      Group<A> v = load_group<A>(z + j, c);
      const VA one(A(1));
      for (const auto i : c10::irange(kU)) {
        const VA denominator = one + v[i].neg().exp();
        const VA s = one / denominator;
        if (slope != nullptr) {
          (*slope)[i] = activation == GateActivation::Silu ? s * (one + v[i] * (one - s)) : s * (one - s);
        }
        v[i] = activation == GateActivation::Silu ? v[i] / denominator : s;
      }
      return v;
    }

    // v *= act(z) over elements [j, j + c).
    void multiply(Group<A>& v, int64_t j, int64_t c) const {
      const Group<A> a = act(j, c);
      for (const auto i : c10::irange(kU)) v[i] = v[i] * a[i];
    }
  };

  // A gated norm's groups: `size` elements each (the row when ungrouped), `count` a row.
  struct Groups {
    int64_t size, count;
    Groups(const GateArgs& gate, int64_t D) : size(gate.group_size > 0 ? gate.group_size : D), count(D / size) {}

    // f(begin, n, group) over the pieces of columns [j0, j0 + n) that lie in one group each.
    template <typename F>
    void for_each(int64_t j0, int64_t n, const F& f) const {
      for (int64_t j = j0; j < j0 + n;) {
        const int64_t group = j / size, end = std::min(j0 + n, (group + 1) * size);
        f(j, end - j, group);
        j = end;
      }
    }
  };

  // Whether these types take a gate (GateArgs): RMSNorm without a row type of its own (which comes with a residual).
  static constexpr bool kGateable = !kCentered && std::is_same_v<R, T>;
  static bool is_gated(const GateArgs& gate) { return gate.z.defined() || gate.group_size > 0; }

  // Whether a gate after the norm multiplies the weighted value in the input's dtype (rounded to it) under
  // Llama-style rounding: when that product is in the input's dtype, i.e. the weight has it (or there is none).
  template <bool HasW>
  static constexpr bool kRoundsWeighted = !HasW || std::is_same_v<W, T>;

  // ---- forward ----

  static void forward(const ForwardArgs& a) {
    // A gated norm (GateArgs): RMSNorm on rows of the input's dtype, its own instances, so that the plain ones
    // compile as they did without the gate (a runtime gate check had cost the backward 2x, the forward up to 10%).
    if constexpr (kGateable) {
      if (is_gated(a.gate)) {
        with_flag(a.weight.defined(), [&](auto has_w) { forward_rows<has_w, false, false, true>(a); });
        return;
      }
    }
    const auto with_residual = [&](auto has_res) {
      with_flag(a.weight.defined(), [&](auto has_w) {
        if constexpr (kCentered) {
          with_flag(a.bias.defined(), [&](auto has_b) { forward_rows<has_w, has_b, has_res, false>(a); });
        } else {
          forward_rows<has_w, false, has_res, false>(a);
        }
      });
    };
    if constexpr (std::is_same_v<R, T>) {
      with_flag(a.residual.defined(), with_residual);
    } else {  // a row type of its own only comes with a residual
      with_residual(std::true_type{});
    }
  }

  // The row a forward normalizes: x, or with a residual, h = x + residual rounded to R. The first pass over a row
  // adds and rounds each element once and writes h from the rounded vectors; the later passes read `kept`: h itself
  // where it is written through the cache, or where it streams like y (h then never displaces the inputs from the
  // cache), a copy of it that the first pass writes to a per-thread row. In R, which holds its values exactly and, for
  // half/bfloat16, takes half acc_t's cache room (bfloat16 RMSNorm at D = 16384: a 32 KiB row instead of 64 KiB).
  // Measured on the 2-core dev VM, bfloat16 forward, 16 MiB of x, fused time over the unfused pair's in the same
  // process, three processes each, kept as R / as acc_t: RMSNorm D = 4096 0.86-0.87 / 0.98-1.00, D = 16384 0.86-0.99 /
  // 0.92-1.05; LayerNorm D = 4096 0.93-1.03 / 0.97-1.11; D = 1024 alike. Reading h rather than a copy where it is
  // cached (benchmarks/results/2026-12-04-cpu-2core-cached-h/), 2 threads, D = 1024 / 4096, fused time new / old:
  // float32 at 1 MiB of x 0.76-1.06 (fused / pair 0.78-0.87 against 0.86-1.03), at 4 MiB 0.81-0.82 and one cell 1.14
  // (fused / pair 0.84-1.00 against 0.96-1.06); bfloat16 0.77-1.02, fused / pair alike (0.90-1.02).
  // Without a residual, `kept` is the acc_t buffer of converts_once rows (forward_row fills it), else null. (Re-adding
  // and re-rounding in every pass instead, measured on the 2-core dev VM: bfloat16 RMSNorm at D >= 2048 took 1.3-1.6x
  // the unfused pair's CPU time, against 1.0-1.1x so.)
  template <bool HasRes, bool HasGate = false>
  struct InputRow {
    using Kept = std::conditional_t<HasRes, R, A>;
    const T* x;
    const R* residual;
    R* h;
    Kept* kept;
    bool streaming;    // how h is written
    int64_t next_row;  // elements from this row to the next one this thread normalizes; 0: none
    RowGate gate;      // a gate before the norm multiplies the row as it is read (in each pass: no row kept)

    // Requests the next row's elements [j, j + kStep) from memory while this one is normalized from cache.
    void prefetch_next(int64_t j) const {
      if (next_row == 0) return;
      prefetch_step<A>(x + next_row + j);
      if constexpr (HasRes) prefetch_step<A>(residual + next_row + j);
    }

    // Elements [j, j + c) (c <= kStep) of the normalized row as acc_t, in the first pass over it.
    Group<A> load_first(int64_t j, int64_t c) const {
      Group<A> v = load_group<A>(x + j, c);
      if constexpr (HasRes) {
        const Group<A> r = load_group<A>(residual + j, c);
        for (const auto i : c10::irange(kU)) v[i] = v[i] + r[i];
        const auto rounded = pack<A, R>(v);  // to R, as torch's add does
        store_packed(h + j, rounded, c, streaming);
        if (kept != h) store_packed(kept + j, rounded, c);
        v = unpack<A, R>(rounded);
      }
      if constexpr (HasGate) {
        if (gate.gates_input()) gate.multiply(v, j, c);
      }
      return v;
    }

    // The same elements in a later pass.
    Group<A> load(int64_t j, int64_t c) const {
      if constexpr (HasRes) return load_group<A>(kept + j, c);
      Group<A> v = load_group<A>(x + j, c);
      if constexpr (HasGate) {
        if (gate.gates_input()) gate.multiply(v, j, c);
      }
      return v;
    }

    // The first element, as load gives it.
    A front() const {
      if constexpr (HasRes) {
        return static_cast<A>(static_cast<R>(static_cast<A>(x[0]) + static_cast<A>(residual[0])));
      } else {
        static_assert(!HasGate, "LayerNorm only: no gate");
        return static_cast<A>(x[0]);
      }
    }
  };

  template <bool HasW, bool HasB, bool HasRes, bool HasGate>
  static void forward_rows(const ForwardArgs& a) {
    const int64_t D = a.cols;
    const T* x = a.x.const_data_ptr<T>();
    const RowStrides x_rows = a.x_rows;  // D apart, but for a strided view (never with a residual)
    const R* residual = HasRes ? a.residual.const_data_ptr<R>() : nullptr;
    R* h = HasRes ? a.residual_out.mutable_data_ptr<R>() : nullptr;
    T* y = a.y.defined() ? a.y.mutable_data_ptr<T>() : nullptr;  // undefined: only the quantized y asked for
    A* mean = kCentered ? a.mean.mutable_data_ptr<A>() : nullptr;
    A* rstd = a.rstd.mutable_data_ptr<A>();
    const A eps = static_cast<A>(a.eps);
    const std::optional<RowQuantizer<A>> quantize =
        a.quant.q.defined() ? std::optional<RowQuantizer<A>>(a.quant) : std::nullopt;
    const bool streaming = use_streaming_stores(a.x.nbytes() + (y != nullptr ? a.y.nbytes() : a.quant.q.nbytes()) +
                                                (HasRes ? a.residual.nbytes() + a.residual_out.nbytes() : 0));
    const bool round = a.rounding.round_normalized;
    const bool prefetch = D * static_cast<int64_t>(sizeof(T) + (HasRes ? sizeof(R) : 0)) <= kPrefetchRowBytes;
    const double offset = a.rounding.weight_offset;
    const T* z = a.gate.z.defined() ? a.gate.z.const_data_ptr<T>() : nullptr;
    const Groups groups(a.gate, D);
    at::parallel_for(0, a.rows, std::max<int64_t>(1, kGrainElements / D), [&](int64_t begin, int64_t end) {
      // h itself where it is written through the cache, else a per-thread row.
      const ThreadRow<typename InputRow<HasRes>::Kept, RowUse::kKept> kept_row(
          (HasRes && streaming) || converts_once(HasRes, D) ? D : 0);
      const auto kept = [&](int64_t r) {
        if constexpr (HasRes) {
          if (!streaming) return h + r * D;
        }
        return kept_row.data();
      };
      const bool widen = widens_params(end - begin, offset);
      const ThreadRow<A, RowUse::kWeight> weight_row(HasW && converts_param(offset) && !widen ? D : 0);
      const ThreadRow<A, RowUse::kBias> bias_row(HasB && converts_param(0) && !widen ? D : 0);
      const ThreadRow<T, RowUse::kQuantized> quantized_row(y == nullptr ? D : 0);
      // The task's rows, with the weight and bias read through pointers of type P (W widened, or acc_t).
      const auto normalize_rows = [&](const auto* w, const auto* b) {
        for (const auto r : c10::irange(begin, end)) {
          // Quantized, y is read back from cache at once: written through the cache, not streamed past it.
          T* const y_row = y != nullptr ? y + r * D : quantized_row.data();
          // Each group of a grouped gated norm is normalized as a row of its own (else one group: the row).
          groups.for_each(0, D, [&](int64_t j0, int64_t n, int64_t group) {
            const InputRow<HasRes, HasGate> in{
                x + x_rows.offset(r) + j0,
                HasRes ? residual + r * D + j0 : nullptr,
                HasRes ? h + r * D + j0 : nullptr,
                kept(r) == nullptr ? nullptr : kept(r) + j0,
                streaming,
                r + 1 < end && prefetch ? x_rows.offset(r + 1) - x_rows.offset(r) : 0,
                {z == nullptr ? nullptr : z + r * D + j0, a.gate.before, a.gate.activation}};
            forward_row<HasW, HasB>(in, y_row + j0, HasW ? w + j0 : w, HasB ? b + j0 : b, n, eps,
                                    kCentered ? &mean[r] : nullptr, rstd[r * groups.count + group],
                                    streaming && !quantize.has_value(), round);
          });
          if (quantize.has_value()) (*quantize)(y_row, r, D);
        }
      };
      if (widen) {
        normalize_rows(HasW ? a.weight.const_data_ptr<W>() : nullptr, HasB ? a.bias.const_data_ptr<W>() : nullptr);
      } else {
        normalize_rows(HasW ? param_as_acc(a.weight, offset, weight_row.data()) : nullptr,
                       HasB ? param_as_acc(a.bias, 0, bias_row.data()) : nullptr);
      }
      finish_streaming(streaming);
    });
  }

  // Per-lane (mean, M2) of `steps` whole steps of the row from element j0, the values shifted by `shift`: each lane
  // sees one element per step, so all lanes share the count. Up to kLeafSteps steps by Welford's update; longer runs
  // in halves merged with Chan's formula, so the rounding error grows with log(D), not with D (a running mean over
  // D/32 elements drifts by about an ulp per hundred steps: 10 ulps of rstd at D = 2^20 before this was cascaded).
  template <bool HasRes>
  TORCH_LN_FLATTEN static std::pair<Group<A>, Group<A>> lane_moments(const InputRow<HasRes>& in, int64_t j0,
                                                                     int64_t steps, A shift) {
    if (steps > kLeafSteps) {
      const int64_t half = steps / 2;
      auto [m, q] = lane_moments(in, j0, half, shift);
      const auto [m_rest, q_rest] = lane_moments(in, j0 + half * kStep<A>, steps - half, shift);
      const A n = static_cast<A>(steps), rest_share = static_cast<A>(steps - half) / n;
      const VA cross(static_cast<A>(half) * rest_share);  // half * rest / n
      for (const auto i : c10::irange(kU)) {
        const VA delta = m_rest[i] - m[i];
        m[i] = at::vec::fmadd(delta, VA(rest_share), m[i]);
        q[i] = at::vec::fmadd(delta * delta, cross, q[i] + q_rest[i]);
      }
      return {m, q};
    }
    // The leaf's sums of its own, as in sum_steps. Here that is not enough: GCC still zeroes their stack copies
    // with `rep stos` once per leaf (about 15% of this function's samples at D=65536 bfloat16, perf annotate).
    Group<A> m, q;
    for (const auto i : c10::irange(kU)) m[i] = q[i] = VA(A(0));
    for (const auto k : c10::irange(steps)) {
      Group<A> v = in.load_first(j0 + k * kStep<A>, kStep<A>);
      const VA inv_count(A(1) / static_cast<A>(k + 1));
      for (const auto i : c10::irange(kU)) {
        v[i] = v[i] - VA(shift);
        const VA delta = v[i] - m[i];
        m[i] = at::vec::fmadd(delta, inv_count, m[i]);
        q[i] = at::vec::fmadd(delta, v[i] - m[i], q[i]);
      }
    }
    return {m, q};
  }

  // The mean and the sum of squared deviations of a row in one read of it (the normalizing pass is the second):
  // per-lane moments (lane_moments), then the lanes merged pairwise in a fixed order (Chan et al.), then the tail
  // elements one by one. Deviations are always taken from a running mean: no E[x^2] - E[x]^2 cancellation. The
  // values are shifted by the row's first element so that the running means stay small: their rounding is then far
  // below an ulp of a large row mean, and the only rounding of that size is the final shift back.
  template <bool HasRes>
  static std::pair<A, A> row_moments(const InputRow<HasRes>& in, int64_t D) {
    const int64_t steps = D / kStep<A>;
    const A shift = in.front();
    const auto [m, q] = lane_moments(in, 0, steps, shift);
    constexpr int64_t V = VA::size();
    A lane_mean[kStep<A>], lane_m2[kStep<A>];
    for (const auto i : c10::irange(kU)) {
      m[i].store(lane_mean + i * V);
      q[i].store(lane_m2 + i * V);
    }
    // Merging two lanes of equal count c: the mean is the midpoint, M2 gains delta^2 * c / 2.
    A count = static_cast<A>(steps);
    for (int64_t width = kStep<A> / 2; width >= 1; width /= 2, count *= 2) {
      for (const auto l : c10::irange(width)) {
        const A delta = lane_mean[l + width] - lane_mean[l];
        lane_mean[l] += delta / 2;
        lane_m2[l] += lane_m2[l + width] + delta * delta * count / 2;
      }
    }
    A mean = steps > 0 ? lane_mean[0] : A(0), m2 = steps > 0 ? lane_m2[0] : A(0);
    int64_t n = steps * kStep<A>;
    if (n < D) {
      A tail[kStep<A>];
      const Group<A> t = in.load_first(n, D - n);
      for (const auto i : c10::irange(kU)) t[i].store(tail + i * VA::size());
      for (const auto j : c10::irange(n, D)) {
        const A v = tail[j - steps * kStep<A>] - shift;
        const A delta = v - mean;
        mean += delta / static_cast<A>(++n);
        m2 += delta * (v - mean);
      }
    }
    return {shift + mean, m2};
  }

  template <bool HasW, bool HasB, bool HasRes, bool HasGate, typename P>
  TORCH_LN_FLATTEN static void forward_row(const InputRow<HasRes, HasGate>& in, T* y, const P* w, const P* b, int64_t D,
                                           A eps, A* mean_out, A& rstd_out, bool streaming, bool round) {
    // The first pass over a row reads it through in.load_first; the later ones through `reload`: in.load, or for
    // converts_once rows, in.kept, which the first pass fills, so that each element is converted to acc_t once.
    auto* const converted = in.kept;  // acc_t wherever it is used: converts_once rows have no residual
    const auto load = [&](int64_t j, int64_t c) { return in.load(j, c); };
    const auto normalize_reading = [&](const auto& reload, bool fill_converted) {
      const auto first_pass = [&](int64_t j, int64_t c) {
        const Group<A> v = in.load_first(j, c);
        if (fill_converted) store_group<A>(converted + j, v, c);
        return v;
      };
      A mean = 0, sum_sq = 0;
      if constexpr (kCentered) {
        mean = row_sums<A, 1>(D, [&](int64_t j, int64_t c) { return Sums<A, 1>{first_pass(j, c)}; })[0] / D;
        // Two-pass variance over a row still in cache, centered on the mean: no E[x^2] - E[x]^2 cancellation.
        sum_sq = row_sums<A, 1>(D, [&](int64_t j, int64_t c) {
          Group<A> v = reload(j, c);
          for (auto& e : v) {
            const VA d = e - VA(mean);
            e = d * d;
          }
          return Sums<A, 1>{v};
        })[0];
      } else {
        sum_sq = row_sums<A, 1>(D, [&](int64_t j, int64_t c) {
          Group<A> v = first_pass(j, c);
          for (auto& e : v) e = e * e;
          return Sums<A, 1>{v};
        })[0];
      }
      // The last pass reads the row from cache: the next row's loads keep memory busy meanwhile.
      const auto reload_prefetching = [&](int64_t j, int64_t c) {
        in.prefetch_next(j);
        return reload(j, c);
      };
      write_row<HasW, HasB, HasGate>(reload_prefetching, y, w, b, D, eps, mean, sum_sq, mean_out, rstd_out, streaming,
                                     round, in.gate);
    };
    if (D * static_cast<int64_t>(sizeof(A)) > kTwoPassRowBytes) {
      if constexpr (kCentered) {
        const auto [mean, sum_sq] = row_moments(in, D);
        write_row<HasW, HasB, HasGate>(load, y, w, b, D, eps, mean, sum_sq, mean_out, rstd_out, streaming, round,
                                       in.gate);
        return;
      }
      normalize_reading(load, false);  // RMSNorm: one statistics pass at any length
    } else if (converts_once(HasRes, D)) {
      normalize_reading([&](int64_t j, int64_t c) { return load_group<A>(converted + j, c); }, true);
    } else {
      normalize_reading(load, false);
    }
  }

  // Stores the statistics and writes y = normalized row * w + b (times act(z) with a gate after it); `load`
  // gives the row as acc_t. `round`: the normalized row is rounded to T before the weight multiply.
  template <bool HasW, bool HasB, bool HasGate, typename Load, typename P>
  static void write_row(const Load& load, T* y, const P* w, const P* b, int64_t D, A eps, A mean, A sum_sq, A* mean_out,
                        A& rstd_out, bool streaming, bool round, const RowGate& gate) {
    const A rstd = A(1) / std::sqrt(sum_sq / D + eps);
    if constexpr (kCentered) *mean_out = mean;
    rstd_out = rstd;
    for_each_step<A>(
        D,
        [&](int64_t j, int64_t c) {
          Group<A> v = normalize(load(j, c), mean, rstd);
          if constexpr (HasW && HasB) {  // one rounding: xhat * w + b fused
            const Group<A> wv = load_group<A>(w + j, c), bv = load_group<A>(b + j, c);
            for (const auto i : c10::irange(kU)) v[i] = at::vec::fmadd(v[i], wv[i], bv[i]);
          } else if constexpr (HasB) {
            const Group<A> bv = load_group<A>(b + j, c);
            for (const auto i : c10::irange(kU)) v[i] = v[i] + bv[i];
          } else {
            round_to_input_if(v, round);
            v = times_weight<HasW>(v, w + j, c);
            if constexpr (HasGate) {
              if (gate.gates_output()) {
                round_to_input_if(v, round && kRoundsWeighted<HasW>);
                gate.multiply(v, j, c);
              }
            }
          }
          store_output<A>(y + j, v, c, streaming);
        },
        streaming ? elements_to_alignment(y) : 0);
  }

  // ---- backward ----

  // WantDx: the input's gradient is computed (for dx, or for a gate before the norm, for dgate).
  static void backward(const BackwardArgs& a) {
    const bool want_dx = a.dx.defined() || (a.dgate.defined() && a.gate.before);
    const auto with_gate = [&](auto has_gate) {
      with_flag(a.weight.defined(),
                [&](auto has_w) { with_flag(want_dx, [&](auto wants) { backward_rows<has_w, wants, has_gate>(a); }); });
    };
    if constexpr (kGateable) {
      if (is_gated(a.gate)) return with_gate(std::true_type{});  // instances of their own, as the forward's
    }
    with_gate(std::false_type{});
  }

  // Row chunks of the backward: at least kMinChunks for parallelism, more for large M while each keeps
  // kRowsPerChunk rows and kChunkInputBytes of dy. The partial rows near the root of the chunk tree (ChunkTree) are
  // written by one thread and read by another: for small inputs with short rows, cache lines that move between
  // cores. Measured on the 2-core dev VM, float32 backward, 1 MiB, 2 threads, three processes of 15 alternations of
  // the two rules: D = 256 / 512 (64 / 32 chunks of 16 rows before, 8 now), time now / before, medians 0.92-0.94 /
  // 0.92-0.97.
  static constexpr int64_t kMinChunks = 8;
  static constexpr int64_t kMaxChunks = 64;  // and at most this many (ChunkTree keeps an entry per chunk)
  static constexpr int64_t kRowsPerChunk = 16;
  static constexpr int64_t kChunkInputBytes = 128 * 1024;
  // Below this many rows the chunks' partial rows would be over a quarter of the traffic and of the memory (8 chunks
  // of a 16-row input double it; measured: 0.5x torch's speed when glibc then returns and re-faults the pages each
  // call), so the backward splits columns instead. At 32 rows both ways measure alike; at 64 the row chunks win by
  // 10-20% (rows re-read from L2, not memory).
  static constexpr int64_t kMinRowsForChunks = 32;

  // Columns a task of the column-split backward sums at a time: their dweight/dbias sums stay in L1.
  static constexpr int64_t kColumnBlock = 2048;

  template <bool HasW, bool WantDx, bool HasGate>
  static void backward_rows(const BackwardArgs& a) {
    const Rows rows{a, as_acc(a.weight, a.rounding.weight_offset)};
    if (a.rows < kMinRowsForChunks) {
      backward_by_columns<HasW, WantDx, HasGate>(a, rows);
    } else {
      backward_by_row_chunks<HasW, WantDx, HasGate>(a, rows);
    }
  }

  // The backward's inputs and dx, row by row.
  struct Rows {
    Rows(const BackwardArgs& a, at::Tensor weight_acc)
        : D(a.cols),
          dy(a.dy.const_data_ptr<T>()),
          x(a.x.const_data_ptr<R>()),
          x_rows(a.x_rows),
          dx(a.dx.defined() ? a.dx.mutable_data_ptr<R>() : nullptr),
          grad_residual_out(a.grad_residual_out.defined() ? a.grad_residual_out.const_data_ptr<R>() : nullptr),
          weight(std::move(weight_acc)),
          w(weight.defined() ? weight.const_data_ptr<A>() : nullptr),
          mean(kCentered ? a.mean.const_data_ptr<A>() : nullptr),
          rstd(a.rstd.const_data_ptr<A>()),
          from_output(a.from_output),
          inverse_weight(a.inverse_weight),
          inv_w(inverse_weight.defined() ? inverse_weight.const_data_ptr<A>() : nullptr),
          streaming(a.dx.defined() &&
                    use_streaming_stores(a.dy.nbytes() + a.x.nbytes() + a.dx.nbytes() +
                                         (a.grad_residual_out.defined() ? a.grad_residual_out.nbytes() : 0))),
          round(a.rounding.round_normalized),
          z(a.gate.z.defined() ? a.gate.z.const_data_ptr<T>() : nullptr),
          dz(a.dgate.defined() ? a.dgate.mutable_data_ptr<T>() : nullptr),
          gate_before(a.gate.before),
          activation(a.gate.activation),
          groups(a.gate, a.cols) {}
    int64_t D;
    const T* dy;
    const R* x;
    RowStrides x_rows;  // where each row of x starts (D apart, but for a strided view)
    R* dx;
    const R* grad_residual_out;  // added to dx; null when there is none
    at::Tensor weight;           // acc_t
    const A* w;
    const A *mean, *rstd;
    bool from_output;           // x is the forward's output (BackwardArgs::from_output)
    at::Tensor inverse_weight;  // 1 / (weight + offset) where x is the output and there is a weight
    const A* inv_w;
    bool streaming;
    bool round;  // Llama-style rounding (RoundingOptions::round_normalized)
    const T* z;  // a gated norm's gate (null: none) and its gradient (null: not wanted)
    T* dz;
    bool gate_before;
    GateActivation activation;
    Groups groups;

    RowGate gate(int64_t r, int64_t j0) const {
      return {z == nullptr ? nullptr : z + r * D + j0, gate_before, activation};
    }
    // The rstd of row r's group that holds column j0.
    A rstd_of(int64_t r, int64_t j0) const { return rstd[r * groups.count + j0 / groups.size]; }

    // A step of a gated row as the norm saw it: dy becomes the weighted value's gradient dy * act(z) with a gate
    // after the norm (rounded to T where that value is: autograd's dtype cast), x becomes h = x * act(z) with a gate
    // before it. `act`, if given, receives act(z), and `slope` its derivative. Nothing to do without a gate.
    template <bool HasW>
    void apply_gate(const RowGate& gate, Group<A>& dy, Group<A>& x, int64_t j, int64_t c, Group<A>* act = nullptr,
                    Group<A>* slope = nullptr) const {
      if (gate.z == nullptr) return;
      const Group<A> a = gate.act(j, c, slope);
      Group<A>& gated = gate.before ? x : dy;
      for (const auto i : c10::irange(kU)) gated[i] = gated[i] * a[i];
      if (!gate.before) round_to_input_if(dy, round && kRoundsWeighted<HasW>);
      if (act != nullptr) *act = a;
    }

    // g = dy * w, rounded to T under Llama-style rounding (autograd's dtype cast passes the gradient on in T).
    template <bool HasW>
    Group<A> weighted(const Group<A>& dy, int64_t j, int64_t c) const {
      Group<A> g = times_weight<HasW>(dy, w + j, c);
      round_to_input_if(g, round);
      return g;
    }

    // The dweight term dy * xhat; under Llama-style rounding, the rounded xhat and the product rounded to T.
    Group<A> weight_term(const Group<A>& dy, Group<A> xhat) const {
      round_to_input_if(xhat, round);
      for (const auto i : c10::irange(kU)) xhat[i] = dy[i] * xhat[i];
      round_to_input_if(xhat, round);
      return xhat;
    }

    A mean_of(int64_t r) const { return kCentered ? mean[r] : A(0); }

    // xhat of elements [j, j + c) of a row from their values v: (x - mean) * rstd, or where the rows are the
    // forward's output (memory_efficient) y / (weight + offset), as y * inverse_weight.
    Group<A> xhat(Group<A> v, int64_t j, int64_t c, A mean, A rstd) const {
      if (!from_output) return normalize(v, mean, rstd);
      if (inv_w != nullptr) {
        const Group<A> inv = load_group<A>(inv_w + j, c);
        for (const auto i : c10::irange(kU)) v[i] = v[i] * inv[i];
      }
      return v;
    }
  };

  // Each chunk of rows: per row, the gradient means, then dx and the row's dweight/dbias terms added to the chunk's
  // partial rows; the partials are then summed over chunks in a fixed tree (ChunkTree).
  template <bool HasW, bool WantDx, bool HasGate>
  static void backward_by_row_chunks(const BackwardArgs& a, const Rows& rows) {
    const int64_t M = a.rows, D = a.cols;
    const int64_t chunks = backward_chunks(M, D);
    // The calling thread's buffer, reused: allocated per call, the partials (128 KiB and up) were fresh glibc mappings
    // faulted in each time (float32 64 x 4096, 2 threads, default malloc: 150 us a backward, 83 with freed memory
    // kept).
    const int64_t part_rows = chunks * D;
    const ThreadRow<A, RowUse::kPartials, kPartialBytes> partial_buffer((a.dweight.defined() + a.dbias.defined()) *
                                                                        part_rows);
    A* dw_part = a.dweight.defined() ? partial_buffer.data() : nullptr;
    A* db_part = a.dbias.defined() ? partial_buffer.data() + (a.dweight.defined() ? part_rows : 0) : nullptr;

    // Measured: prefetching the next row during the dx pass pays off from 4 KB rows up (smaller ones: the hardware
    // prefetcher keeps up). The forward prefetches in its last pass too (kPrefetchRowBytes).
    const bool prefetch = D * static_cast<int64_t>(sizeof(T)) >= 4096;
    ChunkTree tree{chunks, D, {dw_part, db_part}};
    at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      for (const auto chunk : c10::irange(chunk_begin, chunk_end)) {
        const int64_t row_begin = chunk * M / chunks, row_end = (chunk + 1) * M / chunks;
        for (const auto r : c10::irange(row_begin, row_end)) {
          rows.groups.for_each(0, D, [&](int64_t j0, int64_t n, int64_t /*group*/) {
            const auto [g_mean, gx_mean] = gradient_means<HasW, WantDx, HasGate>(rows, r, j0, n);
            backward_columns<HasW, WantDx, HasGate>(
                rows, r, j0, n, g_mean, gx_mean, dw_part ? dw_part + chunk * D + j0 : nullptr,
                db_part ? db_part + chunk * D + j0 : nullptr, r == row_begin, prefetch && r + 1 < row_end);
          });
        }
      }
      finish_streaming(rows.streaming);
      tree.sum_owned(0, chunks, chunk_begin, chunk_end);
    });

    // The rest of the tree, parallel over columns: columns are independent, so any column split gives the same bits.
    const int64_t grain = std::max<int64_t>(kStep<A>, kGrainElements / chunks);
    for (const auto& [gradient_parts, out] : {std::pair{dw_part, a.dweight}, std::pair{db_part, a.dbias}}) {
      if (gradient_parts == nullptr) continue;
      W* out_data = out.template mutable_data_ptr<W>();
      at::parallel_for(0, D, grain, [&](int64_t begin, int64_t end) {
        tree.sum_root(gradient_parts, out_data + begin, begin, end - begin);
      });
    }
  }

  // The chunks' partial rows are summed in a binary tree whose shape depends on the chunk count only (node [lo, hi)
  // has children [lo, mid) and [mid, hi), mid = (lo + hi) / 2; its sum goes into row lo), so the bits don't depend
  // on the thread count. A thread sums the nodes whose chunks it ran itself, while their rows are in its cache; the
  // rest, near the root, is summed afterwards (sum_root). Why: summed by another thread, every partial row crossed
  // cores each call (float32 1024 x 256 backward, 2 threads: dweight/dbias alone took 106-116 us in some processes,
  // 54-64 in others).
  struct ChunkTree {
    int64_t chunks, D;
    std::array<A*, 2> partials;  // dweight and dbias partial rows (null when not wanted)
    // Row lo holds the sum of chunks [lo, summed_end[lo]): at first, each row its own chunk's.
    std::array<int64_t, kMaxChunks> summed_end = [] {
      std::array<int64_t, kMaxChunks> end{};
      std::iota(end.begin(), end.end(), int64_t{1});
      return end;
    }();

    // Sums, in every partial buffer, the nodes within [lo, hi) whose chunks all lie in [own_begin, own_end).
    void sum_owned(int64_t lo, int64_t hi, int64_t own_begin, int64_t own_end) {
      if (hi - lo == 1 || hi <= own_begin || own_end <= lo) return;
      if (own_begin <= lo && hi <= own_end) {
        for (A* p : partials) {
          if (p != nullptr) sum_node(p, lo, hi, p + lo * D, 0, D);
        }
        summed_end[lo] = hi;
        return;
      }
      const int64_t mid = (lo + hi) / 2;
      sum_owned(lo, mid, own_begin, own_end);
      sum_owned(mid, hi, own_begin, own_end);
    }

    // out[0, n) = the sum of all chunks' partial rows in columns [j0, j0 + n).
    void sum_root(A* p, W* out, int64_t j0, int64_t n) const { sum_node(p, 0, chunks, out, j0, n); }

    // out[0, n) = the sum of node [lo, hi)'s partial rows in columns [j0, j0 + n); unsummed children are summed into
    // their rows first.
    template <typename Out>
    void sum_node(A* p, int64_t lo, int64_t hi, Out* out, int64_t j0, int64_t n) const {
      const A* row = p + lo * D + j0;
      if (summed_end[lo] == hi) {  // a leaf, or summed by the thread that ran its chunks
        if (static_cast<const void*>(out) != row) copy_row(row, out, n);
        return;
      }
      const int64_t mid = (lo + hi) / 2;
      sum_node(p, lo, mid, p + lo * D + j0, j0, n);
      sum_node(p, mid, hi, p + mid * D + j0, j0, n);
      add_rows(row, p + mid * D + j0, out, n);
    }
  };

  // Few rows: the gradient means of every row first (parallel over rows), then dx and dweight/dbias parallel over
  // column blocks, each block's parameter gradients summed over all rows in row order: no partial rows at all.
  template <bool HasW, bool WantDx, bool HasGate>
  static void backward_by_columns(const BackwardArgs& a, const Rows& rows) {
    const int64_t M = a.rows, D = a.cols;
    const Groups& groups = rows.groups;
    std::vector<std::pair<A, A>> means(M * groups.count);  // per row and group
    if constexpr (WantDx) {
      at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        for (const auto r : c10::irange(begin, end)) {
          groups.for_each(0, D, [&](int64_t j0, int64_t n, int64_t group) {
            means[r * groups.count + group] = gradient_means<HasW, WantDx, HasGate>(rows, r, j0, n);
          });
        }
      });
    }
    W* dweight = a.dweight.defined() ? a.dweight.template mutable_data_ptr<W>() : nullptr;
    W* dbias = a.dbias.defined() ? a.dbias.template mutable_data_ptr<W>() : nullptr;
    const int64_t blocks = (D + kColumnBlock - 1) / kColumnBlock;
    at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
      alignas(64) A dw_sum[kColumnBlock], db_sum[kColumnBlock];
      for (const auto block : c10::irange(block_begin, block_end)) {
        const int64_t j0 = block * kColumnBlock, n = std::min(kColumnBlock, D - j0);
        for (const auto r : c10::irange(M)) {
          groups.for_each(j0, n, [&](int64_t j, int64_t piece, int64_t group) {
            const auto [g_mean, gx_mean] = means[r * groups.count + group];
            backward_columns<HasW, WantDx, HasGate>(rows, r, j, piece, g_mean, gx_mean,
                                                    dweight ? dw_sum + (j - j0) : nullptr,
                                                    dbias ? db_sum + (j - j0) : nullptr, r == 0, false);
          });
        }
        for (const auto& [sum, out] : {std::pair{dw_sum, dweight}, std::pair{db_sum, dbias}}) {
          if (out != nullptr) copy_row(sum, out + j0, n);
        }
      }
      finish_streaming(rows.streaming);
    });
  }

  // mean(g) and mean(g * xhat) of row r's columns [j0, j0 + n) (the row, or a group of a grouped gated norm), g = dy
  // * w (RMSNorm: mean(g) unused, 0). Zero when dx is not wanted.
  template <bool HasW, bool WantDx, bool HasGate>
  static std::pair<A, A> gradient_means(const Rows& rows, int64_t r, int64_t j0, int64_t n) {
    if constexpr (!WantDx) {
      return {A(0), A(0)};
    } else {
      const T* dy = rows.dy + r * rows.D + j0;
      const R* x = rows.x + rows.x_rows.offset(r) + j0;
      const RowGate gate = rows.gate(r, j0);
      const A mean = rows.mean_of(r);
      const auto sums = row_sums<A, 2>(n, [&](int64_t j, int64_t c) {
        Group<A> dyv = load_group<A>(dy + j, c), xv = load_group<A>(x + j, c);
        if constexpr (HasGate) rows.template apply_gate<HasW>(gate, dyv, xv, j, c);
        Sums<A, 2> t{rows.template weighted<HasW>(dyv, j0 + j, c), xv};
        if (rows.from_output) {  // g * xhat, xhat recovered from y
          t[1] = rows.xhat(t[1], j0 + j, c, mean, A(1));
          for (const auto i : c10::irange(kU)) t[1][i] = t[0][i] * t[1][i];
        } else {  // g * (x - mean), times rstd once the row is summed
          for (const auto i : c10::irange(kU)) t[1][i] = t[0][i] * (kCentered ? t[1][i] - VA(mean) : t[1][i]);
        }
        return t;
      });
      return {kCentered ? sums[0] / n : A(0), sums[1] * (rows.from_output ? A(1) : rows.rstd_of(r, j0)) / n};
    }
  }

  // Columns [j0, j0 + n) of row r (within one group of a grouped gated norm): dx = rstd * (g - mean(g) - xhat *
  // mean(g * xhat)) (+ grad_residual_out) with g = dy * w, and the row's dweight (dy * xhat) and dbias (dy) terms
  // added to dw_sum / db_sum (null when not wanted; indexed from j0), which the first row initializes. With a gate:
  // after the norm, dy is dy * act(z) and dz = dy * (weighted value) * act'(z); before it, x is h = x * act(z), the
  // input's gradient dh becomes dx = dh * act(z) and dz = dh * x * act'(z).
  template <bool HasW, bool WantDx, bool HasGate>
  TORCH_LN_FLATTEN static void backward_columns(const Rows& rows, int64_t r, int64_t j0, int64_t n, A g_mean, A gx_mean,
                                                A* dw_sum, A* db_sum, bool first, bool prefetch_next) {
    const int64_t D = rows.D;
    const T* dy = rows.dy + r * D + j0;
    const R* x = rows.x + rows.x_rows.offset(r) + j0;
    const int64_t next_x = prefetch_next ? rows.x_rows.offset(r + 1) - rows.x_rows.offset(r) : 0;
    R* dx = rows.dx != nullptr ? rows.dx + r * D + j0 : nullptr;
    const R* extra = WantDx && rows.grad_residual_out != nullptr ? rows.grad_residual_out + r * D + j0 : nullptr;
    const A mean = rows.mean_of(r), rstd = rows.rstd_of(r, j0);
    const RowGate gate = rows.gate(r, j0);
    T* dz = rows.dz != nullptr ? rows.dz + r * D + j0 : nullptr;
    for_each_step<A>(
        n,
        [&](int64_t j, int64_t c) {
          if (prefetch_next) {
            prefetch_step<A>(dy + D + j);
            prefetch_step<A>(x + next_x + j);
          }
          Group<A> dyv = load_group<A>(dy + j, c), xv = load_group<A>(x + j, c);
          [[maybe_unused]] Group<A> raw_dy, raw_x, act, slope;
          if constexpr (HasGate) {
            raw_dy = dyv;
            raw_x = xv;
            rows.template apply_gate<HasW>(gate, dyv, xv, j, c, &act, dz != nullptr ? &slope : nullptr);
          }
          const Group<A> xhat = rows.xhat(xv, j0 + j, c, mean, rstd);
          if constexpr (WantDx) {
            Group<A> g = rows.template weighted<HasW>(dyv, j0 + j, c);
            for (const auto i : c10::irange(kU)) {
              g[i] = at::vec::fmadd(xhat[i], VA(-gx_mean), g[i] - VA(g_mean)) * VA(rstd);
            }
            if (extra != nullptr) {
              const Group<A> e = load_group<A>(extra + j, c);
              for (const auto i : c10::irange(kU)) g[i] = g[i] + e[i];
            }
            if constexpr (HasGate) {
              if (gate.gates_input()) {  // g is dh: dz = dh * x * act'(z), dx = dh * act(z)
                if (dz != nullptr) store_gate_gradient(dz + j, g, raw_x, slope, c);
                for (const auto i : c10::irange(kU)) g[i] = g[i] * act[i];
              }
              if (dx != nullptr) store_output<A>(dx + j, g, c, rows.streaming);
            } else {
              store_output<A>(dx + j, g, c, rows.streaming);
            }
          }
          if constexpr (HasGate) {
            if (dz != nullptr && gate.gates_output()) {  // the weighted value, as the forward rounded it
              Group<A> weighted = xhat;
              round_to_input_if(weighted, rows.round);
              weighted = times_weight<HasW>(weighted, rows.w + j0 + j, c);
              round_to_input_if(weighted, rows.round && kRoundsWeighted<HasW>);
              store_gate_gradient(dz + j, raw_dy, weighted, slope, c);
            }
          }
          if (dw_sum != nullptr) {
            const Group<A> term = rows.weight_term(dyv, xhat);
            accumulate(dw_sum + j, c, first, [&](int i) { return term[i]; });
          }
          if (db_sum != nullptr) accumulate(db_sum + j, c, first, [&](int i) { return dyv[i]; });
        },
        rows.streaming ? elements_to_alignment(dx) : 0);
  }

  // dz[0, c) = grad * value * slope: a gate's gradient.
  static void store_gate_gradient(T* dz, const Group<A>& grad, const Group<A>& value, Group<A> slope, int64_t c) {
    for (const auto i : c10::irange(kU)) slope[i] = grad[i] * value[i] * slope[i];
    store_group<A>(dz, slope, c);
  }

  // part[0, c) = term (first row of a chunk) or part + term.
  template <typename Term>
  static void accumulate(A* part, int64_t c, bool first, const Term& term) {
    Group<A> v;
    if (!first) v = load_group<A>(part, c);
    for (const auto i : c10::irange(kU)) v[i] = first ? term(i) : v[i] + term(i);
    store_group<A>(part, v, c);
  }

  // out[j] = a[j] + b[j] for j in [0, n).
  template <typename Out>
  TORCH_LN_FLATTEN static void add_rows(const A* a, const A* b, Out* out, int64_t n) {
    for_each_step<A>(n, [&](int64_t j, int64_t c) {
      Group<A> sum = load_group<A>(a + j, c);
      const Group<A> other = load_group<A>(b + j, c);
      for (const auto i : c10::irange(kU)) sum[i] += other[i];
      store_group<A>(out + j, sum, c);
    });
  }

  // out[j] = row[j] (converted to Out) for j in [0, n).
  template <typename Out>
  TORCH_LN_FLATTEN static void copy_row(const A* row, Out* out, int64_t n) {
    for_each_step<A>(n, [&](int64_t j, int64_t c) { store_group<A>(out + j, load_group<A>(row + j, c), c); });
  }

  // Row chunks of the backward pass, a function of (M, D, T) only so the gradients don't depend on the thread count:
  // kMinChunks, more for large inputs (up to kMaxChunks) while each keeps kRowsPerChunk rows and kChunkInputBytes of dy
  // so the partials and their reduction stay small next to the row pass; dweight + dbias partials capped at
  // kPartialBytes.
  static constexpr int64_t kPartialBytes = int64_t{16} << 20;
  static int64_t backward_chunks(int64_t M, int64_t D) {
    const int64_t by_memory = kPartialBytes / (2 * D * static_cast<int64_t>(sizeof(A)));
    const int64_t by_size = std::min(M / kRowsPerChunk, M * D * static_cast<int64_t>(sizeof(T)) / kChunkInputBytes);
    return std::max<int64_t>(1, std::min({kMaxChunks, by_memory, std::max(kMinChunks, by_size)}));
  }
};

}  // namespace
}  // namespace torch_ln

#ifdef TORCH_LN_TARGET_AVX2
#pragma GCC pop_options
#endif

namespace torch_ln {
namespace {

void check_cpu_support() {
#ifdef TORCH_LN_TARGET_AVX2
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  TORCH_CHECK(supported, "torch_ln: the CPU kernels need a CPU with AVX2 and FMA");
#endif
}

template <typename F>
void dispatch_kind(NormKind kind, const F& f) {
  kind == NormKind::LayerNorm ? f(std::integral_constant<NormKind, NormKind::LayerNorm>{})
                              : f(std::integral_constant<NormKind, NormKind::RMSNorm>{});
}

template <typename Types>
void forward_kernels(NormKind kind, const ForwardArgs& args) {
  check_cpu_support();
  dispatch_kind(kind, [&](auto k) { NormCpu<decltype(k)::value, Types>::forward(args); });
}

template <typename Types>
void backward_kernels(NormKind kind, const BackwardArgs& args) {
  check_cpu_support();
  dispatch_kind(kind, [&](auto k) { NormCpu<decltype(k)::value, Types>::backward(args); });
}

}  // namespace
}  // namespace torch_ln

// Defines cpu_forward and cpu_backward (norm_cpu.h) for one dtype combination (DtypePair's arguments), inside
// namespace torch_ln. They are explicit specializations, not instantiations of a template defined here: the kernels
// keep internal linkage (as one file had them, so GCC may clone and specialize them freely), and a template
// definition naming them in several files would break the one-definition rule.
#define TORCH_LN_DEFINE_CPU_KERNELS(...)                                               \
  template <>                                                                          \
  void cpu_forward<DtypePair<__VA_ARGS__>>(NormKind kind, const ForwardArgs& args) {   \
    forward_kernels<DtypePair<__VA_ARGS__>>(kind, args);                               \
  }                                                                                    \
  template <>                                                                          \
  void cpu_backward<DtypePair<__VA_ARGS__>>(NormKind kind, const BackwardArgs& args) { \
    backward_kernels<DtypePair<__VA_ARGS__>>(kind, args);                              \
  }
