"""The eager operators (torch_ln::layer_norm, rms_norm, add_layer_norm, add_rms_norm: autograd in C++,
csrc/autograd.cpp) against the *_fwd operators with their autograd registered in Python (torch_ln/ops.py).

Both run the same kernels, so every output and every gradient must be bitwise equal. Which one a call of the
public functions takes is tested here too: plain tensors in eager mode take the C++ node; autocast and forward-mode
AD need the registered operators (torch.func and torch.compile are covered by their own test files).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import torch_ln

ops = torch.ops.torch_ln


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Each: (has bias, eager call, the registered operator's call); both return the public function's outputs. The
# residual stream has the residual's dtype.
CALLS = {
    "layer_norm": (
        True,
        lambda x, r, shape, w, b: (ops.layer_norm(x, shape, w, b, 1e-5),),
        lambda x, r, shape, w, b: ops.layer_norm_fwd(x, shape, w, b, 1e-5)[:1],
    ),
    "rms_norm": (
        False,
        lambda x, r, shape, w, b: (ops.rms_norm(x, shape, w, None, 0.5, True),),
        lambda x, r, shape, w, b: ops.rms_norm_fwd(x, shape, w, None, 0.5, True)[:1],
    ),
    "add_layer_norm": (
        True,
        lambda x, r, shape, w, b: ops.add_layer_norm(x, r, shape, w, b, 1e-5, r.dtype),
        lambda x, r, shape, w, b: ops.add_layer_norm_fwd(x, r, shape, w, b, 1e-5, r.dtype)[:2],
    ),
    "add_rms_norm": (
        False,
        lambda x, r, shape, w, b: ops.add_rms_norm(x, r, shape, w, None, r.dtype),
        lambda x, r, shape, w, b: ops.add_rms_norm_fwd(x, r, shape, w, None, r.dtype)[:2],
    ),
}

SHAPES = [
    pytest.param((4, 33), 1, id="4x33"),  # odd D: the vector tails
    pytest.param((1, 7), 1, id="M1"),  # a single row
    pytest.param((7,), 1, id="1d"),  # no batch dimension: the bias gradient sums over nothing
    pytest.param((2, 3, 4, 5), 2, id="norm2"),  # two normalized dimensions
]

# (input dtype, parameter dtype): plain, mixed precision, float64.
DTYPES = [
    pytest.param(torch.float32, torch.float32, id="float32"),
    pytest.param(torch.bfloat16, torch.float32, id="bfloat16-float32params"),
    pytest.param(torch.float64, torch.float64, id="float64"),
]


def _needs(name: str) -> list[str]:
    """Which of (x, residual, weight, bias) require grad: each combination the backward distinguishes that the op
    has (the plain norms have no residual, RMSNorm no bias)."""
    combinations = ["xrwb", "x", "r", "w", "b", "wb"]
    absent = ("" if name.startswith("add_") else "r") + ("" if CALLS[name][0] else "b")
    return [n for n in combinations if set(n) - set(absent)]


NAME_NEEDS = [pytest.param(name, needs, id=f"{name}-{needs}") for name in CALLS for needs in _needs(name)]


def _inputs(name, shape, normalized_ndim, dtype, param_dtype, needs):
    has_bias = CALLS[name][0]
    nshape = list(shape[len(shape) - normalized_ndim :])
    x = torch.randn(shape).to(dtype).requires_grad_("x" in needs)
    # The residual's dtype is the stream's (residual_dtype in CALLS): float32 under bfloat16, a float32 stream.
    r = torch.randn(shape, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    r.requires_grad_("r" in needs and name.startswith("add_"))
    w = torch.randn(nshape).to(param_dtype).requires_grad_("w" in needs)
    b = torch.randn(nshape).to(param_dtype).requires_grad_("b" in needs) if has_bias else None
    return x, r, nshape, w, b


def _outputs_and_grads(call, x, r, nshape, w, b, grads):
    outputs = call(x, r, nshape, w, b)
    leaves = [t for t in (x, r, w, b) if t is not None and t.requires_grad]
    used = [(o, g) for o, g in zip(outputs, grads) if g is not None]
    if not leaves:
        return outputs, ()
    return outputs, torch.autograd.grad([o for o, _ in used], leaves, [g for _, g in used])


@pytest.mark.parametrize("dtype, param_dtype", DTYPES)
@pytest.mark.parametrize("shape, normalized_ndim", SHAPES)
@pytest.mark.parametrize("name, needs", NAME_NEEDS)
def test_eager_matches_registered_bitwise(name, needs, shape, normalized_ndim, dtype, param_dtype):
    _, eager, registered = CALLS[name]
    x, r, nshape, w, b = _inputs(name, shape, normalized_ndim, dtype, param_dtype, needs)
    grads = [torch.randn(shape).to(dtype), torch.randn(shape) if name.startswith("add_") else None]
    ours, our_grads = _outputs_and_grads(eager, x, r, nshape, w, b, grads)
    theirs, their_grads = _outputs_and_grads(registered, x, r, nshape, w, b, grads)
    for a, e in zip((*ours, *our_grads), (*theirs, *their_grads)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_fused_with_only_residual_out_used(name):
    """residual_out alone carries a gradient: y's is absent (the node does not materialize zeros for it)."""
    _, eager, registered = CALLS[name]
    x, r, nshape, w, b = _inputs(name, (3, 9), 1, torch.float32, torch.float32, "xrwb")
    grads = [None, torch.randn(3, 9)]
    _, ours = _outputs_and_grads(eager, x, r, nshape, w, b, grads)
    _, theirs = _outputs_and_grads(registered, x, r, nshape, w, b, grads)
    torch.testing.assert_close(ours[:2], theirs[:2], rtol=0, atol=0)
    # x and residual get residual_out's gradient; the parameters get none (zeros from the registered path).
    torch.testing.assert_close(ours[0], grads[1], rtol=0, atol=0)
    for ours_param, theirs_param in zip(ours[2:], theirs[2:]):
        assert ours_param is None or torch.equal(ours_param, theirs_param)


