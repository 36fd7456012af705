"""Norms with a quantized output for fp8/int8 inference: the norm in front of a quantized linear layer writes its
output in one byte an element with its scales, instead of writing y and reading it back to quantize it.

The schemas live in csrc/norm_ops.cpp (``*_quant``); the arithmetic in csrc/quantize.h; the reference in
:func:`torch_ln.reference.quantize`. Inference only: no autograd.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from torch_ln.modules import LayerNorm, RMSNorm
from torch_ln.ops import _residual_out

__all__ = [
    "LayerNormQuant",
    "QuantizedNorm",
    "RMSNormQuant",
    "add_layer_norm_quant",
    "add_rms_norm_quant",
    "layer_norm_quant",
    "rms_norm_quant",
]

_ops = torch.ops.torch_ln


class QuantizedNorm(NamedTuple):
    """What the ``*_quant`` functions return."""

    q: Tensor  # y quantized: the input's shape, out_dtype, contiguous
    scale: Tensor  # the static scale as given, or float32 [*leading dims, groups] (groups = 1 per token)
    y: Tensor | None  # y itself (the input's dtype), with return_unquantized=True
    residual_out: Tensor | None  # the fused add's x + residual (add_*_quant)


def _as_shape(normalized_shape: int | Sequence[int]) -> list[int]:
    return [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)


def _check_inference(op: str, *tensors: Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"torch_ln.{op} is inference-only (its output is quantized: no gradient), but an input requires grad; "
            "call it under torch.no_grad() or torch.inference_mode(), or detach the inputs"
        )


def _quant_options(
    out_dtype, scale, group_size, scale_ub, scale_ue8m0, scales_column_major, return_unquantized
) -> tuple:
    return (out_dtype, scale, group_size, scale_ub, scale_ue8m0, scales_column_major, return_unquantized)


def _result(q: Tensor, scales: Tensor, y: Tensor, scale: Tensor | None, return_unquantized: bool, residual_out=None):
    return QuantizedNorm(q, scale if scale is not None else scales, y if return_unquantized else None, residual_out)


_QUANT_DOC = """
    Quantization (keyword arguments):

    - ``out_dtype``: ``torch.float8_e4m3fn`` (saturating at +-448), ``torch.float8_e5m2`` (+-57344) or ``torch.int8``
      (symmetric, [-127, 127], round half to even).
    - ``scale``: a static per-tensor scale, a float32 tensor of one element on the input's device (positive: not
      checked, to keep the call free of host synchronization): ``q = sat(y * (1 / scale))``.
    - otherwise dynamic scales, per token (no ``group_size``: ``[*leading, 1]``) or per group of ``group_size``
      elements along the row (it must divide the normalized size: ``[*leading, D // group_size]``):
      ``scale = max(min(amax, scale_ub) / qmax, 1 / (qmax * 512))``; ``scale_ue8m0`` rounds each up to a power of two;
      ``scales_column_major`` lays them out transposed (each group's scales contiguous over the rows, as
      DeepGEMM-style GEMMs read them; same shape).
    - ``return_unquantized``: y is returned as well.

    The output is the unquantized norm's y (bit for bit that of the plain function with the same options), quantized
    as :func:`torch_ln.reference.quantize` says. A NaN quantizes to NaN in float8 and to 0 in int8, and makes its
    group's dynamic scale NaN. Inference only: an input that requires grad (with grad mode on) is an error.
"""


def rms_norm_quant(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    scale_ue8m0: bool = False,
    scales_column_major: bool = False,
    return_unquantized: bool = False,
    weight_offset: float = 0.0,
    round_normalized: bool = False,
) -> QuantizedNorm:
    _check_inference("rms_norm_quant", input, weight)
    options = _quant_options(
        out_dtype, scale, group_size, scale_ub, scale_ue8m0, scales_column_major, return_unquantized
    )
    q, scales, y = _ops.rms_norm_quant.default(
        input, _as_shape(normalized_shape), weight, eps, *options, weight_offset, round_normalized
    )
    return _result(q, scales, y, scale, return_unquantized)


def layer_norm_quant(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    scale_ue8m0: bool = False,
    scales_column_major: bool = False,
    return_unquantized: bool = False,
    weight_offset: float = 0.0,
) -> QuantizedNorm:
    _check_inference("layer_norm_quant", input, weight, bias)
    options = _quant_options(
        out_dtype, scale, group_size, scale_ub, scale_ue8m0, scales_column_major, return_unquantized
    )
    q, scales, y = _ops.layer_norm_quant.default(
        input, _as_shape(normalized_shape), weight, bias, eps, *options, weight_offset
    )
    return _result(q, scales, y, scale, return_unquantized)


def add_rms_norm_quant(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    residual_dtype: torch.dtype | None = None,
    *,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    scale_ue8m0: bool = False,
    scales_column_major: bool = False,
    return_unquantized: bool = False,
    weight_offset: float = 0.0,
    round_normalized: bool = False,
) -> QuantizedNorm:
    _check_inference("add_rms_norm_quant", x, residual, weight)
    options = _quant_options(
        out_dtype, scale, group_size, scale_ub, scale_ue8m0, scales_column_major, return_unquantized
    )
    q, scales, y, residual_out = _ops.add_rms_norm_quant.default(
        x, residual, _as_shape(normalized_shape), weight, eps, residual_dtype, *options, weight_offset, round_normalized
    )
    return _result(q, scales, y, scale, return_unquantized, residual_out)


def add_layer_norm_quant(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    residual_dtype: torch.dtype | None = None,
    *,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    scale_ue8m0: bool = False,
    scales_column_major: bool = False,
    return_unquantized: bool = False,
    weight_offset: float = 0.0,
) -> QuantizedNorm:
    _check_inference("add_layer_norm_quant", x, residual, weight, bias)
    options = _quant_options(
        out_dtype, scale, group_size, scale_ub, scale_ue8m0, scales_column_major, return_unquantized
    )
    q, scales, y, residual_out = _ops.add_layer_norm_quant.default(
        x, residual, _as_shape(normalized_shape), weight, bias, eps, residual_dtype, *options, weight_offset
    )
    return _result(q, scales, y, scale, return_unquantized, residual_out)


rms_norm_quant.__doc__ = (
    """RMS normalization (:func:`torch_ln.rms_norm`, the same options) with a quantized output.""" + _QUANT_DOC
)
layer_norm_quant.__doc__ = (
    """Layer normalization (:func:`torch_ln.layer_norm`, the same options) with a quantized output.""" + _QUANT_DOC
)
add_rms_norm_quant.__doc__ = (
    """:func:`torch_ln.add_rms_norm` with a quantized y: ``y = rms_norm(x + residual)``, and ``residual_out`` in its
    dtype as the fused add returns it."""
    + _QUANT_DOC
)
add_layer_norm_quant.__doc__ = (
    """:func:`torch_ln.add_layer_norm` with a quantized y, and ``residual_out``.""" + _QUANT_DOC
)


class _QuantizedOutput:
    """The quantization options of the quantized-output modules, as keywords of their constructors: ``out_dtype``,
    ``scale_mode`` (``"static"``: a ``scale`` buffer, float32 ``[1]``, 1 until a state_dict or the caller sets it;
    ``"per_token"``; ``"per_group"``, with ``group_size``, default 128), ``scale_ub``, ``scale_ue8m0``,
    ``scales_column_major``, ``return_unquantized`` and, for ``forward(x, residual)``, ``residual_dtype``."""

    _SCALE_MODES = ("static", "per_token", "per_group")

    def __init__(
        self,
        *args,
        out_dtype: torch.dtype = torch.float8_e4m3fn,
        scale_mode: str = "per_token",
        group_size: int = 128,
        scale_ub: float | None = None,
        scale_ue8m0: bool = False,
        scales_column_major: bool = False,
        return_unquantized: bool = False,
        residual_dtype: torch.dtype | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)  # the norm module's own constructor
        if scale_mode not in self._SCALE_MODES:
            raise ValueError(f"expected scale_mode to be one of {self._SCALE_MODES}, but got scale_mode={scale_mode!r}")
        self.out_dtype, self.scale_mode, self.group_size = out_dtype, scale_mode, int(group_size)
        self.scale_ub, self.scale_ue8m0, self.scales_column_major = scale_ub, scale_ue8m0, scales_column_major
        self.return_unquantized, self.residual_dtype = return_unquantized, residual_dtype
        static = torch.ones(1, dtype=torch.float32, device=kwargs.get("device")) if scale_mode == "static" else None
        self.register_buffer("scale", static)

    def _quant_options(self) -> dict:
        return {
            "out_dtype": self.out_dtype,
            "scale": self.scale,
            "group_size": self.group_size if self.scale_mode == "per_group" else None,
            "scale_ub": self.scale_ub,
            "scale_ue8m0": self.scale_ue8m0,
            "scales_column_major": self.scales_column_major,
            "return_unquantized": self.return_unquantized,
        }

    def extra_repr(self) -> str:
        options = [f"out_dtype={self.out_dtype}", f"scale_mode={self.scale_mode!r}"]
        options += [f"group_size={self.group_size}"] if self.scale_mode == "per_group" else []
        return ", ".join([super().extra_repr(), *options])


class RMSNormQuant(_QuantizedOutput, RMSNorm):
    """:class:`torch_ln.RMSNorm` (its constructor, parameters and state_dict, plus the ``scale`` buffer of a static
    scale) whose forward returns :class:`QuantizedNorm`: ``forward(x)`` is :func:`rms_norm_quant`, ``forward(x,
    residual)`` :func:`add_rms_norm_quant`. Inference only. See :class:`_QuantizedOutput` for the keywords."""

    def forward(self, input: Tensor, residual: Tensor | None = None) -> QuantizedNorm:
        options = {"weight_offset": self.weight_offset, "round_normalized": self.round_normalized}
        options |= self._quant_options()
        if residual is None:
            return rms_norm_quant(input, self.normalized_shape, self.weight, self.eps, **options)
        return add_rms_norm_quant(
            input, residual, self.normalized_shape, self.weight, self.eps, self.residual_dtype, **options
        )


class LayerNormQuant(_QuantizedOutput, LayerNorm):
    """:class:`torch_ln.LayerNorm` with a quantized output, as :class:`RMSNormQuant`: ``forward(x)`` is
    :func:`layer_norm_quant`, ``forward(x, residual)`` :func:`add_layer_norm_quant`."""

    def forward(self, input: Tensor, residual: Tensor | None = None) -> QuantizedNorm:
        options = {"weight_offset": self.weight_offset, **self._quant_options()}
        if residual is None:
            return layer_norm_quant(input, self.normalized_shape, self.weight, self.bias, self.eps, **options)
        return add_layer_norm_quant(
            input, residual, self.normalized_shape, self.weight, self.bias, self.eps, self.residual_dtype, **options
        )


# Fake kernels: shapes, dtypes and strides as the C++ operators allocate them (prepare_quant).


def _fake_quant(input, normalized_shape, out_dtype, scale, group_size, scales_column_major, return_unquantized):
    q = torch.empty_like(input, dtype=out_dtype, memory_format=torch.contiguous_format)
    if scale is not None:
        scales = input.new_empty((0,))
    else:
        axis = input.dim() - len(normalized_shape)
        lead = list(input.shape[:axis])
        rows, cols = math.prod(lead), math.prod(normalized_shape)
        if group_size is not None and (group_size <= 0 or cols % group_size != 0):
            raise ValueError(
                f"expected group_size to be a positive divisor of the normalized size {cols}, but got "
                f"group_size={group_size}"
            )
        groups = cols // group_size if group_size else 1
        if scales_column_major:
            scales = input.new_empty((groups, rows), dtype=torch.float32).t().view(*lead, groups)
        else:
            scales = input.new_empty((*lead, groups), dtype=torch.float32)
    y = torch.empty_like(input, memory_format=torch.contiguous_format) if return_unquantized else input.new_empty((0,))
    return q, scales, y


@torch.library.register_fake("torch_ln::rms_norm_quant")
def _(input, normalized_shape, weight, eps, out_dtype, scale=None, group_size=None, scale_ub=None,
      scale_ue8m0=False, scales_column_major=False, return_unquantized=False, weight_offset=0.0,
      round_normalized=False):  # fmt: skip
    return _fake_quant(input, normalized_shape, out_dtype, scale, group_size, scales_column_major, return_unquantized)


@torch.library.register_fake("torch_ln::layer_norm_quant")
def _(input, normalized_shape, weight, bias, eps, out_dtype, scale=None, group_size=None, scale_ub=None,
      scale_ue8m0=False, scales_column_major=False, return_unquantized=False, weight_offset=0.0):  # fmt: skip
    return _fake_quant(input, normalized_shape, out_dtype, scale, group_size, scales_column_major, return_unquantized)


@torch.library.register_fake("torch_ln::add_rms_norm_quant")
def _(input, residual, normalized_shape, weight, eps, residual_dtype, out_dtype, scale=None, group_size=None,
      scale_ub=None, scale_ue8m0=False, scales_column_major=False, return_unquantized=False, weight_offset=0.0,
      round_normalized=False):  # fmt: skip
    quantized = _fake_quant(
        input, normalized_shape, out_dtype, scale, group_size, scales_column_major, return_unquantized
    )
    return (*quantized, _residual_out(input, residual_dtype))


@torch.library.register_fake("torch_ln::add_layer_norm_quant")
def _(input, residual, normalized_shape, weight, bias, eps, residual_dtype, out_dtype, scale=None, group_size=None,
      scale_ub=None, scale_ue8m0=False, scales_column_major=False, return_unquantized=False,
      weight_offset=0.0):  # fmt: skip
    quantized = _fake_quant(
        input, normalized_shape, out_dtype, scale, group_size, scales_column_major, return_unquantized
    )
    return (*quantized, _residual_out(input, residual_dtype))
