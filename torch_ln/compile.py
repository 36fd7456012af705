"""A torch.compile backend that puts torch_ln's operators into a model's graph without swapping its modules.

    compiled = torch.compile(model, backend=torch_ln.compile.backend())

Before handing the graph to Inductor (or another backend), it rewrites the graph Dynamo captured (torch IR, before
autograd), where torch_ln's autograd applies to what it puts in, so the same pass serves inference and training:

- ``layer_norm``, ``rms_norm``: calls of ``F.layer_norm`` / ``F.rms_norm`` (nn.LayerNorm and nn.RMSNorm modules
  inlined) become torch_ln's operators;
- ``decomposed_rms_norm``: ``x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)`` with x32 the input in float32,
  followed by the rounding of one of the forms ``replace_norms`` recognizes (torch_ln.integrations): Llama's
  ``weight * normed.to(dtype)`` (``round_normalized``), Gemma's ``normed * (1 + weight.float())`` rounded once
  (``weight_offset=1``), T5's, torch's float32 product rounded once (Gemma3n's, whose rstd is ``pow(..., -0.5)``),
  or the normalized value alone;
- ``decomposed_layer_norm``: the same with ``(x32 - mean) * rsqrt(((x32 - mean) ** 2).mean(...) + eps)``
  (Cohere's form), the weight product in float32 rounded once;
- ``add_norm``: a norm (one put in above, or a torch_ln norm already in the graph) of ``a + b`` becomes the fused
  ``add_rms_norm`` / ``add_layer_norm``, whose ``residual_out`` takes the sum's other uses (the residual stream);
  a float32 stream beside half activations where the norm's output is rounded back to their dtype.

Each rewrite computes exactly what torch_ln's module swap computes for the same form (the same kernels with the
same rounding options): a compiled model equals the swapped model bit for bit, except that the fused add rounds
``dx + d(residual_out)`` once in half precision where autograd of the separate add rounds twice. A form whose dtypes
the kernels do not reproduce is left alone. Why a backend: it is torch.compile's documented extension point, holds
no global state, and composes with any inner backend; ``rewrite`` is the pass itself, for a graph captured another
way (an exported program's module, torch.fx.symbolic_trace).
"""

from __future__ import annotations

import collections
import logging
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["PATTERNS", "backend", "rewrite"]

logger = logging.getLogger("torch_ln")

PATTERNS = ("layer_norm", "rms_norm", "decomposed_rms_norm", "decomposed_layer_norm", "add_norm")

_aten = torch.ops.aten
_ln = torch.ops.torch_ln
_REDUCED = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float32, torch.float64, *_REDUCED)

# What a node computes, whatever form Dynamo (functions, methods, operators) or an ATen graph gives it.
_FUNCTIONS: dict[object, str] = {
    operator.add: "add",
    torch.add: "add",
    _aten.add.Tensor: "add",
    operator.sub: "sub",
    torch.sub: "sub",
    _aten.sub.Tensor: "sub",
    operator.mul: "mul",
    torch.mul: "mul",
    _aten.mul.Tensor: "mul",
    operator.pow: "pow",
    torch.pow: "pow",
    _aten.pow.Tensor_Scalar: "pow",
    torch.square: "square",
    torch.mean: "mean",
    _aten.mean.dim: "mean",
    torch.rsqrt: "rsqrt",
    _aten.rsqrt.default: "rsqrt",
    _aten._to_copy.default: "to",
    _aten.to.dtype: "to",
    torch.ops.prims.convert_element_type.default: "to",
    F.layer_norm: "layer_norm",
    torch.layer_norm: "layer_norm",
    _aten.layer_norm.default: "layer_norm",
    _aten.native_layer_norm.default: "native_layer_norm",  # (y, mean, rstd): ATen graphs after decomposition
    F.rms_norm: "rms_norm",
    torch.rms_norm: "rms_norm",
    _aten.rms_norm.default: "rms_norm",
}
_METHODS = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "pow": "pow",
    "square": "square",
    "mean": "mean",
    "rsqrt": "rsqrt",
    "to": "to",
    "float": "to",
    "type_as": "to",
    "type": "to",
}
# torch_ln's norm operators already in a graph (a swapped model's), which the fused add takes too.
_TORCH_LN_NORMS = {_ln.layer_norm_fwd.default: "layer_norm", _ln.rms_norm_fwd.default: "rms_norm"}


