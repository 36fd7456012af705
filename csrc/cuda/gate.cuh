// A gated RMSNorm's gate on the device (GateArgs, csrc/norm.h), and the rows a unit of a grouped one walks.
#pragma once

#include <type_traits>

#include "../norm_kind.h"
#include "reduce.cuh"

namespace torch_ln {

// The gate z of the kernels' rows: act(z) and its slope d act / dz in acc_t, as torch computes them:
// silu(z) = z / (1 + exp(-z)), sigmoid(z) = 1 / (1 + exp(-z)), silu' = s (1 + z (1 - s)), sigmoid' = s (1 - s).
// A grouped norm's groups are the kernels' rows (cols = group_size, rows = M * groups), so z and dz, [M, D]
// contiguous, are indexed as y is.
template <typename T>
struct DeviceGate {
  const T* z = nullptr;  // nullptr: no gate (a plain RMSNorm, grouped)
  T* dz = nullptr;       // the backward's gradient of z; nullptr: not requested
  bool before = false;   // y = rmsnorm(x * act(z)); else rmsnorm(x) * act(z)
  GateActivation activation = GateActivation::Silu;
  int64_t groups = 1;  // of a row of the input: consecutive kernel rows

  TLN_DEVICE bool gates_input() const { return z != nullptr && before; }
  TLN_DEVICE bool gates_output() const { return z != nullptr && !before; }

  // act(z) and its slope for the vector of z at element offset i.
  template <int VEC, typename acc_t>
  TLN_DEVICE void act(int64_t i, acc_t (&a)[VEC], acc_t (&slope)[VEC]) const {
    load_vec<VEC>(z, i, a);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const acc_t denominator = acc_t(1) + dev::exp(-a[j]);
      const acc_t s = acc_t(1) / denominator;
      const bool silu = activation == GateActivation::Silu;
      slope[j] = silu ? s * (acc_t(1) + a[j] * (acc_t(1) - s)) : s * (acc_t(1) - s);
      a[j] = silu ? a[j] / denominator : s;
    }
  }

  // v *= act(z) for the vector at element offset i.
  template <int VEC, typename acc_t>
  TLN_DEVICE void multiply(int64_t i, acc_t (&v)[VEC]) const {
    acc_t a[VEC], unused[VEC];
    act(i, a, unused);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] *= a[j];
  }
};

// Whether a gate after the norm multiplies the weighted value rounded to the input dtype: under Llama-style rounding,
// where that product is in the input dtype (Qwen3-Next's `weight * x.to(dtype)`): the weight has it, or there is
// none, whose calls have W = T too (dispatch.h's parameter_dtype). Params: the forward's or the backward's.
template <typename T, typename W, typename Params>
TLN_DEVICE bool rounds_weighted(const Params& p) {
  return std::is_same_v<W, T> && p.rounding.round_normalized;
}

// The rows a unit (a block) walks, for a norm of `groups` groups a row: a grouped gated norm's kernel rows are
// m * groups + group (DeviceGate), and the grid's units of one group (block % groups) walk that group's rows only,
// so that the group's slice of the weight, and of the weight-gradient sums, serves every row a unit sees; the
// unit's partial row (block x group_size) is then its group's slice of a partial row D wide. groups == 1: every
// row, block by block.
struct GroupWalk {
  int64_t groups, group, unit, units;

  TLN_DEVICE explicit GroupWalk(int64_t g)
      : groups(g), group(dev::block_x() % g), unit(dev::block_x() / g), units(dev::grid_dim_x() / g) {}
  TLN_DEVICE int64_t row(int64_t batch_row) const { return batch_row * groups + group; }
};

// This block's walk in a kernel's GATED instances (the weight pointer moved to its group's slice) or the others.
template <bool GATED, typename Params>
TLN_DEVICE GroupWalk group_walk(Params& p) {
  if constexpr (GATED) {
    const GroupWalk walk(p.gate.groups);
    if (p.weight != nullptr) p.weight += walk.group * p.cols;
    return walk;
  } else {
    return GroupWalk(1);
  }
}

}  // namespace torch_ln
