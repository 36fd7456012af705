#pragma once

namespace torch_ln {

// Which normalization a kernel computes. RMSNorm is LayerNorm without the mean
// term, so every kernel is one template over this parameter.
enum class NormKind { LayerNorm, RMSNorm };

}  // namespace torch_ln
