"""torch.func support for the torch_ln operators: batching rules, forward-mode AD, and the autograd.Function
that grad, vjp, jacrev, jacfwd and jvp can see through.

OPS describes each operator once (which tensor arguments hold one slice per row, which are the affine
parameters, how its jvp or its per-sample parameter gradients are computed); the batching rules, the jvp and
the DTensor sharding strategies (torch_ln/_distributed.py) are all read off it, so a new operator is one entry.

Batching (torch.vmap): the vmapped dimension of the row arguments is moved to the front and becomes more rows
for the same kernel (row arguments that are not vmapped are expanded to it); a vmapped dimension that falls
inside normalized_shape is handled the same way. The backward kernel sums dweight/dbias over all rows, so
under vmap those are summed per sample with torch ops instead (as torch's own batching rule does). Only a
vmapped weight or bias (model ensembles) runs one kernel call per sample (`_per_sample`).

Forward-mode AD: a closed-form jvp in torch ops, from statistics recomputed from the input so that the
tangent is itself differentiable (jacrev of jacfwd, hessian).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.autograd.forward_ad
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from torch_ln import reference


@dataclass(frozen=True)
class OpInfo:
    """What the transforms need to know about one torch_ln operator (arguments named as in its schema)."""

    rows: tuple[str, ...]  # tensors with the input's batch dims: input-shaped, or statistics (size-1 normalized dims)
    params: tuple[str, ...]  # tensors shaped like normalized_shape: weight, bias
    # Forward ops: (arguments, tangents), both by name -> the tangent of every output.
    jvp: Callable[[dict, dict], tuple[Tensor, ...]] | None = None
    # Backward ops (outputs: the row gradients, then one gradient per param, chosen by output_mask): (arguments with
    # the vmapped dim in front, wanted per param) -> each sample's parameter gradients (None where not wanted).
    param_grads: Callable[[dict, Sequence[bool]], list[Tensor | None]] | None = None
    row_grads: int = 1  # the backward's gradients of row arguments: dinput (and a gated norm's dgate)


def _op(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.torch_ln, name).default


def _arg_names(name: str) -> list[str]:
    return [a.name for a in _op(name)._schema.arguments]


# ------------------------------------------------------------------------------------------------
# Forward-mode AD, and per-sample parameter gradients (the backward ops under vmap)
# ------------------------------------------------------------------------------------------------


def _norm_jvp(args: dict, tangents: dict, centred: bool) -> tuple[Tensor, ...]:
    """Tangents of (y, mean, rstd) (RMSNorm: y, rstd) for y = xhat * (weight + weight_offset) + bias."""
    input, weight, bias = args["input"], args["weight"], args.get("bias")
    xhat, _, rstd = reference.normalize(input, args["normalized_shape"], args["eps"], centred)
    dinput = tangents["input"] if tangents["input"] is not None else torch.zeros_like(input)
    dy, dmean, drstd = reference.normalization_jvp(xhat, rstd, dinput, len(args["normalized_shape"]), centred)
    if weight is not None:
        dy = dy * (weight.to(dy.dtype) + args["weight_offset"])
        if tangents["weight"] is not None:
            dy = dy + xhat * tangents["weight"].to(dy.dtype)
    if bias is not None and tangents["bias"] is not None:
        dy = dy + tangents["bias"].to(dy.dtype)
    return (dy.to(input.dtype), dmean, drstd) if centred else (dy.to(input.dtype), drstd)


def _add_norm_jvp(args: dict, tangents: dict, centred: bool) -> tuple[Tensor, ...]:
    """Tangents of (y, residual_out, statistics): the norm's jvp at residual_out = x + residual, y in x's dtype."""
    input, residual = args["input"], args["residual"]
    dtype = args["residual_dtype"] or input.dtype
    # Summed in the accumulation dtype and rounded to the stream dtype, as the kernels do.
    acc = reference.accumulation_dtype(dtype)
    residual_out = (input.to(acc) + residual.to(acc)).to(dtype)
    parts = [t.to(dtype) for t in (tangents["input"], tangents["residual"]) if t is not None]
    dresidual_out = sum(parts[1:], parts[0]) if parts else torch.zeros_like(residual_out)
    dy, *dstatistics = _norm_jvp({**args, "input": residual_out}, {**tangents, "input": dresidual_out}, centred)
    return dy.to(input.dtype), dresidual_out, *dstatistics


def _per_sample_affine_grads(args: dict, xhat: Tensor, params: tuple, wanted: Sequence[bool]) -> list:
    params = [p if want else None for p, want in zip(params, wanted)]
    return reference.affine_grads(args["grad_out"], xhat, params, len(args["normalized_shape"]), first_row_dim=1)


# `normalized`: the name of the backward op's argument that holds the norm's input (the fused ops': residual_out).


def _saved_xhat(args: dict, normalized: str, centred: bool) -> Tensor:
    """xhat from the backward op's rows: the norm's input with its statistics, or (from_output: memory_efficient's
    backward, a norm without bias) the forward's output y, as y / (weight + weight_offset)."""
    rows = args[normalized].to(args["rstd"].dtype)
    if args.get("from_output", False):
        weight = args["weight"]
        return rows / (weight.to(rows.dtype) + args["weight_offset"]) if weight is not None else rows
    return (rows - args["mean"]) * args["rstd"] if centred else rows * args["rstd"]


