"""torch_ln: fast, deterministic LayerNorm and RMSNorm for PyTorch, as torch.library operators.

Entry points: :func:`layer_norm`, :func:`rms_norm` (functional), :class:`LayerNorm`,
:class:`RMSNorm` (drop-ins for the torch.nn modules) and :func:`replace_norms`.
"""

from torch_ln import _extension

_extension.load()

import torch

from torch_ln.modules import LayerNorm, RMSNorm, replace_norms
from torch_ln.ops import layer_norm, rms_norm

if torch.distributed.is_available():  # DTensor sharding strategies; builds without torch.distributed lack DTensor
    from torch_ln import _distributed  # noqa: F401

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "replace_norms", "rms_norm"]