def _kind(node) -> str | None:
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def _value(node):
    """The example value Dynamo (example_value) or make_fx/export (val) recorded for a node."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def _tensor(node) -> torch.Tensor | None:
    value = _value(node)
    return value if isinstance(value, torch.Tensor) else None


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _binary(node: fx.Node) -> tuple | None:
    """The two operands of add/sub/mul (None where an alpha scales one of them)."""
    if _arg(node, 2, "alpha", 1) != 1:
        return None
    return node.args[0], node.args[1]


def _is_conversion(node) -> bool:
    """A dtype conversion that keeps shape, device and layout."""
    if _kind(node) != "to":
        return False
    source, out = _tensor(node.args[0]), _tensor(node)
    return (
        source is not None
        and out is not None
        and source.shape == out.shape
        and source.device == out.device
        and (node.op != "call_function" or set(node.kwargs) <= {"dtype"})
    )


def _through_noop_conversions(node):
    """The node a chain of conversions to the same dtype starts from (Dynamo keeps ``x.to(torch.float32)`` of a
    float32 x)."""
    while _is_conversion(node) and _tensor(node.args[0]).dtype == _tensor(node).dtype:
        node = node.args[0]
    return node


def _float32_source(node) -> fx.Node | None:
    """x for x32 = x converted exactly to float32 (x half, bfloat16 or float32 itself), else None."""
    node = _through_noop_conversions(node)
    value = _tensor(node)
    if value is None or value.dtype != torch.float32:
        return None
    if _is_conversion(node) and _tensor(node.args[0]).dtype in _REDUCED:
        return node.args[0]
    return node


def _is_mean_of_last_dim(node, ndim: int) -> bool:
    if _kind(node) != "mean" or _arg(node, 3, "dtype") is not None or not _arg(node, 2, "keepdim", False):
        return False
    dim = _arg(node, 1, "dim")
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] in (-1, ndim - 1)


def _squared(node):
    """b for b ** 2, b * b or b.square(), else None."""
    kind = _kind(node)
    if kind == "pow" and _arg(node, 1, "exponent") == 2:
        return node.args[0]
    if kind == "square":
        return node.args[0]
    if kind == "mul" and _binary(node) is not None and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _rsqrt_of(node):
    """a for rsqrt(a) or a ** -0.5 (Gemma3n's form), else None."""
    kind = _kind(node)
    if kind == "rsqrt" or (kind == "pow" and _arg(node, 1, "exponent") == -0.5):
        return node.args[0]
    return None


def _is_scalar(value) -> bool:
    """A Python number, or a graph value that is one: Dynamo lifts a module's float attribute (an eps) to an input
    under dynamic=True and reads it with .item(), a SymFloat. Not a tensor: an eps per row is not a norm's."""
    if isinstance(value, fx.Node):
        value = _value(value)
    return isinstance(value, (int, float, torch.SymFloat, torch.SymInt)) and not isinstance(value, bool)


def _eps(node):
    """(variance, eps) for variance + eps with eps a scalar (a number or a scalar node), else None."""
    if _kind(node) != "add" or _binary(node) is None:
        return None
    a, b = node.args[:2]
    for variance, eps in ((a, b), (b, a)):
        if isinstance(variance, fx.Node) and _tensor(variance) is not None and _is_scalar(eps):
            return variance, float(eps) if isinstance(eps, (int, float)) else eps
    return None


def _other(node: fx.Node, operand) -> object:
    a, b = node.args[:2]
    return b if a is operand else a


@dataclass
class _Normalized:
    """A decomposed normalization: node = x32 * rsqrt(statistic + eps), in float32, of the rows of source."""

    node: fx.Node  # the normalized value, float32
    source: fx.Node  # the input before its conversion to float32
    x32: fx.Node  # the float32 input
    eps: float | fx.Node
    centred: bool


def _match_normalized(mul: fx.Node) -> _Normalized | None:
    """mul = a * rsqrt(mean(b^2) + eps) (RMSNorm: b is x32, a is x32 or x) or (x32 - mean) * rsqrt(mean((x32 -
    mean)^2) + eps) (LayerNorm)."""
    if _kind(mul) != "mul" or _binary(mul) is None:
        return None
    for rsqrt in mul.args[:2]:
        if _rsqrt_of(rsqrt) is None:
            continue
        found = _eps(_rsqrt_of(rsqrt))
        if found is None:
            continue
        variance, eps = found
        squared_of = _squared(variance.args[0]) if _kind(variance) == "mean" else None
        factor = _other(mul, rsqrt)
        if squared_of is None or not isinstance(factor, fx.Node) or _tensor(factor) is None:
            continue
        ndim = _tensor(factor).dim()
        if not _is_mean_of_last_dim(variance, ndim):
            continue
        rms = _match_rms(mul, factor, squared_of, eps)
        layer = _match_layer(mul, factor, squared_of, eps, ndim)
        if rms or layer:
            return rms or layer
    return None


def _match_rms(mul, factor, base, eps) -> _Normalized | None:
    source = _float32_source(base)
    if source is None:
        return None
    # T5 multiplies the input in its own dtype by the float32 rstd: promoted, the same product.
    if _through_noop_conversions(factor) is not _through_noop_conversions(base) and factor is not source:
        return None
    return _Normalized(mul, source, _through_noop_conversions(base), eps, centred=False)


def _centred(node, ndim: int) -> tuple | None:
    """(x32, mean) for node = x32 - mean(x32, -1, keepdim=True), else None."""
    if _kind(node) != "sub" or _binary(node) is None:
        return None
    x32, mean = node.args[:2]
    if _kind(mean) != "mean" or not _is_mean_of_last_dim(mean, ndim) or mean.args[0] is not x32:
        return None
    return x32, mean


def _match_layer(mul, factor, base, eps, ndim) -> _Normalized | None:
    centred, centred_base = _centred(factor, ndim), _centred(base, ndim)
    if (
        centred is None
        or centred_base is None
        or centred[0] is not centred_base[0]
        or centred[1] is not centred_base[1]
    ):
        return None
    source = _float32_source(centred[0])
    if source is None:
        return None
    return _Normalized(mul, source, centred[0], eps, centred=True)


# Export's checks of a value's dtype and device: not uses of the value for matching.
_METADATA_CHECKS = (_aten._assert_tensor_metadata.default,)


def _users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target not in _METADATA_CHECKS]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _weight_of(node, shape) -> fx.Node | None:
    """node as a weight: a 1-D tensor of the rows' length."""
    value = _tensor(node)
    return node if value is not None and tuple(value.shape) == tuple(shape[-1:]) else None


