"""torch_ln: fast, deterministic LayerNorm and RMSNorm for PyTorch, as torch.library operators.

Entry points: :func:`layer_norm`, :func:`rms_norm` (functional), :class:`LayerNorm`,
:class:`RMSNorm` (drop-ins for the torch.nn modules) and :func:`replace_norms`; the fused residual
add + norm of pre-norm transformers: :func:`add_layer_norm`, :func:`add_rms_norm`,
:class:`AddLayerNorm`, :class:`AddRMSNorm`.
"""

from torch_ln import _extension

_extension.load()

from torch_ln.modules import AddLayerNorm, AddRMSNorm, LayerNorm, RMSNorm, replace_norms
from torch_ln.ops import add_layer_norm, add_rms_norm, layer_norm, rms_norm

__all__ = [
    "AddLayerNorm",
    "AddRMSNorm",
    "LayerNorm",
    "RMSNorm",
    "add_layer_norm",
    "add_rms_norm",
    "layer_norm",
    "replace_norms",
    "rms_norm",
]
