"""memory_efficient=True (issue 39 item 2): autograd saves the norm's output y instead of its input, and the backward
recovers xhat from y as y / (weight + weight_offset), for RMSNorm and LayerNorm without bias.

Accuracy, by the project's rule (tests/norm_cases.py: error against float64 at most 2x torch's, plus the floor),
measured on the CPU kernels with the parameters make_params draws (weight 1 + 0.5 N(0, 1)), as
max(ours / (2 x torch's + floor)) over the cases below: RMSNorm <= 0.33 and LayerNorm without bias <= 0.2, in every
dtype. y / w keeps y's relative rounding error (half an ulp of the input dtype), the size of the rounding of dx and
dweight that torch's own backward has: the bound holds whatever the weights.

With a bias, xhat = (y - bias) / w cancels where |bias| >> |xhat * w|: with bias N(0, 1) the weight gradients were
5x (float32), 41x (bfloat16) and 76x (float16) further from float64 than torch's; float64 passed with those weights
but not with N(0, 1) ones (2 rows, where torch's error was 0). No dtype keeps the rule for every weight, so the rule
is not loosened: a norm with a bias is refused with a clear error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from norm_cases import LAYER_NORM, NORMS, assert_accuracy, assert_close_to_torch, make_params, run

import torch_ln


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _memory_efficient(norm):
    """The norm's adapter with memory_efficient=True."""
    if norm is LAYER_NORM:
        ours = lambda x, shape, w=None, b=None, eps=1e-5: torch_ln.layer_norm(
            x, shape, w, b, eps, memory_efficient=True
        )
    else:
        ours = lambda x, shape, w=None, b=None, eps=None: torch_ln.rms_norm(x, shape, w, eps, memory_efficient=True)
    return dataclasses.replace(norm, ours=ours)


# (input dtype, parameter dtype): every dtype, and half/bfloat16 input with float32 parameters.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
]


def _check(norm, base, weight, bias, grad_out, dtype):
    """memory_efficient's y and gradients: by the accuracy rule against torch's (float64 reference), and by the
    tolerance table against torch_ln's backward from x. (The table against torch itself would judge torch: its
    CPU bfloat16 dweight is off by 9 of 84.6 in one column of the (2049, 256) case, ours by 0.38.)"""
    shape = base.shape[-1:]
    ours = run(_memory_efficient(norm).ours, base, weight, bias, grad_out, shape, norm.default_eps)
    from_x = run(norm.ours, base, weight, bias, grad_out, shape, norm.default_eps)
    theirs = run(norm.torch, base, weight, bias, grad_out, shape, norm.default_eps)
    ref64 = run(norm.reference, base, weight, bias, grad_out, shape, norm.default_eps, dtype=torch.float64)
    assert ours.keys() == theirs.keys() == from_x.keys()
    rows = base.numel() // base.shape[-1]
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.isfinite(ours[name]).all(), name
        assert_close_to_torch(name, ours[name], from_x[name], dtype, rows)
        assert_accuracy(name, ours[name], theirs[name], ref64[name], dtype, rows)


