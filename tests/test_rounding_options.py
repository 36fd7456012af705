"""The rounding options beyond rms_norm (csrc/norm.h RoundingOptions): LayerNorm's weight_offset (zero-centred
weights, y = xhat * (1 + w) + b: TransformerEngine's zero_centered_gamma, Megatron's apply_layernorm_1p), and the
fused add + norm with the plain norms' options (Gemma's 1 + w, Llama's rounding before the weight product).

Tolerances: the table and the accuracy rule of tests/norm_cases.py. The yardstick for a LayerNorm with an offset is
torch's F.layer_norm in the accumulation dtype with the offset weight formed there, rounded once to the input's
dtype: the arithmetic the options define. The fused ops are held to bit equality with the plain torch_ln norm of
x + residual, which tests/test_integrations.py and this file hold to torch.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from norm_cases import (
    LAYER_NORM,
    accumulation_dtype,
    assert_accuracy,
    assert_close_to_torch,
    check_against_torch_and_reference,
    make_params,
)
from torch import nn

import torch_ln
from torch_ln import reference

OFFSET = 1.0  # Gemma's and TransformerEngine's zero-centred weight: the norm multiplies by 1 + w


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _torch_offset_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm in the accumulation dtype with weight + OFFSET formed there, rounded once to x's dtype."""
    acc = accumulation_dtype(x.dtype)
    weight = weight.to(acc) + OFFSET if weight is not None else None
    bias = bias.to(acc) if bias is not None else None
    return F.layer_norm(x.to(acc), shape, weight, bias, eps).to(x.dtype)


OFFSET_LAYER_NORM = dataclasses.replace(
    LAYER_NORM,
    ours=partial(torch_ln.layer_norm, weight_offset=OFFSET),
    torch=_torch_offset_layer_norm,
    reference=partial(reference.layer_norm, weight_offset=OFFSET),
)


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize(
    "dtype, param_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # mixed precision: the offset added to a float32 weight
    ],
)
# M=1 and prime D (scalar tails); 37 rows: the CPU backward's row chunks (>= 32 rows); D=4099: whole steps and a
# scalar tail, 5 rows: the column split.
@pytest.mark.parametrize("shape", [(1, 1021), (37, 64), (5, 4099)], ids=str)
def test_layer_norm_weight_offset(shape, dtype, param_dtype, has_bias):
    weight, bias = make_params(LAYER_NORM, shape[-1:], True, has_bias, param_dtype, "cpu")
    weight = weight - OFFSET  # zero-centred: weight + OFFSET is around 1, as trained weights are
    x = torch.randn(shape).to(dtype)
    grad_out = torch.randn(shape).to(dtype)
    check_against_torch_and_reference(
        OFFSET_LAYER_NORM, x, weight, bias, grad_out, shape[-1:], 1e-5, dtype, rows=shape[0]
    )


def test_layer_norm_weight_offset_of_zero_is_the_plain_norm():
    x, weight, bias = torch.randn(6, 40), torch.randn(40), torch.randn(40)
    assert torch.equal(
        torch_ln.layer_norm(x, (40,), weight, bias, weight_offset=0.0), torch_ln.layer_norm(x, (40,), weight, bias)
    )


# (norm, options): LayerNorm takes the offset; RMSNorm the offset, Llama's rounding, and both.
FUSED_OPTIONS = [
    pytest.param("layer_norm", {"weight_offset": OFFSET}, id="layer-weight_offset"),
    pytest.param("rms_norm", {"weight_offset": OFFSET}, id="rms-weight_offset"),
    pytest.param("rms_norm", {"round_normalized": True}, id="rms-round_normalized"),
    pytest.param("rms_norm", {"weight_offset": OFFSET, "round_normalized": True}, id="rms-both"),
]


def _fused(name, x, residual, shape, weight, bias, eps, residual_dtype=None, **options):
    if name == "layer_norm":
        return torch_ln.add_layer_norm(x, residual, shape, weight, bias, eps, residual_dtype, **options)
    return torch_ln.add_rms_norm(x, residual, shape, weight, eps, residual_dtype, **options)


