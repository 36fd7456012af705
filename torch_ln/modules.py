"""Drop-in modules for torch.nn.LayerNorm and torch.nn.RMSNorm, and the swap-in helper."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torch_ln import ops

__all__ = ["AddLayerNorm", "AddRMSNorm", "LayerNorm", "RMSNorm", "replace_norms"]


class LayerNorm(nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` computed by torch_ln's kernels.

    It subclasses ``nn.LayerNorm``, so the constructor (``normalized_shape``, ``eps``,
    ``elementwise_affine``, ``bias``, ``device``, ``dtype``), the ``weight``/``bias``
    parameters (``None`` where torch has ``None``), ``reset_parameters``, ``extra_repr``,
    the state_dict and ``isinstance(m, nn.LayerNorm)`` are torch's own.
    """

    def forward(self, input: Tensor) -> Tensor:
        return ops.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` computed by torch_ln's kernels (a subclass, like LayerNorm)."""

    def forward(self, input: Tensor) -> Tensor:
        return ops.rms_norm(input, self.normalized_shape, self.weight, self.eps)


class AddLayerNorm(nn.LayerNorm):
    """Residual add + LayerNorm: ``forward(x, residual)`` returns ``(y, residual_out)`` (see
    :func:`torch_ln.add_layer_norm`).

    Constructor, parameters and state_dict are ``nn.LayerNorm``'s, plus the keyword
    ``residual_dtype`` (default ``None``: the input's dtype), which is not part of the state.
    """

    def __init__(self, *args, residual_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return ops.add_layer_norm(
            x, residual, self.normalized_shape, self.weight, self.bias, self.eps, self.residual_dtype
        )


class AddRMSNorm(nn.RMSNorm):
    """Residual add + RMSNorm: ``forward(x, residual)`` returns ``(y, residual_out)``, as :class:`AddLayerNorm`."""

    def __init__(self, *args, residual_dtype: torch.dtype | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return ops.add_rms_norm(x, residual, self.normalized_shape, self.weight, self.eps, self.residual_dtype)


_REPLACEMENTS: dict[type[nn.Module], type[nn.Module]] = {nn.LayerNorm: LayerNorm, nn.RMSNorm: RMSNorm}


def replace_norms(model: nn.Module) -> nn.Module:
    """Swaps every ``nn.LayerNorm`` and ``nn.RMSNorm`` in ``model`` for torch_ln's, in place.

    The swapped modules keep the same parameter objects (so optimizers holding them
    keep working), device, dtype, hooks and training mode; a norm shared by several
    parents stays shared. Subclasses of the torch modules are left alone: they may
    override ``forward``. Returns ``model`` (converted itself if it is a bare norm).
    """
    swapped: dict[int, nn.Module] = {}

    def convert(module: nn.Module) -> nn.Module:
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is None:
            return module
        if id(module) not in swapped:
            swapped[id(module)] = _swap(module, replacement)
        return swapped[id(module)]

    for parent in list(model.modules()):
        # _modules, not named_children(): a module held in two slots of one parent is listed once there.
        for name, child in list(parent._modules.items()):
            if child is not None:
                parent._modules[name] = convert(child)
    return convert(model)


def _swap(module: nn.Module, replacement: type[nn.Module]) -> nn.Module:
    # Re-class a shallow copy: parameters, buffers, hooks and the training flag all carry over.
    swapped = replacement.__new__(replacement)
    swapped.__dict__ = module.__dict__.copy()
    swapped._parameters = dict(module._parameters)
    swapped._buffers = dict(module._buffers)
    swapped._modules = dict(module._modules)
    return swapped