@pytest.mark.parametrize("name", CALLS)
def test_gradcheck_both_paths(name):
    """First and second order, float64, for the C++ node and the Python-registered operator alike."""
    x, r, nshape, w, b = _inputs(name, (3, 5), 1, torch.float64, torch.float64, "xrwb")
    leaves = [t for t in (x, r, w, b) if t is not None and t.requires_grad]
    for path in CALLS[name][1:]:

        def fn(*args, path=path):
            it = iter(args)
            xs, rs = next(it), next(it) if r.requires_grad else r
            ws = next(it)
            return path(xs, rs, nshape, ws, next(it) if b is not None else None)

        assert torch.autograd.gradcheck(fn, leaves)
        assert torch.autograd.gradgradcheck(fn, leaves)


PUBLIC = {
    "layer_norm": lambda x, w, b: torch_ln.layer_norm(x, x.shape[-1:], w, b),
    "rms_norm": lambda x, w, b: torch_ln.rms_norm(x, x.shape[-1:], w),
    "add_layer_norm": lambda x, w, b: torch_ln.add_layer_norm(x, x, x.shape[-1:], w, b)[0],
    "add_rms_norm": lambda x, w, b: torch_ln.add_rms_norm(x, x, x.shape[-1:], w)[0],
}


def _node_name(name: str, eager: bool) -> str:
    camel = "".join(part.title() for part in name.split("_"))
    return f"torch_ln::{camel}Backward" if eager else f"{camel}FwdBackward"


@pytest.mark.parametrize("name", PUBLIC)
def test_plain_call_records_the_cpp_node(name):
    x, w, b = (torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True), torch.randn(8))
    assert _node_name(name, eager=True) in PUBLIC[name](x, w, b).grad_fn.name()


MODULES = {
    "layer_norm": lambda x: torch_ln.LayerNorm(8)(x),
    "rms_norm": lambda x: torch_ln.RMSNorm(8)(x),
    "add_layer_norm": lambda x: torch_ln.AddLayerNorm(8)(x, x)[0],
    "add_rms_norm": lambda x: torch_ln.AddRMSNorm(8)(x, x)[0],
}


