"""Python face of the torch_ln operators: wrappers, fake kernels, autograd, autocast.

The schemas live in csrc/norm_ops.cpp; the kernels in csrc/cpu and csrc/cuda.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torch_ln import _C, _transforms, reference

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "empty_output_cache",
    "gated_rms_norm",
    "layer_norm",
    "output_cache_bytes",
    "qk_rms_norm",
    "rms_norm",
]

_ops = torch.ops.torch_ln
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
# _eager's mode checks, looked up once rather than on every call. torch.compile recognizes is_compiling by identity
# (it answers True there, and the check stops at it).
_is_compiling = torch.compiler.is_compiling
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_autocast_enabled = torch._C._is_any_autocast_enabled
_forward_ad_active = _transforms._forward_ad_active


def _as_shape(normalized_shape: int | Sequence[int] | torch.Size) -> list[int]:
    return [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)


def _eager(input: Tensor, *others: Tensor | None) -> bool:
    """Whether a call takes the eager operators (torch_ln::layer_norm, ...: autograd in C++, csrc/autograd.cpp),
    through their typed bindings in torch_ln._C (csrc/python), rather than the *_fwd operators, whose autograd, jvp,
    vmap rule and autocast rule are registered in Python.

    The Python path costs ~20 us a call more (a Python autograd.Function: measured on the 2-core dev VM, 4x1024
    float32 with inputs that require grad, 42 us against 7 for torch's layer_norm), a fifth of a 1 MiB norm.
    Only plain tensors (nn.Parameter included: a module's weight and bias) outside torch.compile, torch.func,
    forward-mode AD and autocast take it: those, and tensor subclasses, need the *_fwd operators as registered.
    Written out rather than with all(): this runs on every call.
    """
    if type(input) not in _PLAIN_TENSORS:
        return False
    for t in others:
        if t is not None and type(t) not in _PLAIN_TENSORS:
            return False
    # torch.compile, torch.func, autocast and forward-mode AD (dual tensors) need the registered rules.
    return not (_is_compiling() or _functorch_transforms_active() or _autocast_enabled() or _forward_ad_active())


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    weight_offset: float = 0.0,
    memory_efficient: bool = False,
) -> Tensor:
    """Layer normalization over the trailing ``normalized_shape`` dimensions.

    Same signature and results as :func:`torch.nn.functional.layer_norm`. float16 and
    bfloat16 inputs may come with float32 ``weight``/``bias`` (the output keeps the
    input's dtype); statistics are accumulated in float32 (float64 for float64 input).

    ``weight_offset``: the weight enters as ``weight + weight_offset``, added in float32
    (zero-centred weights with 1: ``y = xhat * (1 + weight) + bias``, TransformerEngine's
    ``zero_centered_gamma``, Megatron's ``apply_layernorm_1p``).

    ``memory_efficient``: autograd saves the output instead of the input (the next layer holds it anyway), and the
    backward recovers the normalized input as ``y / (weight + weight_offset)``. Same forward; gradients within the
    project's accuracy rule; no bias (``y - bias`` cancels: an error); every ``weight + weight_offset`` nonzero (an
    error at the backward otherwise); no double backward. See the README, "Memory-efficient backward".
    """
    if not memory_efficient and _eager(input, weight, bias):
        return _C.layer_norm(input, normalized_shape, weight, bias, eps, weight_offset)
    shape = _as_shape(normalized_shape)
    return _ops.layer_norm_fwd.default(input, shape, weight, bias, eps, weight_offset, memory_efficient)[0]


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    weight_offset: float = 0.0,
    round_normalized: bool = False,
    memory_efficient: bool = False,
) -> Tensor:
    """Root-mean-square normalization, as :func:`torch.nn.functional.rms_norm`.

    ``eps=None`` uses torch's default: the machine epsilon of the accumulation dtype
    (float32's for float16/bfloat16/float32 input, float64's for float64 input).

    Two options reproduce other libraries' rounding (the defaults are torch's: the
    normalized value times the weight in float32, rounded once to the input's dtype):

    - ``weight_offset``: the weight enters as ``weight + weight_offset``, added in float32
      (Gemma's ``1 + weight``).
    - ``round_normalized``: the normalized value is rounded to the input's dtype before the
      weight multiply, which then rounds again (Llama's ``weight * x_normed.to(input_dtype)``).
      The backward follows the same rounding: ``dy * weight`` is rounded to the input's dtype,
      and the weight gradient sums ``dy * rounded_xhat`` rounded to the input's dtype.

    ``memory_efficient``: as :func:`layer_norm`'s, the normalized input recovered as ``y / (weight +
    weight_offset)``.
    """
    if not memory_efficient and _eager(input, weight):
        return _C.rms_norm(input, normalized_shape, weight, eps, weight_offset, round_normalized)
    shape = _as_shape(normalized_shape)
    return _ops.rms_norm_fwd.default(input, shape, weight, eps, weight_offset, round_normalized, memory_efficient)[0]


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    residual_dtype: torch.dtype | None = None,
    *,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Residual add and layer normalization in one pass: returns ``(y, residual_out)``.

    ``residual_out = x + residual`` in ``residual_dtype`` (default: ``x.dtype``; float32 keeps a
    float32 residual stream under float16/bfloat16 ``x``), and ``y = layer_norm(residual_out)`` in
    ``x.dtype``. ``residual`` has ``x``'s shape and ``x.dtype`` or ``residual_dtype``. Both outputs
    are new tensors. The gradient of ``x`` and of ``residual`` is the same: that of ``residual_out``
    through the norm plus the incoming gradient of ``residual_out``. ``weight_offset`` is
    :func:`layer_norm`'s.
    """
    if _eager(x, residual, weight, bias):
        return _C.add_layer_norm(x, residual, normalized_shape, weight, bias, eps, residual_dtype, weight_offset)
    shape = _as_shape(normalized_shape)
    y, residual_out, _, _ = _ops.add_layer_norm_fwd.default(
        x, residual, shape, weight, bias, eps, residual_dtype, weight_offset
    )
    return y, residual_out


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    residual_dtype: torch.dtype | None = None,
    *,
    weight_offset: float = 0.0,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor]:
    """Residual add and RMS normalization in one pass: returns ``(y, residual_out)``, as :func:`add_layer_norm`.

    ``weight_offset`` and ``round_normalized`` are :func:`rms_norm`'s (Gemma's and Llama's rounding): ``y`` is
    ``rms_norm(residual_out, ...)`` with them, bit for bit.
    """
    if _eager(x, residual, weight):
        return _C.add_rms_norm(
            x, residual, normalized_shape, weight, eps, residual_dtype, weight_offset, round_normalized
        )
    y, residual_out, _ = _ops.add_rms_norm_fwd.default(
        x, residual, _as_shape(normalized_shape), weight, eps, residual_dtype, weight_offset, round_normalized
    )
    return y, residual_out


def qk_rms_norm(
    qkv: Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: Tensor | None = None,
    k_weight: Tensor | None = None,
    eps: float | None = None,
    *,
    weight_offset: float = 0.0,
    round_normalized: bool = False,
) -> tuple[Tensor, Tensor]:
    """QK-norm on a packed QKV projection: RMS-normalizes each head of q and of k, read in place.

    ``qkv`` is ``[..., (q_heads + 2 * kv_heads) * head_dim]``, q's heads first, then k's, then v's (the layout of
    vLLM's and Megatron's fused projections and of ``torch.cat([q, k, v], -1)``). Returns ``(q, k)``, new contiguous
    tensors of shape ``[..., q_heads, head_dim]`` and ``[..., kv_heads, head_dim]``: ``rms_norm`` of each head with
    ``q_weight`` / ``k_weight`` (``[head_dim]``), ``eps`` and the rounding options of :func:`rms_norm`, bit for bit.
    v is left alone: ``qkv[..., (q_heads + kv_heads) * head_dim:]``.

    The heads are read through the view's strides, with no copy of qkv, forward and backward (autograd saves the
    views). q and k take one kernel launch each: one launch for both would need a weight chosen per row.
    """
    for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ValueError(f"torch_ln.qk_rms_norm: expected {name} to be positive, but got {name}={value}")
    width = (q_heads + 2 * kv_heads) * head_dim
    if qkv.dim() < 1 or qkv.shape[-1] != width:
        raise ValueError(
            f"torch_ln.qk_rms_norm: expected qkv's last dimension to be (q_heads + 2 * kv_heads) * head_dim = "
            f"({q_heads} + 2 * {kv_heads}) * {head_dim} = {width}, but got qkv.shape={tuple(qkv.shape)}"
        )
    q = qkv[..., : q_heads * head_dim].unflatten(-1, (q_heads, head_dim))
    k = qkv[..., q_heads * head_dim : (q_heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    options = {"weight_offset": weight_offset, "round_normalized": round_normalized}
    return rms_norm(q, head_dim, q_weight, eps, **options), rms_norm(k, head_dim, k_weight, eps, **options)


def gated_rms_norm(
    input: Tensor,
    gate: Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    gate_position: str = "after",
    activation: str = "silu",
    group_size: int | None = None,
    round_normalized: bool = False,
) -> Tensor:
    """Gated RMS normalization (the hybrid SSM and linear-attention models' ``*RMSNormGated``): with
    ``gate_position="after"`` ``rms_norm(input) * act(gate)`` (Qwen3-Next, fla's ``FusedRMSNormGated``),
    ``"before"`` ``rms_norm(input * act(gate))`` (Mamba2's ``y * silu(z)`` then the norm); ``activation`` is
    ``"silu"`` or ``"sigmoid"``; ``gate=None`` leaves the gate out. act(gate) and its product are computed in float32
    (float64 for float64 input), as the statistics.

    ``group_size``: each group of that many consecutive elements of a row has its own rstd (Mamba2's ``n_groups``); a
    divisor of the normalized size. ``eps=None`` is :func:`rms_norm`'s default.

    ``round_normalized`` (Llama's rounding, as :func:`rms_norm`'s): the normalized value is rounded to the input's
    dtype before the weight multiply, and with a gate after the norm the weighted value too where the weight has the
    input's dtype (Qwen3-Next's ``weight * x.to(dtype)``, then times the float32 gate). Otherwise float32 throughout,
    one rounding at the end. :func:`torch_ln.reference.gated_rms_norm` is the arithmetic, in torch ops.
    """
    shape = _as_shape(normalized_shape)
    options = (gate_position, activation, group_size, round_normalized)
    return _ops.gated_rms_norm_fwd.default(input, gate, shape, weight, eps, *options)[0]


def empty_output_cache() -> int:
    """Returns the CPU outputs that torch_ln keeps for reuse (freed y, residual_out and dx of 1 MiB or more, up to
    TORCH_LN_OUTPUT_CACHE_MB, default 256) to the system allocator, and the number of bytes they held."""
    return _ops.empty_output_cache()


def output_cache_bytes() -> int:
    """The bytes of freed CPU outputs that torch_ln keeps for reuse now (see empty_output_cache)."""
    return _ops.output_cache_bytes()


# Fake kernels: shapes and dtypes only, for torch.compile and torch.export.


def _statistics(input: Tensor, normalized_shape: Sequence[int]) -> Tensor:
    axis = input.dim() - len(normalized_shape)
    shape = list(input.shape[:axis]) + [1] * len(normalized_shape)
    return input.new_empty(shape, dtype=reference.accumulation_dtype(input.dtype))


def _unrequested(input: Tensor) -> Tensor:
    return input.new_empty((0,))


@torch.library.register_fake("torch_ln::layer_norm_fwd")
def _(input, normalized_shape, weight, bias, eps, weight_offset=0.0, memory_efficient=False):
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format),
        _statistics(input, normalized_shape),
        _statistics(input, normalized_shape),
    )


@torch.library.register_fake("torch_ln::rms_norm_fwd")
def _(input, normalized_shape, weight, eps, weight_offset=0.0, round_normalized=False, memory_efficient=False):
    return torch.empty_like(input, memory_format=torch.contiguous_format), _statistics(input, normalized_shape)


@torch.library.register_fake("torch_ln::gated_rms_norm_fwd")
def _(
    input,
    gate,
    normalized_shape,
    weight,
    eps,
    gate_position="after",
    activation="silu",
    group_size=None,
    round_normalized=False,
):
    y = torch.empty_like(input, memory_format=torch.contiguous_format)
    cols = math.prod(normalized_shape)
    if group_size is None or group_size == cols:
        return y, _statistics(input, normalized_shape)
    batch = list(input.shape[: input.dim() - len(normalized_shape)])
    return y, input.new_empty([*batch, cols // group_size], dtype=reference.accumulation_dtype(input.dtype))


@torch.library.register_fake("torch_ln::gated_rms_norm_bwd")
def _(grad_out, input, gate, normalized_shape, rstd, weight, output_mask, *options):
    return _fake_grads(input, [gate, weight], output_mask)


def _residual_out(input: Tensor, residual_dtype: torch.dtype | None) -> Tensor:
    return torch.empty_like(input, dtype=residual_dtype or input.dtype, memory_format=torch.contiguous_format)


@torch.library.register_fake("torch_ln::add_layer_norm_fwd")
def _(input, residual, normalized_shape, weight, bias, eps, residual_dtype, weight_offset=0.0):
    stats = _statistics(input, normalized_shape), _statistics(input, normalized_shape)
    return torch.empty_like(input, memory_format=torch.contiguous_format), _residual_out(input, residual_dtype), *stats


@torch.library.register_fake("torch_ln::add_rms_norm_fwd")
def _(input, residual, normalized_shape, weight, eps, residual_dtype, weight_offset=0.0, round_normalized=False):
    y = torch.empty_like(input, memory_format=torch.contiguous_format)
    return y, _residual_out(input, residual_dtype), _statistics(input, normalized_shape)


def _fake_grads(input: Tensor, params: Sequence[Tensor | None], output_mask: Sequence[bool]) -> tuple[Tensor, ...]:
    dx = torch.empty_like(input, memory_format=torch.contiguous_format) if output_mask[0] else _unrequested(input)
    grads = [
        torch.empty_like(p, memory_format=torch.contiguous_format) if wanted and p is not None else _unrequested(input)
        for p, wanted in zip(params, output_mask[1:])
    ]
    return (dx, *grads)


@torch.library.register_fake("torch_ln::layer_norm_bwd")
def _(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask, weight_offset=0.0, from_output=False):
    return _fake_grads(input, (weight, bias), output_mask)


@torch.library.register_fake("torch_ln::rms_norm_bwd")
def _(
    grad_out,
    input,
    normalized_shape,
    rstd,
    weight,
    output_mask,
    weight_offset=0.0,
    round_normalized=False,
    from_output=False,
):
    return _fake_grads(input, (weight,), output_mask)


@torch.library.register_fake("torch_ln::add_layer_norm_bwd")
def _(
    grad_out,
    grad_residual_out,
    residual_out,
    normalized_shape,
    mean,
    rstd,
    weight,
    bias,
    output_mask,
    weight_offset=0.0,
):
    return _fake_grads(residual_out, (weight, bias), output_mask)


@torch.library.register_fake("torch_ln::add_rms_norm_bwd")
def _(
    grad_out,
    grad_residual_out,
    residual_out,
    normalized_shape,
    rstd,
    weight,
    output_mask,
    weight_offset=0.0,
    round_normalized=False,
):
    return _fake_grads(residual_out, (weight,), output_mask)


# Autograd. The forward saves mean and rstd; the backward kernels use them and
# never recompute the statistics. When the backward itself must be
# differentiable (create_graph=True, for double backward; torch.func always
# asks for it), the gradients come from the closed-form backward in torch ops
# (reference.norm_backward), so that their dependence on the input, weight and
# grad_out is part of the graph.


def _save_for_backward(ctx, rows: Tensor, weight: Tensor | None, bias: Tensor | None, statistics: tuple) -> None:
    """Saves only what the requested gradients need: dbias alone needs none of it. `rows`: the input, or under
    memory_efficient the output."""
    needs_dx, _, needs_dweight, *_ = ctx.needs_input_grad
    keep = needs_dx or needs_dweight
    ctx.bias_dtype = bias.dtype if bias is not None else None
    kept = (rows, weight, bias, *statistics) if keep else (None,) * (3 + len(statistics))
    ctx.save_for_backward(*kept)


def _sum_rows(grad_out: Tensor, normalized_shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The bias gradient: grad_out summed over the batch dimensions, accumulated in float32 (float64)."""
    batch_dims = list(range(grad_out.dim() - len(normalized_shape)))
    if not batch_dims:  # sum([]) would sum everything
        return grad_out.to(dtype)
    return grad_out.sum(batch_dims, dtype=reference.accumulation_dtype(dtype)).to(dtype)


_OPTION_DEFAULTS = {"weight_offset": 0.0, "round_normalized": False, "memory_efficient": False}


def _options(ctx, options: Sequence, centred: bool) -> None:
    """The forward's trailing arguments, by name (the schema's defaults where a caller of the raw operator left them
    out): ctx.rounding, the backward op's rounding arguments (weight_offset, and for RMSNorm round_normalized), and
    ctx.memory_efficient."""
    names = (
        ("weight_offset", "memory_efficient") if centred else ("weight_offset", "round_normalized", "memory_efficient")
    )
    given = {name: options[i] if i < len(options) else _OPTION_DEFAULTS[name] for i, name in enumerate(names)}
    ctx.memory_efficient = given.pop("memory_efficient")
    ctx.rounding = given


def _offset_weight(weight: Tensor | None, rounding: dict) -> Tensor | None:
    """The weight the norm multiplies by (weight + weight_offset), for the closed-form double backward; dweight is
    the same with or without the offset."""
    offset = rounding["weight_offset"]
    return weight + offset if weight is not None and offset else weight


def _check_single_backward(ctx, name: str) -> None:
    if ctx.memory_efficient:
        raise RuntimeError(
            f"torch_ln.{name}: memory_efficient=True has no double backward (create_graph=True, torch.func): the "
            "closed-form backward needs the input, which was not saved; use memory_efficient=False"
        )


def _layer_norm_setup_context(ctx, inputs, output):
    input, normalized_shape, weight, bias, eps, *options = inputs
    ctx.normalized_shape, ctx.eps = list(normalized_shape), eps
    _options(ctx, options, centred=True)
    _save_for_backward(ctx, output[0] if ctx.memory_efficient else input, weight, bias, output[1:])


def _layer_norm_backward(ctx, grad_out, _grad_mean, _grad_rstd):
    rows, weight, bias, mean, rstd = ctx.saved_tensors
    needs_dx, _, needs_dweight, needs_dbias, *_ = ctx.needs_input_grad
    if rows is None:
        return None, None, None, _sum_rows(grad_out, ctx.normalized_shape, ctx.bias_dtype), None, None, None
    if _needs_double_backward(grad_out, rows, weight, bias):
        _check_single_backward(ctx, "layer_norm")
        dx, dweight, dbias = reference.norm_backward(
            grad_out, rows, ctx.normalized_shape, _offset_weight(weight, ctx.rounding), bias, ctx.eps, centred=True
        )
    else:
        mask = [needs_dx, needs_dweight, needs_dbias]
        dx, dweight, dbias = _ops.layer_norm_bwd(
            grad_out,
            rows,
            ctx.normalized_shape,
            mean,
            rstd,
            weight,
            bias,
            mask,
            **ctx.rounding,
            from_output=ctx.memory_efficient,
        )
    dweight, dbias = (dweight if needs_dweight else None), (dbias if needs_dbias else None)
    return dx if needs_dx else None, None, dweight, dbias, None, None, None


def _rms_norm_setup_context(ctx, inputs, output):
    input, normalized_shape, weight, eps, *options = inputs
    ctx.normalized_shape, ctx.eps = list(normalized_shape), eps
    _options(ctx, options, centred=False)
    _save_for_backward(ctx, output[0] if ctx.memory_efficient else input, weight, None, output[1:])


def _rms_norm_backward(ctx, grad_out, _grad_rstd):
    rows, weight, _, rstd = ctx.saved_tensors
    needs_dx, _, needs_dweight, *_ = ctx.needs_input_grad
    if _needs_double_backward(grad_out, rows, weight):
        _check_single_backward(ctx, "rms_norm")
        # round_normalized's roundings are not differentiable and this closed form leaves them out: it differs from
        # the kernel by those roundings only.
        dx, dweight, _ = reference.norm_backward(
            grad_out, rows, ctx.normalized_shape, _offset_weight(weight, ctx.rounding), None, ctx.eps, centred=False
        )
    else:
        dx, dweight = _ops.rms_norm_bwd(
            grad_out,
            rows,
            ctx.normalized_shape,
            rstd,
            weight,
            [needs_dx, needs_dweight],
            **ctx.rounding,
            from_output=ctx.memory_efficient,
        )
    return dx if needs_dx else None, None, dweight if needs_dweight else None, None, None, None, None


# The residual-add operators save residual_out (an output) instead of the input: the backward reads it once, and
# the double backward differentiates the norm of it, whose graph leads back to x and residual through this node.


def _add_norm_setup_context(ctx, inputs, output):
    input, residual, normalized_shape, weight, *rest = inputs
    layer = len(output) == 4  # (y, residual_out, mean, rstd); RMSNorm has no mean (and no bias argument)
    bias, eps, _residual_dtype, *options = rest if layer else (None, *rest)
    ctx.normalized_shape, ctx.eps = list(normalized_shape), eps
    _options(ctx, options, centred=layer)
    ctx.input_dtype, ctx.residual_dtype = input.dtype, residual.dtype
    needs_dx, needs_dresidual, _, needs_dweight, *_ = ctx.needs_input_grad
    ctx.bias_dtype = bias.dtype if bias is not None else None
    kept = (output[1], weight, bias, *output[2:])
    ctx.save_for_backward(*(kept if needs_dx or needs_dresidual or needs_dweight else (None,) * len(kept)))


def _add_norm_backward(ctx, grad_out, grad_residual_out, *_grad_statistics):
    """Gradients of (x, residual, weight[, bias]) from the one gradient of residual_out."""
    residual_out, weight, bias, *statistics = ctx.saved_tensors
    layer = len(statistics) == 2
    needs_dx, needs_dresidual, _, needs_dweight, *rest = ctx.needs_input_grad
    needs_dbias = layer and rest[0]
    needs_dh = needs_dx or needs_dresidual
    if residual_out is None:  # only dbias wanted
        dh = dweight = None
        dbias = _sum_rows(grad_out, ctx.normalized_shape, ctx.bias_dtype)
    elif _needs_double_backward(grad_out, grad_residual_out, residual_out, weight, bias):
        offset_weight = _offset_weight(weight, ctx.rounding)
        dh, dweight, dbias = reference.norm_backward(
            grad_out, residual_out, ctx.normalized_shape, offset_weight, bias, ctx.eps, centred=layer
        )
        dh = dh + grad_residual_out if needs_dh else None
    elif layer:
        mask = [needs_dh, needs_dweight, needs_dbias]
        dh, dweight, dbias = _ops.add_layer_norm_bwd(
            grad_out,
            grad_residual_out,
            residual_out,
            ctx.normalized_shape,
            *statistics,
            weight,
            bias,
            mask,
            **ctx.rounding,
        )
    else:
        dh, dweight = _ops.add_rms_norm_bwd(
            grad_out,
            grad_residual_out,
            residual_out,
            ctx.normalized_shape,
            *statistics,
            weight,
            [needs_dh, needs_dweight],
            **ctx.rounding,
        )
        dbias = None
    grads = [
        dh.to(ctx.input_dtype) if needs_dx else None,
        dh.to(ctx.residual_dtype) if needs_dresidual else None,
        None,
        dweight if needs_dweight else None,
    ]
    # None for eps, residual_dtype and the rounding options (weight_offset[, round_normalized]).
    return (*grads, dbias if needs_dbias else None, None, None, None) if layer else (*grads, None, None, None, None)


def _needs_double_backward(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _norm_backward_composite(grad_out, input, normalized_shape, weight, bias, eps, centred):
    grads = reference.norm_backward(grad_out, input, normalized_shape, weight, bias, eps, centred)
    return [g if g is not None else _unrequested(input) for g in grads]


# The C++ autograd's (csrc/autograd.cpp) double backward: the same closed form as the Python path's.
_transforms.LIB.impl("norm_backward_composite", _norm_backward_composite, "CompositeImplicitAutograd")

_GATE_OPTIONS = {"gate_position": "after", "activation": "silu", "group_size": None, "round_normalized": False}


def _gated_rms_norm_setup_context(ctx, inputs, output):
    input, gate, normalized_shape, weight, eps, *options = inputs
    ctx.normalized_shape, ctx.eps = list(normalized_shape), eps
    ctx.options = {
        name: options[i] if i < len(options) else default for i, (name, default) in enumerate(_GATE_OPTIONS.items())
    }
    ctx.save_for_backward(input, gate, weight, output[1])


def _gated_rms_norm_backward(ctx, grad_out, _grad_rstd):
    input, gate, weight, rstd = ctx.saved_tensors
    needs_dx, needs_dgate, _, needs_dweight, *_ = ctx.needs_input_grad
    if _needs_double_backward(grad_out, input, gate, weight):
        # Differentiable again: the closed-form gradients in torch ops (reference.gated_rms_norm_backward, the same
        # arithmetic less its roundings), over rows flattened to the normalized size.
        grads = _gated_rms_norm_composite_grads(ctx, grad_out, input, gate, weight)
    else:
        mask = [needs_dx, needs_dgate and gate is not None, needs_dweight and weight is not None]
        grads = _ops.gated_rms_norm_bwd(
            grad_out, input, gate, ctx.normalized_shape, rstd, weight, mask, *ctx.options.values()
        )
    dx, dgate, dweight = (g if wanted else None for g, wanted in zip(grads, (needs_dx, needs_dgate, needs_dweight)))
    return dx, dgate, None, dweight, None, None, None, None, None


def _gated_rms_norm_composite_grads(ctx, grad_out, input, gate, weight):
    rows = input.flatten(input.dim() - len(ctx.normalized_shape))
    options = {k: v for k, v in ctx.options.items() if k != "round_normalized"}
    grads = reference.gated_rms_norm_backward(
        grad_out.reshape(rows.shape),
        rows,
        None if gate is None else gate.reshape(rows.shape),
        None if weight is None else weight.reshape(-1),
        ctx.eps,
        **options,
    )
    return [None if g is None else g.reshape(like.shape) for g, like in zip(grads, (input, gate, weight))]


# As torch.library.register_autograd, plus what torch.func needs (jvp, batching): see torch_ln/_transforms.py.
_transforms.register_autograd(
    "torch_ln::gated_rms_norm_fwd", _gated_rms_norm_backward, setup_context=_gated_rms_norm_setup_context
)
_transforms.register_autograd("torch_ln::layer_norm_fwd", _layer_norm_backward, setup_context=_layer_norm_setup_context)
_transforms.register_autograd("torch_ln::rms_norm_fwd", _rms_norm_backward, setup_context=_rms_norm_setup_context)
for _op in ("torch_ln::add_layer_norm_fwd", "torch_ln::add_rms_norm_fwd"):
    _transforms.register_autograd(_op, _add_norm_backward, setup_context=_add_norm_setup_context)

# Autocast as torch's at each release (its autocast_mode.h, AT_FORALL_FP32): on CUDA, layer_norm runs in float32
# from 2.11 on, rms_norm from 2.12 on (2.11 has no rule: the input's dtype); torch_ln takes the same float32 rule
# where torch has one, the fused add with its norm (residual_out is then float32). CPU autocast lists neither norm
# (fallthrough: the input's dtype), so torch_ln registers nothing there. tests/test_autocast_rules.py checks the
# output dtypes against torch's on fake CUDA tensors, with no GPU.
for _norm in ("layer_norm", "rms_norm"):
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_norm}", "AutocastCUDA"):
        for _op in (f"torch_ln::{_norm}_fwd", f"torch_ln::add_{_norm}_fwd"):
            torch.library.register_autocast(_op, "cuda", torch.float32)