@pytest.mark.parametrize("dtype,param_dtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (1, 64),  # M = 1
        (64, 1024),
        (2049, 256),  # many rows: the weight gradient sums 2049 recovered xhat
        (7, 4099),  # prime D: the CPU kernels' scalar tails (lanes past the row divide by 1, not 0)
    ],
    ids=str,
)
@pytest.mark.parametrize("has_weight", [True, False])
@pytest.mark.parametrize("norm", NORMS)
def test_accuracy_rule(norm, has_weight, shape, dtype, param_dtype):
    """Gradients within the accuracy rule in every dtype: RMSNorm, and LayerNorm without a bias."""
    weight, _ = make_params(norm, shape[-1:], has_weight, False, param_dtype, "cpu")
    _check(norm, torch.randn(shape).to(dtype), weight, None, torch.randn(shape).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_layer_norm_with_bias_refused(dtype):
    """The cancellation the module docstring measures: refused, at the forward (functional and module) and by the
    backward operator, with the reason."""
    x = torch.randn(4, 32, dtype=dtype)
    weight, bias = torch.ones(32, dtype=dtype), torch.zeros(32, dtype=dtype)
    match = "memory_efficient=True needs a norm without bias, but got a bias"
    with pytest.raises(ValueError, match=match):
        torch_ln.layer_norm(x, (32,), weight, bias, memory_efficient=True)
    with pytest.raises(ValueError, match=match):
        torch_ln.LayerNorm(32, memory_efficient=True).to(dtype)(x)
    y, mean, rstd = torch.ops.torch_ln.layer_norm_fwd(x, [32], weight, bias, 1e-5)
    with pytest.raises(ValueError, match=match):
        torch.ops.torch_ln.layer_norm_bwd(y, y, [32], mean, rstd, weight, bias, [True] * 3, from_output=True)


@pytest.mark.parametrize("norm", NORMS)
def test_forward_unchanged(norm):
    x = torch.randn(8, 96, dtype=torch.bfloat16)
    weight, _ = make_params(norm, (96,), True, False, torch.bfloat16, "cpu")
    assert torch.equal(_memory_efficient(norm).ours(x, (96,), weight), norm.ours(x, (96,), weight))


def _saved_storages(fn) -> list[int]:
    """data_ptrs of the storages autograd saves while fn() runs its forward."""
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("memory_efficient", [True, False])
@pytest.mark.parametrize("norm", NORMS)
def test_saves_the_output_not_the_input(norm, memory_efficient):
    """What autograd keeps for the backward: y's storage (which the next layer holds anyway) and not x's, or the
    other way round without the option."""
    x = torch.randn(8, 64, requires_grad=True)
    weight, _ = make_params(norm, (64,), True, False, torch.float32, "cpu")
    weight.requires_grad_()
    out = {}

    def forward():
        if norm is LAYER_NORM:
            out["y"] = torch_ln.layer_norm(x, (64,), weight, memory_efficient=memory_efficient)
        else:
            out["y"] = torch_ln.rms_norm(x, (64,), weight, memory_efficient=memory_efficient)

    saved = _saved_storages(forward)
    y_storage, x_storage = out["y"].untyped_storage().data_ptr(), x.untyped_storage().data_ptr()
    assert (y_storage in saved) == memory_efficient
    assert (x_storage in saved) == (not memory_efficient)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("norm", NORMS)
def test_zero_weight_refused_at_the_backward(norm, offset):
    """Where weight + weight_offset is 0 the output holds nothing of xhat: the backward says so, naming the count."""
    x = torch.randn(4, 16, requires_grad=True)
    weight = torch.full((16,), 1.0 - offset)
    weight[3] = weight[9] = -offset
    kwargs = {"weight_offset": offset, "memory_efficient": True}
    y = (
        torch_ln.layer_norm(x, (16,), weight, **kwargs)
        if norm is LAYER_NORM
        else torch_ln.rms_norm(x, (16,), weight, **kwargs)
    )
    with pytest.raises(ValueError, match=r"needs every weight \+ weight_offset nonzero, but 2 of 16 are 0"):
        y.sum().backward()


@pytest.mark.parametrize("norm", NORMS)
def test_no_double_backward(norm):
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = _memory_efficient(norm).ours(x, (16,), torch.ones(16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="memory_efficient=True has no double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("norm", NORMS)
def test_module_option_and_state_dict(norm):
    """The modules take the keyword (a plain attribute after), keep torch's state_dict, and train as the functional
    form does."""
    kwargs = {"bias": False} if norm is LAYER_NORM else {}
    plain, lean = norm.module(48, **kwargs), norm.module(48, memory_efficient=True, **kwargs)
    assert lean.memory_efficient and "memory_efficient=True" in repr(lean)
    lean.load_state_dict(norm.torch_module(48, **kwargs).state_dict())
    assert lean.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(lean.state_dict())
    x = torch.randn(6, 48)
    grads = []
    for module in (plain, lean):
        module.zero_grad()
        module(x).pow(2).sum().backward()
        grads.append(module.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)  # float32's tolerance table


@pytest.mark.parametrize("norm", NORMS)
def test_opcheck_compile_export(norm):
    x = torch.randn(6, 32)
    weight = torch.rand(32) + 0.5
    has_bias = norm is LAYER_NORM
    eps = 1e-5
    fwd_args = (x, [32], weight, None, eps, 0.0, True) if has_bias else (x, [32], weight, eps, 0.0, False, True)
    torch.library.opcheck(norm.fwd_op, fwd_args)
    y, *stats = norm.fwd_op(*fwd_args)
    params = (weight, None) if has_bias else (weight,)
    mask = [True] * (1 + len(params))
    extra = (0.0, True) if has_bias else (0.0, False, True)
    torch.library.opcheck(norm.bwd_op, (torch.randn(6, 32), y, [32], *stats, *params, mask, *extra))

    module = norm.module(32, memory_efficient=True, **({"bias": False} if has_bias else {}))
    leaf = x.clone().requires_grad_()
    module(leaf).sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    compiled_leaf = x.clone().requires_grad_()
    compiled(compiled_leaf).sum().backward()
    assert torch.equal(compiled_leaf.grad, leaf.grad)
    program = torch.export.export(module, (x,))
    assert torch.equal(program.module()(x), module(x))
