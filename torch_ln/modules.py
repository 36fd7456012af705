"""Drop-in modules for torch.nn.LayerNorm and torch.nn.RMSNorm, the registry of norm classes, and the swap-in helper."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor, nn

from torch_ln import ops

__all__ = [
    "AddLayerNorm",
    "AddRMSNorm",
    "GatedRMSNorm",
    "LayerNorm",
    "RMSNorm",
    "forward_converter",
    "register_norm",
    "replace_norms",
]


class _NormOptions:
    """The options of the norm modules, as keywords of their constructors.

    ``weight_offset``: the norm multiplies by ``weight + weight_offset`` (zero-centred weights with 1: Gemma's
    ``1 + w``, TransformerEngine's ``zero_centered_gamma``). The state_dict holds ``weight`` itself, as torch's
    modules do, and ``reset_parameters`` sets it to ``1 - weight_offset``, so that a new module multiplies by 1
    (zeros for an offset of 1): weight decay then pulls toward the identity. ``round_normalized`` (RMSNorm only):
    Llama's rounding, see :func:`torch_ln.rms_norm`. ``memory_efficient`` (LayerNorm and RMSNorm): autograd saves
    the output instead of the input, see :func:`torch_ln.layer_norm`; a plain attribute, which may be set on a module
    later (one swapped in by :func:`replace_norms`, say). The class attributes are the defaults, which modules swapped
    in by :func:`replace_norms` keep.
    """

    weight_offset: float = 0.0
    round_normalized: bool = False
    memory_efficient: bool = False

    def _set_rounding(self, weight_offset: float, round_normalized: bool = False) -> None:
        self.weight_offset, self.round_normalized = float(weight_offset), bool(round_normalized)
        if self.weight_offset:
            self.reset_parameters()  # the constructor's reset ran with no offset

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None and self.weight_offset:
            with torch.no_grad():
                self.weight.fill_(1.0 - self.weight_offset)

    def extra_repr(self) -> str:
        options = [f"weight_offset={self.weight_offset}"] if self.weight_offset else []
        options += ["round_normalized=True"] if self.round_normalized else []
        options += ["memory_efficient=True"] if self.memory_efficient else []
        return ", ".join([super().extra_repr(), *options])


class LayerNorm(_NormOptions, nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` computed by torch_ln's kernels.

    It subclasses ``nn.LayerNorm``, so the constructor (``normalized_shape``, ``eps``,
    ``elementwise_affine``, ``bias``, ``device``, ``dtype``), the ``weight``/``bias``
    parameters (``None`` where torch has ``None``), ``reset_parameters``, ``extra_repr``,
    the state_dict and ``isinstance(m, nn.LayerNorm)`` are torch's own. The keyword
    ``weight_offset`` (default 0) gives zero-centred weights: ``y = xhat * (weight + weight_offset) + bias``;
    ``memory_efficient`` (default False) saves the output for the backward instead of the input.
    """

    def __init__(self, *args, weight_offset: float = 0.0, memory_efficient: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._set_rounding(weight_offset)
        self.memory_efficient = bool(memory_efficient)

    def forward(self, input: Tensor) -> Tensor:
        return ops.layer_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            weight_offset=self.weight_offset,
            memory_efficient=self.memory_efficient,
        )


class RMSNorm(_NormOptions, nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` computed by torch_ln's kernels (a subclass, like LayerNorm), with the keywords
    ``weight_offset``, ``round_normalized`` and ``memory_efficient`` of :func:`torch_ln.rms_norm`."""

    def __init__(
        self,
        *args,
        weight_offset: float = 0.0,
        round_normalized: bool = False,
        memory_efficient: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._set_rounding(weight_offset, round_normalized)
        self.memory_efficient = bool(memory_efficient)

    def forward(self, input: Tensor) -> Tensor:
        return ops.rms_norm(
            input,
            self.normalized_shape,
            self.weight,
            self.eps,
            weight_offset=self.weight_offset,
            round_normalized=self.round_normalized,
            memory_efficient=self.memory_efficient,
        )


class GatedRMSNorm(nn.RMSNorm):
    """Gated RMSNorm: ``forward(input, gate=None)`` is :func:`torch_ln.gated_rms_norm` (``rms_norm(input) *
    act(gate)`` or ``rms_norm(input * act(gate))``). Constructor, parameters and state_dict are ``nn.RMSNorm``'s,
    plus the keywords ``gate_position`` ("after"), ``activation`` ("silu"), ``group_size`` (None: the whole row has
    one rstd) and ``round_normalized`` (False), which are not part of the state."""

    def __init__(
        self,
        *args,
        gate_position: str = "after",
        activation: str = "silu",
        group_size: int | None = None,
        round_normalized: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.gate_position, self.activation = gate_position, activation
        self.group_size, self.round_normalized = group_size, bool(round_normalized)

    def forward(self, input: Tensor, gate: Tensor | None = None) -> Tensor:
        return ops.gated_rms_norm(
            input,
            gate,
            self.normalized_shape,
            self.weight,
            self.eps,
            gate_position=self.gate_position,
            activation=self.activation,
            group_size=self.group_size,
            round_normalized=self.round_normalized,
        )

    def extra_repr(self) -> str:
        options = [f"gate_position={self.gate_position!r}", f"activation={self.activation!r}"]
        options += [f"group_size={self.group_size}"] if self.group_size is not None else []
        options += ["round_normalized=True"] if self.round_normalized else []
        return ", ".join([super().extra_repr(), *options])


Converter = Callable[[nn.Module], nn.Module]

# The registry: a norm class -> the converter that returns its torch_ln replacement. Keyed by the exact class, so a
# subclass (which may override forward) is only swapped if it is registered itself.
_CONVERTERS: dict[type, Converter] = {}
# Called with a class the registry does not hold: each returns a converter or None, and a found one is registered
# (torch_ln.integrations recognizes transformers' and timm's classes this way, importing neither itself).
_RESOLVERS: list[Callable[[type], Converter | None]] = []
_UNRESOLVED: set[type] = set()

logger = logging.getLogger("torch_ln")


class AddLayerNorm(_NormOptions, nn.LayerNorm):
    """Residual add + LayerNorm: ``forward(x, residual)`` returns ``(y, residual_out)`` (see
    :func:`torch_ln.add_layer_norm`).

    Constructor, parameters and state_dict are ``nn.LayerNorm``'s, plus the keywords
    ``residual_dtype`` (default ``None``: the input's dtype), which is not part of the state,
    and :class:`LayerNorm`'s ``weight_offset``.
    """

    def __init__(self, *args, residual_dtype: torch.dtype | None = None, weight_offset: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.residual_dtype = residual_dtype
        self._set_rounding(weight_offset)

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return ops.add_layer_norm(
            x,
            residual,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            self.residual_dtype,
            weight_offset=self.weight_offset,
        )


class AddRMSNorm(_NormOptions, nn.RMSNorm):
    """Residual add + RMSNorm: ``forward(x, residual)`` returns ``(y, residual_out)``, as :class:`AddLayerNorm`,
    with :class:`RMSNorm`'s keywords ``weight_offset`` and ``round_normalized``."""

    def __init__(
        self,
        *args,
        residual_dtype: torch.dtype | None = None,
        weight_offset: float = 0.0,
        round_normalized: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.residual_dtype = residual_dtype
        self._set_rounding(weight_offset, round_normalized)

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return ops.add_rms_norm(
            x,
            residual,
            self.normalized_shape,
            self.weight,
            self.eps,
            self.residual_dtype,
            weight_offset=self.weight_offset,
            round_normalized=self.round_normalized,
        )


def register_norm(cls: type, converter: Converter) -> None:
    """Makes :func:`replace_norms` swap every module of exactly class ``cls`` for ``converter(module)``.

    ``converter`` returns the replacement module; :func:`forward_converter` builds the usual one, which
    keeps the module itself (parameters, buffers, hooks, training flag, ``isinstance``) and replaces only
    its ``forward``. Registering a class again replaces its converter.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"torch_ln.register_norm: expected cls to be an nn.Module subclass, but got {cls!r}")
    if not callable(converter):
        raise TypeError(f"torch_ln.register_norm: expected converter to be callable, but got {converter!r}")
    _CONVERTERS[cls] = converter


def converter_for(cls: type) -> Converter | None:
    """The converter :func:`replace_norms` uses for modules of class ``cls``, or None (left untouched)."""
    if cls not in _CONVERTERS and cls not in _UNRESOLVED:
        for resolve in _RESOLVERS:
            converter = resolve(cls)
            if converter is not None:
                _CONVERTERS[cls] = converter
                break
        else:
            _UNRESOLVED.add(cls)  # the resolvers read source files: ask them once per class
    return _CONVERTERS.get(cls)


class forward_converter:
    """A converter that re-classes a module to a subclass of its own class whose ``forward`` is ``forward``.

    The subclass keeps the class name (transformers initializes weights by class name), and is created
    once per class. An instance-level ``forward`` (transformers' kernel hub installs one) is dropped.
    """

    def __init__(self, forward: Callable[..., Tensor]) -> None:
        self.forward = forward
        self._subclasses: dict[type, type] = {}

    def subclass(self, cls: type) -> type:
        """The subclass of ``cls`` with this forward (the same object on every call)."""
        if cls not in self._subclasses:
            sub = type(cls.__name__, (cls,), {"forward": self.forward, "__module__": cls.__module__})
            sub.__qualname__ = f"{cls.__qualname__}{_SUFFIX}"
            self._subclasses[cls] = sub
        return self._subclasses[cls]

    def __call__(self, module: nn.Module) -> nn.Module:
        swapped = _swap(module, self.subclass(type(module)))
        swapped.__dict__.pop("forward", None)
        return swapped


_SUFFIX = "[torch_ln]"  # marks the classes forward_converter makes


def _reclass(replacement: type[nn.Module]) -> Converter:
    return lambda module: _swap(module, replacement)


register_norm(nn.LayerNorm, _reclass(LayerNorm))
register_norm(nn.RMSNorm, _reclass(RMSNorm))


def replace_norms(model: nn.Module, *, verbose: bool = False) -> nn.Module:
    """Swaps every norm module of a registered class in ``model`` for torch_ln's, in place.

    Registered: ``nn.LayerNorm``, ``nn.RMSNorm``, transformers' and timm's norm classes (see
    :mod:`torch_ln.integrations`) and whatever :func:`register_norm` added. The swapped modules keep
    the same parameter objects (so optimizers holding them keep working), device, dtype, hooks and
    training mode; a norm shared by several parents stays shared. Modules of any other class, including
    subclasses of registered ones, are left alone. What was swapped, and which modules whose class name
    says "Norm" were not, is logged to the ``torch_ln`` logger (INFO) and printed with ``verbose=True``.
    Returns ``model`` (converted itself if it is a bare norm).
    """
    swapped: dict[int, nn.Module] = {}
    counts: Counter[str] = Counter()

    def convert(module: nn.Module) -> nn.Module:
        converter = None if _is_torch_ln(module) else converter_for(type(module))
        if converter is None:
            return module
        if id(module) not in swapped:
            swapped[id(module)] = converter(module)
            counts[type(module).__qualname__] += 1
        return swapped[id(module)]

    for parent in list(model.modules()):
        # _modules, not named_children(): a module held in two slots of one parent is listed once there.
        for name, child in list(parent._modules.items()):
            if child is not None:
                parent._modules[name] = convert(child)
    model = convert(model)
    replacements = {id(m) for m in swapped.values()}
    skipped = Counter(
        type(m).__qualname__
        for m in model.modules()
        if "norm" in type(m).__name__.lower() and id(m) not in replacements and not _is_torch_ln(m)
    )
    message = "torch_ln.replace_norms: swapped " + (", ".join(f"{n} x{c}" for n, c in counts.items()) or "nothing")
    if skipped:
        message += "; not swapped (unregistered): " + ", ".join(f"{n} x{c}" for n, c in skipped.items())
    logger.info(message)
    if verbose:
        print(message)
    return model


def _is_torch_ln(module: nn.Module) -> bool:
    return isinstance(module, (LayerNorm, RMSNorm)) or type(module).__qualname__.endswith(_SUFFIX)


def _swap(module: nn.Module, replacement: type[nn.Module]) -> nn.Module:
    # Re-class a shallow copy: parameters, buffers, hooks and the training flag all carry over.
    swapped = replacement.__new__(replacement)
    swapped.__dict__ = module.__dict__.copy()
    swapped._parameters = dict(module._parameters)
    swapped._buffers = dict(module._buffers)
    swapped._modules = dict(module._modules)
    return swapped
