"""torch_ln: fast, deterministic LayerNorm and RMSNorm for PyTorch, as torch.library operators.

Entry points: :func:`layer_norm`, :func:`rms_norm` (functional), :class:`LayerNorm`,
:class:`RMSNorm` (drop-ins for the torch.nn modules), :func:`replace_norms` (also for transformers' and
timm's norm classes, see :mod:`torch_ln.integrations`) and :func:`register_norm`; the fused residual
add + norm of pre-norm transformers: :func:`add_layer_norm`, :func:`add_rms_norm`, :class:`AddLayerNorm`,
:class:`AddRMSNorm`; norms with an fp8/int8 output for quantized inference: :func:`rms_norm_quant` and the others
(:mod:`torch_ln.quant`); QK-norm on a packed QKV projection, read in place: :func:`qk_rms_norm`;
:mod:`torch_ln.compile`, a torch.compile backend that rewrites a model's norms (inline, torch's, and
the adds before them) to these operators without swapping modules; for C++, :func:`cmake_prefix_path`
(find_package(torch_ln) gives the target torch_ln::torch_ln).
"""

from torch_ln import _extension

_extension.load()

import importlib
import importlib.abc
import importlib.util
import sys

import torch

from torch_ln import compile, integrations
from torch_ln._extension import cmake_prefix_path
from torch_ln.modules import (
    AddLayerNorm,
    AddRMSNorm,
    GatedRMSNorm,
    LayerNorm,
    RMSNorm,
    forward_converter,
    register_norm,
    replace_norms,
)
from torch_ln.ops import (
    add_layer_norm,
    add_rms_norm,
    empty_output_cache,
    gated_rms_norm,
    layer_norm,
    output_cache_bytes,
    qk_rms_norm,
    rms_norm,
)
from torch_ln.quant import (
    LayerNormQuant,
    QuantizedNorm,
    RMSNormQuant,
    add_layer_norm_quant,
    add_rms_norm_quant,
    layer_norm_quant,
    rms_norm_quant,
)


class _RegisterShardingAfterDTensorLoads(importlib.abc.MetaPathFinder):
    """Imports torch_ln._distributed (the DTensor sharding strategies) right after torch.distributed.tensor:
    importing DTensor up front would cost every `import torch_ln` seconds."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.distributed.tensor":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            importlib.import_module("torch_ln._distributed")

        spec.loader.exec_module = exec_then_register  # this module's own loader object
        return spec


if "torch.distributed.tensor" in sys.modules:
    importlib.import_module("torch_ln._distributed")
elif torch.distributed.is_available():  # builds without torch.distributed have no DTensor
    sys.meta_path.insert(0, _RegisterShardingAfterDTensorLoads())

__all__ = [
    "AddLayerNorm",
    "AddRMSNorm",
    "GatedRMSNorm",
    "LayerNorm",
    "LayerNormQuant",
    "QuantizedNorm",
    "RMSNorm",
    "RMSNormQuant",
    "add_layer_norm",
    "add_layer_norm_quant",
    "add_rms_norm",
    "add_rms_norm_quant",
    "cmake_prefix_path",
    "compile",
    "empty_output_cache",
    "forward_converter",
    "gated_rms_norm",
    "integrations",
    "layer_norm",
    "layer_norm_quant",
    "output_cache_bytes",
    "qk_rms_norm",
    "register_norm",
    "replace_norms",
    "rms_norm",
    "rms_norm_quant",
]