def _plain(name, h, shape, weight, bias, eps, **options):
    if name == "layer_norm":
        return torch_ln.layer_norm(h, shape, weight, bias, eps, **options)
    return torch_ln.rms_norm(h, shape, weight, eps, **options)


def _fused_and_plain_grads(name, options, x, residual, weight, bias, dy, dh_out):
    """Gradients of the fused op, and of the plain norm of h = x + residual (taken as a leaf)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, residual, weight, bias)]
    y, h = _fused(name, *leaves[:2], x.shape[-1:], *leaves[2:], 1e-5, **options)
    torch.autograd.backward((y, h), (dy, dh_out))
    hl = (x + residual).requires_grad_()
    params = [t.detach().clone().requires_grad_() if t is not None else None for t in (weight, bias)]
    _plain(name, hl, x.shape[-1:], *params, 1e-5, **options).backward(dy)
    fused = {"dx": leaves[0].grad, "dresidual": leaves[1].grad, "dweight": leaves[2].grad}
    plain = {"dx": hl.grad + dh_out, "dweight": params[0].grad}
    return fused, plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("d", [33, 4099])  # a short odd row; many whole steps and a scalar tail
@pytest.mark.parametrize("name, options", FUSED_OPTIONS)
def test_fused_add_is_the_plain_norm_with_the_same_options(name, options, d, dtype):
    """The fused forward with the options is bitwise the plain torch_ln norm of x + residual with them. Its backward:
    in float32/float64 bitwise the plain backward's dx plus d(residual_out), and the same dweight; in bfloat16 within
    the tolerance table of them (the fused op adds d(residual_out) before rounding dx once, the plain sum rounds
    twice)."""
    x, residual = torch.randn(9, d).to(dtype), torch.randn(9, d).to(dtype)
    weight, bias = make_params(LAYER_NORM, (d,), True, name == "layer_norm", dtype, "cpu")
    y, h = _fused(name, x, residual, (d,), weight, bias, 1e-5, **options)
    assert torch.equal(h, x + residual)
    assert torch.equal(y, _plain(name, x + residual, (d,), weight, bias, 1e-5, **options))
    dy, dh_out = torch.randn(9, d).to(dtype), torch.randn(9, d).to(dtype)
    fused, plain = _fused_and_plain_grads(name, options, x, residual, weight, bias, dy, dh_out)
    assert torch.equal(fused["dx"], fused["dresidual"])
    for grad in ("dx", "dweight"):
        if dtype == torch.bfloat16:
            assert_close_to_torch(grad, fused[grad], plain[grad], dtype, rows=9)
        else:
            assert torch.equal(fused[grad], plain[grad]), grad


@pytest.mark.parametrize("name, options", FUSED_OPTIONS)
def test_fused_add_with_options_float32_residual_stream(name, options):
    """bfloat16 input with a float32 residual stream: y is the plain norm of the float32 residual_out (parameters
    and options alike) rounded once to bfloat16, against float64 by the accuracy rule with that as the yardstick."""
    x, residual = torch.randn(7, 257).bfloat16(), torch.randn(7, 257)
    weight, bias = make_params(LAYER_NORM, (257,), True, name == "layer_norm", torch.bfloat16, "cpu")
    y, h = _fused(name, x, residual, (257,), weight, bias, 1e-5, torch.float32, **options)
    assert h.dtype == torch.float32 and torch.equal(h, x.float() + residual)
    as_float = [t.float() if t is not None else None for t in (weight, bias)]
    plain = _plain(name, h, (257,), *as_float, 1e-5, **options)
    ref64 = _plain_reference(name, h.double(), *(t.double() if t is not None else None for t in as_float), **options)
    assert_accuracy("y", y, plain.bfloat16(), ref64, torch.bfloat16, rows=7)


def _plain_reference(name, h, weight, bias, **options):
    if name == "layer_norm":
        return reference.layer_norm(h, h.shape[-1:], weight, bias, 1e-5, **options)
    return reference.rms_norm(h, h.shape[-1:], weight, 1e-5, **options)


@pytest.mark.parametrize("name, options", [*FUSED_OPTIONS, pytest.param("plain_layer_norm", {}, id="plain-layer")])
def test_eager_and_registered_autograd_agree_bitwise(name, options):
    """The eager path (torch_ln._C, C++ autograd: csrc/autograd.cpp) and the registered *_fwd operators (Python
    autograd: torch_ln/ops.py) pass the options to the same kernels: the same bits forward and backward."""
    offset = {"weight_offset": OFFSET} if name == "plain_layer_norm" else options
    x, residual, dy = torch.randn(5, 48), torch.randn(5, 48), torch.randn(5, 48)
    weight, bias = torch.randn(48), torch.randn(48)
    runs = []
    for eager in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, residual, weight, bias)]
        xl, rl, wl, bl = leaves
        if name == "plain_layer_norm":
            if eager:
                y = torch_ln.layer_norm(xl, (48,), wl, bl, 1e-5, **offset)
            else:
                y = torch.ops.torch_ln.layer_norm_fwd(xl, [48], wl, bl, 1e-5, **offset)[0]
            outputs, grads = (y,), (dy,)
        elif eager:
            outputs = _fused(name, xl, rl, (48,), wl, bl if name == "layer_norm" else None, 1e-5, **options)
            grads = (dy, dy)
        else:
            fwd = getattr(torch.ops.torch_ln, f"add_{name}_fwd")
            args = (xl, rl, [48], wl, bl, 1e-5, None) if name == "layer_norm" else (xl, rl, [48], wl, 1e-5, None)
            outputs, grads = fwd(*args, **options)[:2], (dy, dy)
        torch.autograd.backward(outputs, grads)
        runs.append([o.detach() for o in outputs] + [t.grad for t in leaves if t.grad is not None])
    eager, registered = runs
    assert len(eager) == len(registered)
    for a, b in zip(eager, registered):
        assert torch.equal(a, b)


def _opcheck_args(name, options):
    x, residual = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    weight, bias = torch.randn(8), torch.randn(8)
    if name == "layer_norm":
        return (x, residual, [8], weight, bias, 1e-5, None), weight, bias
    return (x, residual, [8], weight, 1e-5, None), weight, None


@pytest.mark.parametrize("name, options", FUSED_OPTIONS)
def test_opcheck(name, options):
    """The operators' schemas, fake kernels and autograd registration with the options given (the plain
    layer_norm with an offset, and the fused ops)."""
    args, weight, bias = _opcheck_args(name, options)
    fwd = getattr(torch.ops.torch_ln, f"add_{name}_fwd").default
    bwd = getattr(torch.ops.torch_ln, f"add_{name}_bwd").default
    torch.library.opcheck(fwd, args, options)
    y, h, *stats = fwd(*args, **options)
    params = (weight, bias) if name == "layer_norm" else (weight,)
    mask = [True] * (1 + len(params))
    torch.library.opcheck(bwd, (torch.randn_like(y), torch.randn_like(h), h, [8], *stats, *params, mask), options)
    if name == "layer_norm":
        x = args[0]
        torch.library.opcheck(torch.ops.torch_ln.layer_norm_fwd.default, (x, [8], weight, bias, 1e-5), options)
        y, mean, rstd = torch.ops.torch_ln.layer_norm_fwd(x, [8], weight, bias, 1e-5, **options)
        bwd_args = (torch.randn_like(y), x, [8], mean, rstd, weight, bias, [True, True, True])
        torch.library.opcheck(torch.ops.torch_ln.layer_norm_bwd.default, bwd_args, options)


def test_gradcheck_and_double_backward():
    """float64 gradcheck and gradgradcheck of every op with an offset (the double backward differentiates the closed
    form with weight + offset)."""
    x, residual = (torch.randn(3, 7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(7, dtype=torch.float64, requires_grad=True) for _ in range(2))
    functions = {
        "layer_norm": (lambda x, w, b: torch_ln.layer_norm(x, (7,), w, b, weight_offset=OFFSET), (x, w, b)),
        "add_layer_norm": (
            lambda x, r, w, b: torch_ln.add_layer_norm(x, r, (7,), w, b, weight_offset=OFFSET),
            (x, residual, w, b),
        ),
        "add_rms_norm": (
            lambda x, r, w: torch_ln.add_rms_norm(x, r, (7,), w, 1e-5, weight_offset=OFFSET, round_normalized=True),
            (x, residual, w),
        ),
    }
    for name, (fn, inputs) in functions.items():
        assert torch.autograd.gradcheck(fn, inputs), name
        assert torch.autograd.gradgradcheck(fn, inputs), name


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_jvp_includes_the_offset(name):
    """Forward-mode AD (torch.func.jvp) multiplies by weight + offset, as the reference's does. Regression: rms_norm's
    jvp multiplied by the weight alone, ignoring weight_offset."""
    x, residual = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    w, b = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    tangents = tuple(torch.randn_like(t) for t in (x, residual, w, b))
    ref_norm = {
        "layer_norm": lambda h, w, b: reference.layer_norm(h, (7,), w, b, 1e-5, weight_offset=OFFSET),
        "rms_norm": lambda h, w, b: reference.rms_norm(h, (7,), w, 1e-5, weight_offset=OFFSET),
    }[name.removeprefix("add_")]
    ours = {
        "layer_norm": lambda x, r, w, b: torch_ln.layer_norm(x, (7,), w, b, weight_offset=OFFSET),
        "rms_norm": lambda x, r, w, b: torch_ln.rms_norm(x, (7,), w, 1e-5, weight_offset=OFFSET),
        "add_layer_norm": lambda x, r, w, b: torch_ln.add_layer_norm(x, r, (7,), w, b, weight_offset=OFFSET)[0],
        "add_rms_norm": lambda x, r, w, b: torch_ln.add_rms_norm(x, r, (7,), w, 1e-5, weight_offset=OFFSET)[0],
    }[name]
    fused = name.startswith("add_")
    theirs = lambda x, r, w, b: ref_norm(x + r if fused else x, w, b)
    _, ours_tangent = torch.func.jvp(ours, (x, residual, w, b), tangents)
    _, ref_tangent = torch.func.jvp(theirs, (x, residual, w, b), tangents)
    torch.testing.assert_close(ours_tangent, ref_tangent, atol=1e-10, rtol=1e-10)


# --------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------

MODULES = [
    pytest.param(torch_ln.LayerNorm, {"weight_offset": OFFSET}, nn.LayerNorm, id="LayerNorm"),
    pytest.param(torch_ln.RMSNorm, {"weight_offset": OFFSET, "round_normalized": True}, nn.RMSNorm, id="RMSNorm"),
    pytest.param(torch_ln.AddLayerNorm, {"weight_offset": OFFSET}, nn.LayerNorm, id="AddLayerNorm"),
    pytest.param(torch_ln.AddRMSNorm, {"weight_offset": OFFSET, "round_normalized": True}, nn.RMSNorm, id="AddRMSNorm"),
]


@pytest.mark.parametrize("cls, options, torch_cls", MODULES)
def test_module_options(cls, options, torch_cls):
    """A new module with an offset multiplies by 1 (its weight starts at 1 - offset), so it computes what the
    module without options computes; its state_dict is torch's module's; the options show in its repr and reach
    the functional op."""
    module, plain = cls(16, **options), cls(16)
    assert torch.equal(module.weight, torch.full((16,), 1.0 - OFFSET))
    assert module.state_dict().keys() == torch_cls(16).state_dict().keys()
    assert f"weight_offset={OFFSET}" in repr(module)
    assert ("round_normalized=True" in repr(module)) == ("round_normalized" in options)
    x, residual = torch.randn(4, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    module, plain = module.bfloat16(), plain.bfloat16()
    inputs = (x, residual) if cls in (torch_ln.AddLayerNorm, torch_ln.AddRMSNorm) else (x,)
    # At initialization weight + offset = 1: the plain module's weight of ones, bit for bit.
    _assert_equal_outputs(module(*inputs), plain(*inputs))
    # Trained weights: the functional op with the module's options.
    with torch.no_grad():
        module.weight.normal_()
    functional = {
        torch_ln.LayerNorm: lambda: torch_ln.layer_norm(x, (16,), module.weight, module.bias, **options),
        torch_ln.RMSNorm: lambda: torch_ln.rms_norm(x, (16,), module.weight, **options),
        torch_ln.AddLayerNorm: lambda: torch_ln.add_layer_norm(
            x, residual, (16,), module.weight, module.bias, **options
        ),
        torch_ln.AddRMSNorm: lambda: torch_ln.add_rms_norm(x, residual, (16,), module.weight, **options),
    }[cls]
    _assert_equal_outputs(module(*inputs), functional())


def _assert_equal_outputs(ours, theirs):
    ours, theirs = (t if isinstance(t, tuple) else (t,) for t in (ours, theirs))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_module_loads_torch_state_dict_and_resets_to_the_identity():
    torch_module = nn.LayerNorm(16)
    with torch.no_grad():
        torch_module.weight.normal_()
    module = torch_ln.LayerNorm(16, weight_offset=OFFSET)
    module.load_state_dict(torch_module.state_dict())
    assert torch.equal(module.weight, torch_module.weight)
    module.reset_parameters()
    assert torch.equal(module.weight, torch.zeros(16)) and torch.equal(module.bias, torch.zeros(16))


def test_swapped_modules_have_no_offset():
    """replace_norms re-classes nn.LayerNorm/nn.RMSNorm without calling a constructor: the class defaults apply."""
    model = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8))
    x = torch.randn(3, 8)
    expected = model(x)
    torch_ln.replace_norms(model)
    assert model[0].weight_offset == 0.0 and not model[1].round_normalized
    torch.testing.assert_close(model(x), expected)


def test_compile_fullgraph_with_options():
    """torch.compile(fullgraph=True, dynamic=True) of modules with options: eager's results, gradients included."""
    torch._dynamo.reset()
    norm = torch_ln.LayerNorm(24, weight_offset=OFFSET)
    fused = torch_ln.AddRMSNorm(24, weight_offset=OFFSET, round_normalized=True)
    with torch.no_grad():
        norm.weight.normal_()
        fused.weight.normal_()

    def block(x, residual):
        y, h = fused(norm(x), residual)
        return y * h

    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for rows in (3, 5):
        x, residual = torch.randn(rows, 24, requires_grad=True), torch.randn(rows, 24, requires_grad=True)
        expected = block(x, residual)
        (gx, gr, gw, gf) = torch.autograd.grad(expected.sum(), (x, residual, norm.weight, fused.weight))
        got = compiled(x, residual)
        assert torch.equal(got, expected)
        for a, b in zip(torch.autograd.grad(got.sum(), (x, residual, norm.weight, fused.weight)), (gx, gr, gw, gf)):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "call, parts",
    [
        (lambda: torch_ln.layer_norm(torch.randn(2, 8), (8,), None, weight_offset=1.0), ("weight_offset=1", "weight")),
        (
            lambda: torch_ln.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), (8,), None, weight_offset=1.0),
            ("add_rms_norm", "weight_offset=1", "weight=None"),
        ),
    ],
)
def test_offset_without_a_weight_is_refused(call, parts):
    with pytest.raises(ValueError) as error:
        call()
    for part in parts:
        assert part in str(error.value)


@pytest.mark.parametrize(
    "call, parts",
    [
        (lambda: torch_ln.layer_norm(torch.randn(2, 8), 8, weight_offset="1"), ("layer_norm", "weight_offset", "str")),
        (
            lambda: torch_ln.add_layer_norm(torch.randn(2, 8), torch.randn(2, 8), 8, weight_offset=None),
            ("add_layer_norm", "weight_offset", "NoneType"),
        ),
        (
            lambda: torch_ln.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), 8, round_normalized=1),
            ("add_rms_norm", "round_normalized", "bool", "int"),
        ),
    ],
)
def test_binding_names_a_wrong_option(call, parts):
    with pytest.raises(TypeError) as error:
        call()
    for part in parts:
        assert part in str(error.value)