@dataclass
class _Replacement:
    """What a matched pattern becomes: the node whose value the norm's output replaces, and the call."""

    replaced: fx.Node
    centred: bool
    input: fx.Node
    weight: fx.Node | None
    eps: float | fx.Node | None
    weight_offset: float = 0.0
    round_normalized: bool = False
    form: str = ""


def _kernel_takes(param_dtype: torch.dtype, input_dtype: torch.dtype) -> bool:
    """The parameter dtypes the kernels take: the input's, or float32 beside half or bfloat16 input."""
    return param_dtype == input_dtype or (input_dtype in _REDUCED and param_dtype == torch.float32)


def _kernel_weight_dtype(dtype: torch.dtype, input_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype in which the kernels take a weight of `dtype`: its own, or float32 (an exact conversion) where they
    do not take it as it is; None where neither."""
    if _kernel_takes(dtype, input_dtype):
        return dtype
    if dtype in _REDUCED and input_dtype in (torch.float32, *_REDUCED):
        return torch.float32
    return None


def _consumer(node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(last, user): node's only user past conversions to node's own dtype, and the node that user reads."""
    user = _only_user(node)
    while user is not None and _is_conversion(user) and _tensor(user).dtype == _tensor(node).dtype:
        node, user = user, _only_user(user)
    return node, user


def _decomposed(normalized: _Normalized) -> _Replacement:
    """The form's rounding after the normalized value: what the module swap does for it (torch_ln.integrations)."""
    node, source = normalized.node, normalized.source
    dtype, shape = _tensor(source).dtype, _tensor(source).shape
    plain = _Replacement(node, normalized.centred, normalized.x32, None, normalized.eps, form="normalized")
    last, user = _consumer(node)
    if user is None:
        return plain
    # Llama / T5: weight * normed.to(dtype) with the weight in that dtype.
    if _is_conversion(user) and _tensor(user).dtype == dtype and not normalized.centred:
        rounded, product = _consumer(user)
        if _kind(product) == "mul" and _binary(product) is not None:
            weight = _weight_of(_other(product, rounded), shape)
            if weight is not None and _tensor(weight).dtype == dtype and _tensor(product).dtype == dtype:
                return _Replacement(product, False, source, weight, normalized.eps, round_normalized=True, form="llama")
        return _Replacement(user, False, source, None, normalized.eps, form="normalized, rounded")
    # normed * w32 or normed * (1 + w32), rounded once to the input's dtype (Gemma, Cohere, torch's arithmetic).
    if _kind(user) == "mul" and _binary(user) is not None:
        factor = _other(user, last)
        offset, weight = 0.0, factor
        if _kind(factor) == "add" and _binary(factor) is not None:
            one = [a for a in factor.args[:2] if isinstance(a, (int, float)) and not isinstance(a, bool)]
            if len(one) == 1 and one[0] == 1:
                offset, weight = 1.0, _other(factor, one[0])
        weight = _float32_source(weight) if isinstance(weight, fx.Node) else None
        weight = _weight_of(weight, shape) if weight is not None else None
        if weight is None or _tensor(user).dtype != torch.float32:
            return plain
        _, rounded = _consumer(user)
        if dtype == torch.float32:
            replaced = user
        elif _is_conversion(rounded) and _tensor(rounded).dtype == dtype:
            replaced = rounded
        else:
            return plain
        form = "gemma" if offset else "float32 product"
        return _Replacement(replaced, normalized.centred, source, weight, normalized.eps, offset, form=form)
    return plain


def _functional(node: fx.Node, kind: str) -> _Replacement | None:
    """F.layer_norm(x, shape, weight, bias, eps) / F.rms_norm(x, shape, weight, eps) over the last dimension with
    dtypes the kernels take (no bias: LayerNorm's bias is added below, in the same rounding)."""
    x, shape = node.args[0], _arg(node, 1, "normalized_shape")
    value = _tensor(x)
    if value is None or value.dtype not in _KERNEL_DTYPES or not isinstance(shape, (list, tuple)):
        return None
    return _Replacement(node, kind == "layer_norm", x, _arg(node, 2, "weight"), None, form=kind)


def _call_norm(graph: fx.Graph, r: _Replacement, bias=None, shape=None, eps=None) -> fx.Node | None:
    """Inserts torch_ln's forward for r before r.replaced and returns its output y, or None where the dtypes are
    not the kernels'."""
    input_dtype = _tensor(r.input).dtype
    if input_dtype not in _KERNEL_DTYPES:
        return None
    weight = r.weight
    weight_dtype = None if weight is None else _kernel_weight_dtype(_tensor(weight).dtype, input_dtype)
    if weight is not None and weight_dtype is None:
        return None
    if bias is not None and not _kernel_takes(_tensor(bias).dtype, input_dtype):
        return None
    if bias is not None and weight is not None and _tensor(bias).dtype != weight_dtype:
        return None
    shape = list(shape) if shape is not None else [_tensor(r.input).shape[-1]]
    eps = r.eps if eps is None else eps
    with graph.inserting_before(r.replaced):
        if weight is not None and weight_dtype != _tensor(weight).dtype:
            weight = graph.call_method("float", (weight,))
        if r.centred:
            call = graph.call_function(_ln.layer_norm_fwd.default, (r.input, shape, weight, bias, eps, r.weight_offset))
        else:
            rounding = (r.weight_offset, r.round_normalized)
            call = graph.call_function(_ln.rms_norm_fwd.default, (r.input, shape, weight, eps, *rounding))
        return graph.call_function(operator.getitem, (call, 0))


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, exclude: Iterable[str]) -> None:
        self.gm, self.graph = gm, gm.graph
        self.enabled = set(PATTERNS) - set(exclude)
        self.counts: collections.Counter[str] = collections.Counter()

    def run(self) -> collections.Counter[str]:
        for node in list(self.graph.nodes):
            if node.graph is not self.graph:  # erased by an earlier rewrite
                continue
            kind = _kind(node)
            if kind in ("layer_norm", "rms_norm") and kind in self.enabled:
                self._functional(node, kind)
            elif kind == "native_layer_norm" and "layer_norm" in self.enabled:
                self._functional(node, "layer_norm", native=True)
            elif kind == "mul":
                normalized = _match_normalized(node)
                pattern = "decomposed_layer_norm" if normalized and normalized.centred else "decomposed_rms_norm"
                if normalized is not None and pattern in self.enabled:
                    self._decomposed(normalized, pattern)
        while self._drop_orphaned_checks():
            self.graph.eliminate_dead_code()
        self.graph.eliminate_dead_code()
        if "add_norm" in self.enabled:
            for node in list(self.graph.nodes):
                if node.op == "call_function" and node.target in _TORCH_LN_NORMS:
                    self._fuse_add(node)
            self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()
        return self.counts

    def _drop_orphaned_checks(self) -> bool:
        """Erases export's metadata checks of values that nothing else uses any more (the rewritten patterns' steps),
        which would keep those steps alive; whether it erased any."""
        orphaned = [
            node
            for node in self.graph.nodes
            if node.target in _METADATA_CHECKS and not _users(node.args[0]) and len(node.args[0].users) == 1
        ]
        for node in orphaned:
            self.graph.erase_node(node)
        return bool(orphaned)

    def _replace(self, olds: list[fx.Node], new: fx.Node, label: str) -> None:
        """Makes the uses of each of `olds` (one pattern's outputs) uses of `new`."""
        _set_values(new)
        for old in olds:
            old.replace_all_uses_with(new)
        self.counts[label] += 1

    def _functional(self, node: fx.Node, kind: str, native: bool = False) -> None:
        """F.layer_norm / F.rms_norm; `native`: aten.native_layer_norm, whose statistics (in torch's dtypes, which
        may not be torch_ln's) must be unused."""
        r = _functional(node, kind)
        if r is None:
            return
        if native and any(user.target is not operator.getitem or user.args[1] != 0 for user in node.users):
            return
        shape = _arg(node, 1, "normalized_shape")
        if kind == "layer_norm":
            bias, eps = _arg(node, 3, "bias"), _arg(node, 4, "eps", 1e-5)
        else:
            bias, eps = None, _arg(node, 3, "eps")
        if not (eps is None and kind == "rms_norm") and not _is_scalar(eps):
            return
        y = _call_norm(self.graph, r, bias, shape, float(eps) if isinstance(eps, (int, float)) else eps)
        if y is None:
            return
        self._replace(list(node.users) if native else [node], y, kind)

    def _decomposed(self, normalized: _Normalized, pattern: str) -> None:
        r = _decomposed(normalized)
        if _tensor(r.replaced).dtype != _tensor(r.input).dtype:  # the kernels' output has their input's dtype
            return
        y = _call_norm(self.graph, r)
        if y is not None:
            self._replace([r.replaced], y, f"{pattern} ({r.form})")

    def _fuse_add(self, norm: fx.Node) -> None:
        """norm(a + b) -> add_*_norm(a, b): its residual_out replaces the sum's other uses."""
        total = norm.args[0]
        if _kind(total) != "add" or _binary(total) is None or norm.kwargs:
            return
        if any(user.target is not operator.getitem for user in norm.users):
            return
        operands = _fused_operands(total, norm)
        if operands is None:
            return
        x, residual, rounded_y = operands
        others = [u for u in total.users if u is not norm]
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        anchor = max(norm.all_input_nodes, key=position.__getitem__)  # the sum, or a parameter defined after it
        if others and position[anchor] > min(position[u] for u in others):
            return  # a parameter defined after the sum's first other use: leave it
        layer = norm.target == _ln.layer_norm_fwd.default
        rest = list(norm.args[1:]) + [None] * (6 - len(norm.args))  # the schema's trailing defaults
        # A float32 stream: residual_dtype, and no rounding to the input's dtype (a no-op on the float32 norm).
        stream = torch.float32 if rounded_y is not None else None
        if layer:
            shape, weight, bias, eps, offset = rest[0], rest[1], rest[2], rest[3], rest[4] or 0.0
            args = (x, residual, shape, weight, bias, eps, stream, offset)
            target, index = _ln.add_layer_norm_fwd.default, {0: 0, 1: 2, 2: 3}
        else:
            shape, weight, eps, offset = rest[0], rest[1], rest[2], rest[3] or 0.0
            args = (x, residual, shape, weight, eps, stream, offset, bool(rest[4]) and stream is None)
            target, index = _ln.add_rms_norm_fwd.default, {0: 0, 1: 2}
        with self.graph.inserting_after(anchor):
            fused = self.graph.call_function(target, args)
        with self.graph.inserting_after(fused):
            residual_out = self.graph.call_function(operator.getitem, (fused, 1))
        _set_values(residual_out)
        for user in list(norm.users):  # (y, statistics) -> (y, residual_out, statistics)
            user.args = (fused, index[user.args[1]])
            _set_values(user)
            if rounded_y is not None and user.args[1] == 0:  # y comes in the activations' dtype already
                rounded_y.replace_all_uses_with(user)
        for user in others:
            user.replace_input_with(total, residual_out)
        self.counts[f"add_norm ({'add_layer_norm' if layer else 'add_rms_norm'})"] += 1


