#pragma once

#include <cstdint>

namespace torch_ln {

// Which normalization a kernel computes. RMSNorm is LayerNorm without the mean
// term, so every kernel is one template over this parameter.
enum class NormKind { LayerNorm, RMSNorm };

// The activation of a gated RMSNorm's gate (GateArgs, csrc/norm.h).
enum class GateActivation : int8_t { Silu, Sigmoid };

}  // namespace torch_ln