@pytest.mark.parametrize("name", MODULES)
def test_module_parameters_take_the_cpp_node(name):
    # Regression: nn.Parameter is a Tensor subclass, and the plain-tensor check sent every module call (its weight
    # and bias are Parameters) to the Python autograd.Function, about 6x the CPU time of a small call.
    x = torch.randn(4, 8, requires_grad=True)
    assert _node_name(name, eager=True) in MODULES[name](x).grad_fn.name()


def test_eager_calls_take_the_typed_bindings(monkeypatch):
    """Eager calls reach the operators through torch_ln._C (csrc/python: ~3 us a call less than torch.ops)."""
    called = []

    class Recording:
        def __getattr__(self, name):
            called.append(name)
            return getattr(torch_ln._C, name)

    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    with monkeypatch.context() as patch:
        patch.setattr(torch_ln.ops, "_eager", lambda *args: False)  # the registered operators, for comparison
        registered = {name: call(x, w, b) for name, call in PUBLIC.items()}
    monkeypatch.setattr(torch_ln.ops, "_C", Recording())
    for name, call in PUBLIC.items():
        assert torch.equal(call(x, w, b), registered[name])
        assert called[-1:] == [name]


# normalized_shape in every form the public functions take (the bindings convert it themselves).
@pytest.mark.parametrize("shape", [8, (8,), [8], torch.Size([8]), [np.int64(8)]], ids=repr)
def test_binding_takes_every_normalized_shape_form(shape):
    x, w = torch.randn(4, 8), torch.randn(8)
    assert torch.equal(torch_ln.layer_norm(x, shape, w), ops.layer_norm_fwd(x, [8], w, None, 1e-5)[0])
    assert torch.equal(torch_ln.add_rms_norm(x, x, shape, w)[0], ops.add_rms_norm_fwd(x, x, [8], w, None, None)[0])