def _fused_operands(total: fx.Node, norm: fx.Node) -> tuple | None:
    """(x, residual, rounded_y) for fusing norm(total = a + b): the operands in the fused op's order, and the node
    that rounds the norm's float32 output to x's dtype where the sum is a float32 residual stream beside half or
    bfloat16 activations (the fused op writes y in x's dtype: one rounding where the graph had two, float32 then
    x's dtype); None where the add is not the fused op's (broadcasting, other dtypes)."""
    a, b = total.args[:2]
    values = [_tensor(t) for t in (a, b, total)]
    if any(v is None for v in values) or any(v.shape != values[2].shape for v in values[:2]):
        return None
    dtypes = (values[0].dtype, values[1].dtype)
    if dtypes[0] == dtypes[1] == values[2].dtype:
        return a, b, None
    if values[2].dtype != torch.float32 or set(dtypes) not in (
        {torch.bfloat16, torch.float32},
        {torch.float16, torch.float32},
    ):
        return None
    x, residual = (a, b) if dtypes[0] != torch.float32 else (b, a)
    ys = [user for user in norm.users if user.args[1] == 0]
    conversions = [c for y in ys for c in y.users]
    if len(ys) != 1 or len(conversions) != 1 or not _is_conversion(conversions[0]):
        return None
    return (x, residual, conversions[0]) if _tensor(conversions[0]).dtype == _tensor(x).dtype else None


