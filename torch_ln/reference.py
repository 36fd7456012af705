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


def layer_norm_statistics(x: Tensor, normalized_shape: Sequence[int], eps: float) -> tuple[Tensor, Tensor]:
    """mean and rstd of each row of x (already in the accumulation dtype), kept as size-1 dims."""
    dims = _normalized_dims(x, normalized_shape)
    mean = x.mean(dims, keepdim=True)
    # Two-pass variance: centring first avoids the E[x^2] - E[x]^2 cancellation.
    var = (x - mean).square().mean(dims, keepdim=True)
    return mean, torch.rsqrt(var + eps)


def rms_norm_rstd(x: Tensor, normalized_shape: Sequence[int], eps: float | None) -> Tensor:
    """rsqrt(mean(x^2) + eps) of each row of x (already in the accumulation dtype), kept as size-1 dims."""
    eps = default_rms_eps(x.dtype) if eps is None else eps
    return torch.rsqrt(x.square().mean(_normalized_dims(x, normalized_shape), keepdim=True) + eps)


def layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    weight_offset: float = 0.0,
) -> Tensor:
    """(x - mean) * rstd * (weight + weight_offset) + bias, statistics in float32 (float64 for float64 input)."""
    x = input.to(accumulation_dtype(input.dtype))
    mean, rstd = layer_norm_statistics(x, normalized_shape, eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * (weight.to(y.dtype) + weight_offset)
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
    weight_offset: float = 0.0,
    round_normalized: bool = False,
) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), in float32 (float64 for float64 input).

    ``round_normalized``: the normalized value is rounded to the input's dtype before the weight multiply.
    """
    x = input.to(accumulation_dtype(input.dtype))
    return apply_weight(input, x * rms_norm_rstd(x, normalized_shape, eps), weight, weight_offset, round_normalized)


def apply_weight(
    input: Tensor, normalized: Tensor, weight: Tensor | None, weight_offset: float = 0.0, round_normalized: bool = False
) -> Tensor:
    """The output from the normalized input (in the accumulation dtype), rounded as the kernels do: optionally to
    the input's dtype before the product with (weight + weight_offset), and to the input's dtype at the end."""
    y = normalized.to(input.dtype).to(normalized.dtype) if round_normalized else normalized
    if weight is not None:
        y = y * (weight.to(y.dtype) + weight_offset)
    return y.to(input.dtype)


# The activations of a gated RMSNorm's gate.
GATE_ACTIVATIONS = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}


def gated_rms_norm(
    input: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    eps: float | None,
    *,
    gate_position: str = "after",
    activation: str = "silu",
    group_size: int | None = None,
    round_normalized: bool = False,
) -> Tensor:
    """RMSNorm over the last dimension with a gate z, as the gated RMSNorms of hybrid SSM and linear-attention models
    compute it (transformers' *RMSNormGated classes, tests/test_gated_norm_reference.py):

    - ``gate_position="before"``: rmsnorm(x * act(z)) (Mamba2, FalconH1 with norm_before_gate=False); ``"after"``:
      rmsnorm(x) * act(z) (Qwen3-Next, GLM5-Next, FalconH1's default, fla's FusedRMSNormGated). act(z) and its
      product are float32's (float64's for float64 input); ``gate=None``: no gate.
    - ``group_size``: each group of that many elements of the row has its own rstd (Mamba2's n_groups).
    - the rstd of each group is rsqrt(mean(h^2) + eps) of the float32 values.
    - ``round_normalized=False``: float32 throughout (the weight converted), rounded to x's dtype once at the end.
      ``True``: the normalized value rounded to x's dtype and multiplied by the weight in their promoted dtype
      (Llama's rounding); a gate after it multiplies in float32 and the result is rounded to x's dtype; without one
      the product is returned as it is (Mamba2: a float32 weight gives a float32 output).

    torch_ln.gated_rms_norm computes these forms (tests/test_gated_norm.py)."""
    dtype, act = input.dtype, GATE_ACTIVATIONS[activation]
    acc = accumulation_dtype(dtype)
    eps = default_rms_eps(dtype) if eps is None else eps
    h = input.to(acc)
    if gate is not None and gate_position == "before":
        h = h * act(gate.to(acc))
    groups = h.unflatten(-1, (-1, group_size or h.shape[-1]))
    normalized = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    if round_normalized:
        out = normalized.to(dtype) if weight is None else weight * normalized.to(dtype)
    else:
        out = normalized if weight is None else weight.to(acc) * normalized
    if gate is not None and gate_position == "after":
        return (out * act(gate.to(acc))).to(dtype)
    return out if round_normalized else out.to(dtype)


# Derivatives, in torch ops so that they are differentiable again (double backward, hessians, torch.func).


def normalize(input: Tensor, normalized_shape: Sequence[int], eps: float | None, centred: bool) -> tuple:
    """(xhat, mean, rstd) in the accumulation dtype: xhat = (x - mean) * rstd, or x * rstd (RMSNorm: mean None)."""
    x = input.to(accumulation_dtype(input.dtype))
    if centred:
        mean, rstd = layer_norm_statistics(x, normalized_shape, eps)
        return (x - mean) * rstd, mean, rstd
    rstd = rms_norm_rstd(x, normalized_shape, eps)
    return x * rstd, None, rstd


def normalization_jvp(xhat: Tensor, rstd: Tensor, tangent: Tensor, normalized_ndim: int, centred: bool) -> tuple:
    """(d xhat, d mean, d rstd) for a tangent of x (d mean is None uncentred), with c = mean(xhat * t_c) per row:
    d xhat = rstd * (t_c - xhat * c), d rstd = -rstd^2 * c, d mean = mean(t), t_c = t - d mean.

    t -> d xhat is a symmetric matrix per row, so the same map takes an output gradient to the input gradient.
    """
    dims = list(range(xhat.dim() - normalized_ndim, xhat.dim()))
    t = tangent.to(xhat.dtype)
    dmean = t.mean(dims, keepdim=True) if centred else None
    if centred:
        t = t - dmean
    c = (xhat * t).mean(dims, keepdim=True)
    return rstd * (t - xhat * c), dmean, -rstd.square() * c


def affine_grads(grad_out: Tensor, xhat: Tensor, params: Sequence, normalized_ndim: int, first_row_dim: int = 0):
    """Gradients of (weight, bias) in y = xhat * weight + bias, summed over the row dims from first_row_dim on
    (under vmap dim 0 is the sample, kept); None for an absent parameter."""
    g = grad_out.to(xhat.dtype)
    rows = list(range(first_row_dim, g.dim() - normalized_ndim))
    grads = []
    for param, factor in zip(params, (lambda: g * xhat, lambda: g)):
        product = factor() if param is not None else None
        grads.append(None if product is None else (product.sum(rows) if rows else product).to(param.dtype))
    return grads


def norm_backward(grad_out, input, normalized_shape, weight, bias, eps, centred: bool) -> tuple:
    """(dinput, dweight, dbias) of layer_norm (centred) or rms_norm (bias None), statistics recomputed from input."""
    xhat, _, rstd = normalize(input, normalized_shape, eps, centred)
    g = grad_out.to(xhat.dtype)
    scaled = g * weight.to(g.dtype) if weight is not None else g
    dinput = normalization_jvp(xhat, rstd, scaled, len(normalized_shape), centred)[0].to(input.dtype)
    return (dinput, *affine_grads(g, xhat, (weight, bias), len(normalized_shape)))


def gate_slope(gate: Tensor, activation: str) -> Tensor:
    """d act / d gate of a gated norm's activation: silu' = s (1 + z (1 - s)), sigmoid' = s (1 - s), s = sigmoid(z)."""
    s = torch.sigmoid(gate)
    return s * (1 + gate * (1 - s)) if activation == "silu" else s * (1 - s)


def gated_rms_norm_backward(
    grad_out: Tensor,
    input: Tensor,
    gate: Tensor | None,
    weight: Tensor | None,
    eps: float | None,
    *,
    gate_position: str = "after",
    activation: str = "silu",
    group_size: int | None = None,
) -> tuple:
    """(dinput, dgate, dweight) of gated_rms_norm over the last dimension, its roundings aside, statistics recomputed
    from input (None for an absent gate or weight). With h = x or x * act(z) (gate before), xhat = h * rstd per group,
    u = xhat * weight: after the norm, dz = dy * u * act'(z) and dy becomes dy * act(z); dweight = sum dy * xhat;
    dh = rstd * (g - xhat * mean(g * xhat)) per group with g = dy * weight; before the norm, dz = dh * x * act'(z) and
    dx = dh * act(z)."""
    acc = accumulation_dtype(input.dtype)
    eps = default_rms_eps(input.dtype) if eps is None else eps
    size = group_size or input.shape[-1]
    h, g = input.to(acc), grad_out.to(acc)
    if gate is not None:
        z = gate.to(acc)
        act, slope = GATE_ACTIVATIONS[activation](z), gate_slope(z, activation)
        if gate_position == "before":
            h = h * act
    xhat, _, rstd = normalize(h.unflatten(-1, (-1, size)), [size], eps, centred=False)
    xhat = xhat.flatten(-2)
    dgate = dweight = None
    if gate is not None and gate_position == "after":
        dgate = g * (xhat * weight.to(acc) if weight is not None else xhat) * slope
        g = g * act
    if weight is not None:
        dweight = (g * xhat).sum(list(range(g.dim() - 1))).to(weight.dtype)
        g = g * weight.to(acc)
    dh = normalization_jvp(xhat.unflatten(-1, (-1, size)), rstd, g.unflatten(-1, (-1, size)), 1, False)[0].flatten(-2)
    if gate is not None and gate_position == "before":
        dgate = dh * input.to(acc) * slope
        dh = dh * act
    return dh.to(input.dtype), None if dgate is None else dgate.to(gate.dtype), dweight


def add_norm(
    norm, x: Tensor, residual: Tensor, *args, residual_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """The composite that torch_ln.add_layer_norm/add_rms_norm fuse: residual_out = x + residual in
    residual_dtype (default x's), then y = norm(residual_out, *args) in x's dtype."""
    dtype = residual_dtype or x.dtype
    residual_out = x.to(dtype) + residual.to(dtype)
    return norm(residual_out, *args).to(x.dtype), residual_out


# Quantized outputs (torch_ln.rms_norm_quant and the others), written as vLLM's reference kernels compute them:
# the norm, then scale, saturate, cast. The kernels match quantize() bit for bit given the same y.

QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}


def min_dynamic_scale(out_dtype: torch.dtype) -> float:
    """The floor of a dynamic scale, vLLM's 1 / (qmax * 512): an all-zero group does not divide by zero."""
    return float(torch.tensor(1.0 / (QUANT_MAX[out_dtype] * 512.0), dtype=torch.float32))


def power_of_two_ceil(scale: Tensor) -> Tensor:
    """Each (positive) scale rounded up to a power of two, exactly (frexp, not log2: log2 rounds 2^k * (1 + 2^-23)
    to k); inf and NaN unchanged."""
    mantissa, exponent = torch.frexp(scale)
    rounded = torch.ldexp(torch.ones_like(scale), exponent)
    return torch.where(torch.isfinite(scale) & (mantissa != 0.5), rounded, scale)


def quantize(
    y: Tensor,
    normalized_ndim: int,
    out_dtype: torch.dtype,
    scale: Tensor | None = None,
    group_size: int | None = None,
    scale_ub: float | None = None,
    scale_ue8m0: bool = False,
) -> tuple[Tensor, Tensor]:
    """(q, scales) of y: q = cast(clamp(y * (1 / scale), -qmax, qmax)) with the float32 reciprocal of each scale;
    int8 rounds half to even and maps NaN to 0. A static `scale` (one float32 element) is returned as given; dynamic
    scales are max(min(amax, scale_ub) / qmax, min_dynamic_scale) per group of group_size elements of the flattened
    normalized dims (the whole row without group_size), optionally rounded up to a power of two, shaped
    [*leading dims, groups]. A NaN in a group makes its amax and scale NaN (as torch.amax)."""
    qmax = QUANT_MAX[out_dtype]
    lead = y.shape[: y.dim() - normalized_ndim]
    rows = y.reshape(*lead, -1).float()
    if scale is not None:
        scales = scale.reshape(1)
        scaled = rows * torch.reciprocal(scales)
    else:
        group = group_size or rows.shape[-1]
        groups = rows.unflatten(-1, (-1, group))
        amax = groups.abs().amax(-1)
        if scale_ub is not None:
            amax = torch.clamp(amax, max=torch.tensor(scale_ub, dtype=torch.float32))
        scales = torch.clamp(amax / qmax, min=min_dynamic_scale(out_dtype))
        if scale_ue8m0:
            scales = power_of_two_ceil(scales)
        scaled = (groups * torch.reciprocal(scales).unsqueeze(-1)).flatten(-2)
    clamped = torch.clamp(scaled, -qmax, qmax)
    if out_dtype == torch.int8:
        clamped = torch.where(torch.isnan(clamped), 0.0, torch.round(clamped))
    return clamped.to(out_dtype).reshape(y.shape), scales
