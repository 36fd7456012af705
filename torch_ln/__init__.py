"""torch_ln: fast, deterministic LayerNorm and RMSNorm for PyTorch, as torch.library operators.

Entry points: :func:`layer_norm`, :func:`rms_norm` (functional), :class:`LayerNorm`,
:class:`RMSNorm` (drop-ins for the torch.nn modules) and :func:`replace_norms`; for C++,
:func:`cmake_prefix_path` (find_package(torch_ln) gives the target torch_ln::torch_ln).
"""

from torch_ln import _extension

_extension.load()

from torch_ln._extension import cmake_prefix_path
from torch_ln.modules import LayerNorm, RMSNorm, replace_norms
from torch_ln.ops import layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "cmake_prefix_path", "layer_norm", "replace_norms", "rms_norm"]