def _layer_norm_param_grads(args: dict, wanted: Sequence[bool], normalized: str = "input") -> list[Tensor | None]:
    xhat = _saved_xhat(args, normalized, centred=True)
    return _per_sample_affine_grads(args, xhat, (args["weight"], args["bias"]), wanted)


def _rms_norm_param_grads(args: dict, wanted: Sequence[bool], normalized: str = "input") -> list[Tensor | None]:
    xhat = _saved_xhat(args, normalized, centred=False)
    return _per_sample_affine_grads(args, xhat, (args["weight"],), wanted)


def _gated_rows(args: dict, name: str, dtype: torch.dtype) -> Tensor:
    """A row argument of a gated op in `dtype`, its normalized dims flattened into one."""
    return args[name].to(dtype).flatten(-len(args["normalized_shape"]))


def _gated_norm_jvp(args: dict, tangents: dict) -> tuple[Tensor, Tensor]:
    """Tangents of (y, rstd) of the gated RMSNorm (reference.gated_rms_norm's arithmetic, its roundings aside): h = x,
    or x * act(z) with the gate before the norm; each group of h normalized as a row; times the weight; times act(z)
    with the gate after the norm."""
    input, gate, weight, shape = args["input"], args["gate"], args["weight"], args["normalized_shape"]
    acc, cols = reference.accumulation_dtype(input.dtype), math.prod(shape)
    size = args["group_size"] or cols
    eps = reference.default_rms_eps(input.dtype) if args["eps"] is None else args["eps"]

    def tangent(name: str) -> Tensor:
        t = tangents[name]
        return _gated_rows({**args, name: t if t is not None else torch.zeros_like(args[name])}, name, acc)

    h, dh = _gated_rows(args, "input", acc), tangent("input")
    if gate is not None:
        z = _gated_rows(args, "gate", acc)
        act, dact = (
            reference.GATE_ACTIVATIONS[args["activation"]](z),
            reference.gate_slope(z, args["activation"]) * tangent("gate"),
        )
        if args["gate_position"] == "before":
            h, dh = h * act, dh * act + h * dact
    xhat, _, rstd = reference.normalize(h.unflatten(-1, (-1, size)), [size], eps, centred=False)
    dxhat, _, drstd = reference.normalization_jvp(xhat, rstd, dh.unflatten(-1, (-1, size)), 1, centred=False)
    out, dout = xhat.flatten(-2), dxhat.flatten(-2)
    if weight is not None:
        w = weight.to(acc).flatten()
        dout = dout * w if tangents["weight"] is None else dout * w + out * tangents["weight"].to(acc).flatten()
        out = out * w
    if gate is not None and args["gate_position"] == "after":
        dout = dout * act + out * dact
    batch = input.shape[: input.dim() - len(shape)]
    statistics = (*batch, cols // size) if size != cols else (*batch, *(1,) * len(shape))
    return dout.unflatten(-1, tuple(shape)).to(input.dtype), drstd.reshape(statistics)


def _gated_norm_param_grads(args: dict, wanted: Sequence[bool]) -> list[Tensor | None]:
    """dweight per sample: the sum over its rows of dy * xhat, xhat = h * rstd of each group (h = x * act(z) with the
    gate before the norm), dy * act(z) with the gate after it."""
    gate, rstd, weight = args["gate"], args["rstd"], args["weight"]
    h, g = _gated_rows(args, "input", rstd.dtype), _gated_rows(args, "grad_out", rstd.dtype)
    if gate is not None:
        act = reference.GATE_ACTIVATIONS[args["activation"]](_gated_rows(args, "gate", rstd.dtype))
        h, g = (h * act, g) if args["gate_position"] == "before" else (h, g * act)
    xhat = (h.unflatten(-1, (*rstd.shape[h.dim() - 1 :], -1)) * rstd.unsqueeze(-1)).flatten(h.dim() - 1)
    (dweight,) = reference.affine_grads(g, xhat, (weight if wanted[0] else None,), 1, first_row_dim=1)
    return [None if dweight is None else dweight.unflatten(-1, weight.shape)]


_FUSED_BWD_ROWS = ("grad_out", "grad_residual_out", "residual_out")

OPS: dict[str, OpInfo] = {
    "layer_norm_fwd": OpInfo(rows=("input",), params=("weight", "bias"), jvp=partial(_norm_jvp, centred=True)),
    "layer_norm_bwd": OpInfo(
        rows=("grad_out", "input", "mean", "rstd"), params=("weight", "bias"), param_grads=_layer_norm_param_grads
    ),
    "rms_norm_fwd": OpInfo(rows=("input",), params=("weight",), jvp=partial(_norm_jvp, centred=False)),
    "rms_norm_bwd": OpInfo(rows=("grad_out", "input", "rstd"), params=("weight",), param_grads=_rms_norm_param_grads),
    # Residual add + norm: residual and residual_out are rows like the input.
    "add_layer_norm_fwd": OpInfo(
        rows=("input", "residual"), params=("weight", "bias"), jvp=partial(_add_norm_jvp, centred=True)
    ),
    "add_layer_norm_bwd": OpInfo(
        rows=(*_FUSED_BWD_ROWS, "mean", "rstd"),
        params=("weight", "bias"),
        param_grads=partial(_layer_norm_param_grads, normalized="residual_out"),
    ),
    "add_rms_norm_fwd": OpInfo(
        rows=("input", "residual"), params=("weight",), jvp=partial(_add_norm_jvp, centred=False)
    ),
    "add_rms_norm_bwd": OpInfo(
        rows=(*_FUSED_BWD_ROWS, "rstd"),
        params=("weight",),
        param_grads=partial(_rms_norm_param_grads, normalized="residual_out"),
    ),
    # The gated RMSNorm: the gate is a row like the input; rstd holds a value per row and group.
    "gated_rms_norm_fwd": OpInfo(rows=("input", "gate"), params=("weight",), jvp=_gated_norm_jvp),
    "gated_rms_norm_bwd": OpInfo(
        rows=("grad_out", "input", "gate", "rstd"),
        params=("weight",),
        param_grads=_gated_norm_param_grads,
        row_grads=2,
    ),
}


# ------------------------------------------------------------------------------------------------
# Batching rules
# ------------------------------------------------------------------------------------------------


def _per_sample(op, batch_size: int, in_dims: Sequence[int | None], args: Sequence) -> tuple[tuple, tuple]:
    """One call per sample, stacked: only for a vmapped weight or bias, which the kernels take one of."""

    def sample(i: int) -> list:
        return [a.select(d, i) if isinstance(d, int) else a for a, d in zip(args, in_dims)]

    results = [op(*sample(i)) for i in range(batch_size)]
    return tuple(torch.stack(outputs) for outputs in zip(*results)), (0,) * len(results[0])


def batching_rule(name: str) -> Callable:
    """The vmap rule of torch_ln::<name>: (info, in_dims, *args) -> (outputs, out_dims)."""
    op, info, names = _op(name), OPS[name], _arg_names(name)

    def rule(vmap_info, in_dims, *args):
        if len(args) < len(names):  # the dispatcher drops arguments left at their defaults
            args, _ = torch._library.utils.fill_defaults(op._schema, args, {})
        in_dims = (*in_dims, *(None,) * (len(args) - len(in_dims)))
        dims = dict(zip(names, in_dims))
        if any(dims[p] is not None for p in info.params):
            return _per_sample(op, vmap_info.batch_size, in_dims, args)
        named = dict(zip(names, args))
        for row in info.rows:
            t, d = named[row], dims[row]
            if t is not None:  # an optional row (grad_residual_out) may be absent
                named[row] = t.movedim(d, 0) if d is not None else t.expand(vmap_info.batch_size, *t.shape)
        if info.param_grads is None:
            outputs = op(*named.values())
            return outputs, (0,) * len(outputs)
        wanted, rows = list(named["output_mask"]), info.row_grads
        named["output_mask"] = wanted[:rows] + [False] * len(info.params)  # the kernel would sum over samples
        outputs = op(*named.values())
        grads = info.param_grads(named, wanted[rows:])
        outputs = (*outputs[:rows], *(g if g is not None else empty for g, empty in zip(grads, outputs[rows:])))
        out_dims = (*(0 if w else None for w in wanted[:rows]), *(0 if g is not None else None for g in grads))
        return outputs, out_dims

    return rule


for _name in OPS:
    torch.library.register_vmap(f"torch_ln::{_name}", batching_rule(_name))


# ------------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------------

LIB = torch.library.Library("torch_ln", "FRAGMENT")


def _forward_ad_active() -> bool:
    # Inside a torch.autograd.forward_ad.dual_level (its level is only kept privately).
    return torch.autograd.forward_ad._current_level >= 0


def register_autograd(qualname: str, backward: Callable, *, setup_context: Callable) -> None:
    """torch.library.register_autograd for a torch_ln forward op, through an autograd.Function that torch.func
    can use (torch's generated one has no setup_context, which torch.func requires) and that has the op's jvp.
    """
    name = qualname.split("::")[1]
    op, info, names = _op(name), OPS[name], _arg_names(name)

    def forward(*args):
        # Below this level's autograd; the levels of enclosing torch.func transforms differentiate as usual
        # (Function.forward turns both gradient modes off).
        with torch._C._AutoDispatchBelowAutograd(), torch.enable_grad(), _set_fwd_grad_enabled(True):
            return op(*args)

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        if not _forward_ad_active():  # no tangents: jvp will not be called
            return
        # For jvp only (autograd drops these after the forward): every argument, the tensors saved properly.
        ctx.tensor_positions = [i for i, a in enumerate(inputs) if isinstance(a, Tensor)]
        ctx.save_for_forward(*(inputs[i] for i in ctx.tensor_positions))
        ctx.jvp_args = [None if isinstance(a, Tensor) else a for a in inputs]

    def jvp(ctx, *tangents):
        args = list(ctx.jvp_args)
        for i, t in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[i] = torch.autograd.forward_ad.unpack_dual(t, level=0).primal  # this level's tangent dropped
        # Forward AD back on (autograd turned it off) so that enclosing jvp/jacfwd levels see this computation.
        with _set_fwd_grad_enabled(True):
            return info.jvp(dict(zip(names, args)), dict(zip(names, tangents)))

    # A single-level Function is what a C++ autograd kernel is to torch.func: it records on the tensors of the
    # transform level being processed (this kernel runs inside the dispatcher, below functorch's front layer).
    function = type(
        "".join(part.title() for part in name.split("_")),  # grad_fn: LayerNormFwdBackward
        (torch.autograd.function._SingleLevelFunction,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
            "_compiled_autograd_key": staticmethod(torch.autograd.Function._compiled_autograd_key),
        },
    )

    def autograd_kernel(keyset, *args):
        if len(args) < len(names):  # the dispatcher drops arguments left at their defaults (fill_defaults is slow)
            args, _ = torch._library.utils.fill_defaults(op._schema, args, {})
        if (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)) or _forward_ad_active():
            if not torch._C._are_functorch_transforms_active():
                return function.apply(*args)
            with enable_single_level_autograd_function():
                return function.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    LIB.impl(name, autograd_kernel, "Autograd", with_keyset=True)