def _set_values(node: fx.Node) -> None:
    """Records the node's example value (the fake kernels' shapes and dtypes), as Dynamo does for its own nodes,
    for the passes that read them."""
    for arg in node.all_input_nodes:  # nodes this pass added before it
        if _value(arg) is None:
            _set_values(arg)
    args = fx.node.map_arg((node.args, node.kwargs), _value)
    # The mode of the graph's own values: the tracing context's may be another (Dynamo gives the backend its own).
    values: list = []
    fx.node.map_aggregate(args, lambda v: values.append(v) if isinstance(v, FakeTensor) else None)
    if not values:
        return
    fake_mode = values[0].fake_mode
    target = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
    with fake_mode:
        value = target(*args[0], **args[1])
    node.meta["example_value"] = node.meta["val"] = value


def _check_patterns(exclude: Iterable[str]) -> None:
    unknown = set(exclude) - set(PATTERNS)
    if unknown:
        raise ValueError(
            f"torch_ln.compile: expected exclude to name patterns of {PATTERNS}, but got {sorted(unknown)}"
        )


def rewrite(gm: fx.GraphModule, *, exclude: Iterable[str] = (), verbose: bool = False) -> dict[str, int]:
    """Rewrites ``gm`` in place (see the module's docstring) and returns the count of each rewrite. ``exclude``
    names patterns of :data:`PATTERNS` to leave alone; the counts are logged to the ``torch_ln`` logger (INFO) and
    printed with ``verbose=True``."""
    _check_patterns(exclude)
    counts = dict(_Rewriter(gm, exclude).run())
    message = "torch_ln.compile: rewrote " + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "nothing")
    logger.info(message)
    if verbose:
        print(message)
    return counts


def backend(inner: str | Callable = "inductor", *, exclude: Iterable[str] = (), verbose: bool = False) -> Callable:
    """A torch.compile backend: :func:`rewrite`, then ``inner`` (a backend name or callable; default Inductor).

    torch.compile(model, backend=torch_ln.compile.backend())
    torch.compile(model, backend=torch_ln.compile.backend(exclude=["add_norm"], verbose=True))
    """
    exclude = tuple(exclude)
    _check_patterns(exclude)
    compile_inner = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

    def torch_ln_backend(gm: fx.GraphModule, example_inputs):
        rewrite(gm, exclude=exclude, verbose=verbose)
        return compile_inner(gm, example_inputs)

    return torch_ln_backend
