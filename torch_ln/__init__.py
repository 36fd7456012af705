"""torch_ln: fast, deterministic LayerNorm and RMSNorm for PyTorch, as torch.library operators.

Entry points: :func:`layer_norm`, :func:`rms_norm` (functional), :class:`LayerNorm`,
:class:`RMSNorm` (drop-ins for the torch.nn modules), :func:`replace_norms` (also for transformers' and
timm's norm classes, see :mod:`torch_ln.integrations`) and :func:`register_norm`.
"""

from torch_ln import _extension

_extension.load()

from torch_ln import integrations
from torch_ln.modules import LayerNorm, RMSNorm, forward_converter, register_norm, replace_norms
from torch_ln.ops import layer_norm, rms_norm

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "forward_converter",
    "integrations",
    "layer_norm",
    "register_norm",
    "replace_norms",
    "rms_norm",
]