_X = torch.randn(4, 8)
# Each: the call, then the parts its TypeError must name (the function, the argument, what came).
BAD_ARGUMENTS = {
    "float-in-shape": (lambda: torch_ln.layer_norm(_X, (8.0,)), ("torch_ln.layer_norm", "normalized_shape", "float")),
    "shape-none": (lambda: torch_ln.rms_norm(_X, None), ("torch_ln.rms_norm", "normalized_shape", "NoneType")),
    "eps-str": (lambda: torch_ln.add_rms_norm(_X, _X, 8, eps="1e-5"), ("add_rms_norm", "eps", "float or None", "str")),
    "eps-none": (
        lambda: torch_ln.add_layer_norm(_X, _X, 8, eps=None),
        ("add_layer_norm", "eps", "a float", "NoneType"),
    ),
    "weight_offset-str": (lambda: torch_ln.rms_norm(_X, 8, weight_offset="1"), ("rms_norm", "weight_offset", "str")),
    "round_normalized-int": (lambda: torch_ln.rms_norm(_X, 8, round_normalized=1), ("round_normalized", "bool", "int")),
    "residual_dtype-str": (
        lambda: torch_ln.add_layer_norm(_X, _X, 8, residual_dtype="float32"),
        ("add_layer_norm", "residual_dtype", "torch.dtype", "str"),
    ),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_binding_rejects_a_wrong_argument_by_name(case):
    call, parts = BAD_ARGUMENTS[case]
    with pytest.raises(TypeError) as error:
        call()
    for part in parts:
        assert part in str(error.value)


@pytest.mark.parametrize("name", PUBLIC)
def test_autocast_takes_the_registered_operator(name):
    x, w, b = (torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True), torch.randn(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _node_name(name, eager=False) in PUBLIC[name](x, w, b).grad_fn.name()


@pytest.mark.parametrize("name", PUBLIC)
def test_forward_ad_takes_the_registered_operator(name):
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    tangent = torch.randn(4, 8)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, tangent)
        y = PUBLIC[name](dual, w, b)
        jvp = torch.autograd.forward_ad.unpack_dual(y).tangent
    _, expected = torch.func.jvp(lambda t: PUBLIC[name](t, w, b), (x,), (tangent,))
    torch.testing.assert_close(jvp, expected)


@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm"])
def test_bias_gradient_alone_saves_nothing(name):
    """Only the bias requires grad: the node keeps no tensor alive (not the input, residual_out, statistics, weight
    or bias: the bias gradient is grad_out summed over the rows)."""
    x, r, nshape, w, b = _inputs(name, (64, 16), 1, torch.float32, torch.float32, "b")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        outputs = CALLS[name][1](x, r, nshape, w, b)
    assert saved == []
    outputs[0].backward(torch.ones(64, 16))
    torch.testing.assert_close(b.grad, torch.full((16,), 64.0), rtol=0, atol=0)


# The C++ node's guarantees, as torch's own nodes give them.


def _eager_output_and_leaves(name, needs="xrwb"):
    x, r, nshape, w, b = _inputs(name, (4, 9), 1, torch.float32, torch.float32, needs)
    return CALLS[name][1](x, r, nshape, w, b)[0], [t for t in (x, r, w, b) if t is not None and t.requires_grad]


@pytest.mark.parametrize("name", CALLS)
def test_node_name(name):
    y, _ = _eager_output_and_leaves(name)
    assert y.grad_fn.name() == _node_name(name, eager=True)


@pytest.mark.parametrize("name", CALLS)
def test_saved_weight_modified_in_place_raises(name):
    y, leaves = _eager_output_and_leaves(name)
    weight = leaves[-2] if CALLS[name][0] else leaves[-1]
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("name", CALLS)
def test_saved_norm_input_modified_in_place_raises(name):
    """The input (the plain norms) or residual_out (the fused ones, an output of the node) is saved."""
    x, r, nshape, w, b = _inputs(name, (4, 9), 1, torch.float32, torch.float32, "xw")
    x = x.clone()  # not a leaf: it may be modified in place
    outputs = CALLS[name][1](x, r, nshape, w, b)
    (outputs[1] if name.startswith("add_") else x).add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        outputs[0].sum().backward()


@pytest.mark.parametrize("name", CALLS)
def test_retained_graph_gives_the_same_gradients_twice(name):
    y, leaves = _eager_output_and_leaves(name)
    grad = torch.randn_like(y)
    first = torch.autograd.grad(y, leaves, grad, retain_graph=True)
    second = torch.autograd.grad(y, leaves, grad)
    for a, e in zip(first, second):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    # Without retain_graph the node released its saved tensors.
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y, leaves, grad)


@pytest.mark.parametrize("needs", ["", "w"])
@pytest.mark.parametrize("name", CALLS)
def test_dual_tensor_at_the_eager_operator_raises(name, needs):
    """The node has no forward-mode derivative: a tangent is refused, not dropped, whether or not it records."""
    x, r, nshape, w, b = _inputs(name, (4, 9), 1, torch.float32, torch.float32, needs)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.randn_like(x))
        with pytest.raises(RuntimeError, match=f"torch_ln::{name} has no forward-mode AD"):
            CALLS[name][1](dual, r, nshape, w, b)


@pytest.mark.parametrize("name", CALLS)
def test_compiled_autograd_matches_eager(name):
    """The node under compiled autograd (torch._dynamo.compiled_autograd): its backward as a function of the saved
    tensors, the same kernels, so bitwise the same gradients."""
    torch._dynamo.reset()
    y, leaves = _eager_output_and_leaves(name)
    grad = torch.randn_like(y)
    expected = torch.autograd.grad(y, leaves, grad, retain_graph=True)
    counters.clear()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        y.backward(grad)
    assert counters["compiled_autograd"]["captures"] == 1  # the backward ran as a compiled graph
    for leaf, e in zip(leaves, expected):
        torch.testing.assert_close(leaf.grad, e, rtol=0, atol=0)
    torch._dynamo.reset()
