// The quantized output of the *_quant operators: the arithmetic the CPU kernels and the CUDA kernel share, so that
// both give torch_ln.reference.quantize bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "row_strides.h"  // TLN_HOST_DEVICE

namespace torch_ln {

enum class QuantFormat : int8_t { Float8E4M3, Float8E5M2, Int8 };

// How one call quantizes y. Dynamic scales are one per group of `group` elements along the row (a token's whole row
// for per-token scales); a static one is given.
struct QuantSpec {
  QuantFormat format = QuantFormat::Float8E4M3;
  bool dynamic = false;
  int64_t group = 0;               // dynamic: elements per scale
  float scale_ub = INFINITY;       // dynamic: the row's (group's) amax clamped to at most this, as vLLM's scale_ub
  bool ue8m0 = false;              // dynamic: scales rounded up to a power of two (MX formats, DeepSeek's recipe)
  int64_t scale_row_stride = 0;    // dynamic: where group g of row r writes its scale, in floats:
  int64_t scale_group_stride = 0;  // r * scale_row_stride + g * scale_group_stride (row- or column-major)
};

// The largest magnitude of each format: e4m3fn saturates at 448 (the value the GEMMs expect), int8 is symmetric.
TLN_HOST_DEVICE float quant_max(QuantFormat format) {
  return format == QuantFormat::Float8E4M3 ? 448.0f : format == QuantFormat::Float8E5M2 ? 57344.0f : 127.0f;
}

// The smallest dynamic scale, vLLM's 1 / (qmax * 512): an all-zero group gets it instead of a division by zero.
TLN_HOST_DEVICE float min_dynamic_scale(QuantFormat format) { return 1.0f / (quant_max(format) * 512.0f); }

// A running amax with |v| folded in; a NaN stays (as torch.amax propagates it). F: float, or the CUDA kernels'
// accumulator (double for float64 rows, whose y values are floats' all the same).
template <typename F>
TLN_HOST_DEVICE F fold_abs_max(F running, F v) {
#if defined(__CUDA_ARCH__)
  const F a = fabs(v);
#else
  const F a = std::fabs(v);
#endif
  // Both comparisons always evaluated (| not ||): GCC if-converts only comparisons that run unconditionally.
  return (a > running) | (a != a) ? a : running;
}

// s rounded up to a power of two: the exponent raised where any mantissa bit is set (exact; log2 and ceil would
// round 2^k * (1 + 2^-23) down to 2^k). inf and NaN pass unchanged.
TLN_HOST_DEVICE float power_of_two_ceil(float s) {
  uint32_t bits;
  std::memcpy(&bits, &s, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u || (bits & 0x007fffffu) == 0) return s;
  bits = (bits & 0xff800000u) + 0x00800000u;
  std::memcpy(&s, &bits, sizeof(bits));
  return s;
}

// A dynamic group's scale from its amax: min(amax, scale_ub) / qmax, at least min_dynamic_scale, then (ue8m0) rounded
// up to a power of two. Comparisons, not fmin/fmax, so that a NaN amax gives a NaN scale.
TLN_HOST_DEVICE float dynamic_scale(float amax, const QuantSpec& spec) {
  const float clamped = amax > spec.scale_ub ? spec.scale_ub : amax;
  float scale = clamped / quant_max(spec.format);
  const float floor = min_dynamic_scale(spec.format);
  if (scale < floor) scale = floor;
  return spec.ue8m0 ? power_of_two_ceil(scale) : scale;
}

// x rounded to nearest, ties to even, for |x| <= 2^22 (every caller's x is at most 127). On the host by adding and
// subtracting 1.5 * 2^23, where the float32 sum keeps no fraction bits: std::nearbyint is a libm call per element
// under GCC's default -ftrapping-math, which kept the CPU loops from vectorizing (10x the norm's own time).
TLN_HOST_DEVICE float round_half_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  constexpr float kShift = 0x1.8p23f;  // IEEE arithmetic (no -ffast-math): (x + kShift) - kShift is not folded to x
  return (x + kShift) - kShift;
#endif
}

// A float8 code (sign bit, then 7 bits of magnitude) of q, |q| <= the format's max or NaN, rounded to nearest even:
// c10's conversion (torch's cast) bit for bit, written without branches so that the CPU loops vectorize. Normal
// values keep the top 3 (e4m3) or 2 (e5m2) mantissa bits, rounded at the dropped ones, with the exponent re-biased;
// below the smallest normal, q is a multiple of the smallest step (2^-9, 2^-16), rounded (up to the smallest normal's
// code); NaN is 0x7F with q's sign.
TLN_HOST_DEVICE uint8_t float8_code(float q, bool e4m3) {
  uint32_t bits;
  std::memcpy(&bits, &q, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u, magnitude = bits & 0x7fffffffu;
  const int dropped = e4m3 ? 20 : 21;                                         // float32 mantissa bits not kept
  const uint32_t rebias = (e4m3 ? 127u - 7u : 127u - 15u) << (23 - dropped);  // exponent bias, in code units
  const uint32_t rounded = magnitude + ((1u << (dropped - 1)) - 1u) + ((magnitude >> dropped) & 1u);
  const uint32_t normal = (rounded >> dropped) - rebias;
  float absolute;
  std::memcpy(&absolute, &magnitude, sizeof(absolute));
  const float smallest_normal = e4m3 ? 0x1p-6f : 0x1p-14f;
  // |q| in units of the smallest subnormal step, rounded (computed for every q, used below the smallest normal:
  // capped there, so that the conversion to an integer stays in range, NaN included)
  const bool is_subnormal = absolute < smallest_normal, is_nan = q != q;
  const float below_normal = is_subnormal ? absolute : smallest_normal;
  const auto subnormal = static_cast<uint32_t>(round_half_even(below_normal * (e4m3 ? 0x1p9f : 0x1p16f)));
  const uint32_t finite_code = is_subnormal ? subnormal : normal;
  const uint32_t code = is_nan ? 0x7fu : finite_code;
  return static_cast<uint8_t>(sign | code);
}

// One element: v times the float32 reciprocal of its scale, saturated to +-quant_max and cast with round to nearest
// even (int8 as torch.round). NaN: NaN in the float8 formats (as torch's cast), 0 in int8 (torch's cast of NaN to
// int8 is undefined). Returns the element's bits.
TLN_HOST_DEVICE uint8_t quantize_value(float v, float inverse_scale, QuantFormat format) {
  const float limit = quant_max(format);
  const float scaled = v * inverse_scale;
  // Saturated: each comparison evaluated unconditionally, so that the CPU loops vectorize; NaN passes both.
  const bool above = scaled > limit, below = scaled < -limit;
  const float capped = above ? limit : scaled;
  const float q = below ? -limit : capped;
  if (format == QuantFormat::Int8) {
    const bool is_nan = q != q;
    const float finite = is_nan ? 0.0f : q;
    return static_cast<uint8_t>(static_cast<int8_t>(round_half_even(finite)));
  }
  return float8_code(q, format == QuantFormat::Float8E4M3);
}

}  // namespace torch_ln
