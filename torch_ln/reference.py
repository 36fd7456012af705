"""Pure-torch reference implementations of the torch_ln operators.

Used by the tests (run in float64 they are the accuracy yardstick), by the
benchmarks' output checks, and by the double-backward path of torch_ln.ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and partial sums: float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _normalized_dims(input: Tensor, normalized_shape: Sequence[int]) -> list[int]:
    return list(range(input.dim() - len(normalized_shape), input.dim()))


def layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """(x - mean) * rstd * weight + bias, statistics in float32 (float64 for float64 input)."""
    dims = _normalized_dims(input, normalized_shape)
    x = input.to(accumulation_dtype(input.dtype))
    mean = x.mean(dims, keepdim=True)
    # Two-pass variance: centring first avoids the E[x^2] - E[x]^2 cancellation.
    var = (x - mean).square().mean(dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(input.dtype)


def default_rms_eps(dtype: torch.dtype) -> float:
    """torch's eps for rms_norm(eps=None): the machine epsilon of the accumulation dtype."""
    return torch.finfo(accumulation_dtype(dtype)).eps


def rms_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, in float32 (float64 for float64 input)."""
    dims = _normalized_dims(input, normalized_shape)
    x = input.to(accumulation_dtype(input.dtype))
    eps = default_rms_eps(input.dtype) if eps is None else eps
    y = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(input.dtype)


def add_norm(
    norm, x: Tensor, residual: Tensor, *args, residual_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The composite that torch_ln.add_layer_norm/add_rms_norm fuse: residual_out = x + residual in
    residual_dtype (default x's), then y = norm(residual_out, *args) in x's dtype."""
    dtype = residual_dtype or x.dtype
    residual_out = x.to(dtype) + residual.to(dtype)
    return norm(residual_out, *args).to(x.dtype), residual_out
