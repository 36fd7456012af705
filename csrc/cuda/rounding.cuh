// RoundingOptions (csrc/norm.h) on the device: how the weight enters the product and where it rounds.
#pragma once

#include "device.cuh"

namespace torch_ln {

template <typename acc_t>
struct DeviceRounding {
  acc_t weight_offset;    // the weight enters as (weight + offset), added in acc_t (Gemma: 1)
  bool round_normalized;  // Llama-style: xhat rounded to the input dtype before the weight multiply

  TLN_DEVICE acc_t weight(acc_t w) const { return weight_offset != acc_t(0) ? w + weight_offset : w; }

  // v rounded to the input dtype T and back under Llama-style rounding (the identity otherwise).
  template <typename T>
  TLN_DEVICE acc_t to_input(acc_t v) const {
    return round_normalized ? static_cast<acc_t>(static_cast<T>(v)) : v;
  }

  // The weight-gradient term dy * xhat; under Llama-style rounding, autograd's: the rounded xhat times dy, in T.
  template <typename T>
  TLN_DEVICE acc_t weight_term(acc_t dy, acc_t xhat) const {
    return round_normalized ? static_cast<acc_t>(static_cast<T>(dev::mul_rn(dy, to_input<T>(xhat)))) : dy * xhat;
  }
};

}  // namespace torch_ln
