// The CPU side of the *_quant operators: a normalized row quantized while it is still in cache, right after the
// forward wrote it (to y, or to a per-thread row when y is not asked for). Included only by norm_cpu_kernels.h,
// inside its AVX2 target region, after row_steps.h.
#pragma once

#ifndef TORCH_LN_CPU_KERNELS
#error "quantize_row.h is part of norm_cpu_kernels.h: include that instead"
#endif

#include <c10/util/irange.h>

#include <limits>
#include <type_traits>

#include "../norm.h"

namespace torch_ln {
namespace {

// max |y| over n elements in vectors (A: acc_t, float or double): NaN-propagating, as fold_abs_max, and returned as
// the positive quiet NaN that fold_abs_max gives (a vector maximum's NaN may carry the sign bit, which would reach
// the codes of the group's other elements through the scale).
template <typename A, typename T>
float abs_max(const T* y, int64_t n) {
  using VA = Vectorized<A>;
  Group<A> running;
  for (auto& r : running) r = VA(A(0));
  for_each_step<A>(n, [&](int64_t j, int64_t c) {
    const Group<A> v = load_group<A>(y + j, c);  // lanes past c are 0
    for (const auto i : c10::irange(kU)) running[i] = at::vec::maximum(running[i], v[i].abs());
  });
  for (const auto i : c10::irange(1, kU)) running[0] = at::vec::maximum(running[0], running[i]);
  const auto amax =
      static_cast<float>(at::vec::vec_reduce_all([](VA a, VA b) { return at::vec::maximum(a, b); }, running[0]));
  return amax != amax ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// The call's quantization with its pointers resolved once; A: the accumulation dtype, in which the amax is taken.
template <typename A>
struct RowQuantizer {
  const QuantSpec spec;
  uint8_t* q;
  float* scales;       // dynamic: where the scales go (spec's strides)
  float static_scale;  // static: the given scale

  explicit RowQuantizer(const QuantArgs& quant)
      : spec(quant.spec),
        q(reinterpret_cast<uint8_t*>(quant.q.mutable_data_ptr())),
        scales(spec.dynamic ? quant.scales.mutable_data_ptr<float>() : nullptr),
        static_scale(spec.dynamic ? 0.0f : *quant.scales.const_data_ptr<float>()) {}

  // Quantizes row `row` (D elements of y): per group, the amax, the scale, then each element (QuantSpec).
  template <typename T>
  void operator()(const T* y, int64_t row, int64_t D) const {
    // The format as a constant, so that quantize_value's switch folds out of the element loops.
    const auto with_format = [&](const auto& f) {
      switch (spec.format) {
        case QuantFormat::Float8E4M3:
          return f(std::integral_constant<QuantFormat, QuantFormat::Float8E4M3>{});
        case QuantFormat::Float8E5M2:
          return f(std::integral_constant<QuantFormat, QuantFormat::Float8E5M2>{});
        default:
          return f(std::integral_constant<QuantFormat, QuantFormat::Int8>{});
      }
    };
    uint8_t* const q_row = q + row * D;
    with_format([&](auto format) {
      const auto quantize = [&](int64_t begin, int64_t end, float inverse_scale) {
        for (const auto j : c10::irange(begin, end)) {
          q_row[j] = quantize_value(static_cast<float>(y[j]), inverse_scale, decltype(format)::value);
        }
      };
      if (!spec.dynamic) return quantize(0, D, 1.0f / static_scale);
      for (int64_t g = 0, first = 0; first < D; ++g, first += spec.group) {
        const float scale = dynamic_scale(abs_max<A>(y + first, spec.group), spec);
        scales[row * spec.scale_row_stride + g * spec.scale_group_stride] = scale;
        quantize(first, first + spec.group, 1.0f / scale);
      }
    });
  }
};

}  // namespace
}  // namespace torch_ln
