"""The fused residual add + norm (torch_ln.add_layer_norm / add_rms_norm) against the composite
``residual_out = x + residual`` then torch's norm, and against the float64 reference.

Tolerances: the tolerance table and the accuracy rule of tests/norm_cases.py, applied to y, to
the gradients of x and residual (as dx) and to the parameter gradients. residual_out must be
bitwise torch's ``x + residual``: both round the float32 (float64) sum once to residual_dtype.
"""

from __future__ import annotations

import re

import pytest
import torch
from norm_cases import (
    DEVICES,
    NORMS,
    TOLERANCES,
    assert_accuracy,
    assert_close_to_torch,
    make_params,
    norm_affine_dtype_params,
    norm_affine_params,
)
from torch import nn

import torch_ln
from torch_ln import reference

pytestmark = [pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


FUSED = {"layer_norm": torch_ln.add_layer_norm, "rms_norm": torch_ln.add_rms_norm}


def ours(norm, x, residual, shape, weight, bias, eps, residual_dtype=None):
    if norm.has_bias:
        return torch_ln.add_layer_norm(x, residual, shape, weight, bias, eps, residual_dtype)
    return torch_ln.add_rms_norm(x, residual, shape, weight, eps, residual_dtype)


def composite(norm_fn, x, residual, shape, weight, bias, eps, residual_dtype=None):
    """x + residual in residual_dtype, then norm_fn on it with parameters of that dtype, then y in x's dtype."""
    dtype = residual_dtype or x.dtype
    as_stream = (lambda p: p.to(dtype)) if dtype != x.dtype else (lambda p: p)
    weight = as_stream(weight) if weight is not None else None
    bias = as_stream(bias) if bias is not None else None
    return reference.add_norm(norm_fn, x, residual, shape, weight, bias, eps, residual_dtype=residual_dtype)


def run_fused(fn, x, residual, weight, bias, grads, dtype=None) -> dict:
    """fn(x, residual, weight, bias) -> (y, residual_out), then backward with grads = (dy, d residual_out)."""

    def leaf(t):
        if t is None:
            return None
        return (t.detach().clone() if dtype is None else t.detach().to(dtype)).requires_grad_()

    xl, rl, wl, bl = leaf(x), leaf(residual), leaf(weight), leaf(bias)
    y, h = fn(xl, rl, wl, bl)
    torch.autograd.backward(
        (y, h), tuple(g.to(t.dtype) if dtype is None else g.to(dtype) for g, t in zip(grads, (y, h)))
    )
    out = {"y": y.detach(), "residual_out": h.detach(), "dx": xl.grad, "dresidual": rl.grad}
    if wl is not None:
        out["dweight"] = wl.grad
    if bl is not None:
        out["dbias"] = bl.grad
    return out


def check_parity(norm, x, residual, weight, bias, shape, eps, residual_dtype, rows):
    grads = (torch.randn_like(x, dtype=torch.float64), torch.randn_like(x, dtype=torch.float64))
    got = run_fused(lambda *a: ours(norm, *a[:2], shape, *a[2:], eps, residual_dtype), x, residual, weight, bias, grads)
    theirs = run_fused(
        lambda *a: composite(norm.torch, *a[:2], shape, *a[2:], eps, residual_dtype), x, residual, weight, bias, grads
    )
    ref64 = run_fused(
        lambda *a: composite(norm.reference, *a[:2], shape, *a[2:], eps),
        x,
        residual,
        weight,
        bias,
        grads,
        dtype=torch.float64,
    )
    assert got.keys() == theirs.keys()
    assert torch.equal(got["residual_out"], theirs["residual_out"]), "residual_out is not torch's x + residual"
    for name in got:
        assert got[name].dtype == theirs[name].dtype and got[name].shape == theirs[name].shape, name
        assert torch.isfinite(got[name]).all(), name
        if name == "residual_out":
            continue
        kind = {"dresidual": "dx"}.get(name, name)
        # The gradients are in the dtype of their tensor: float32 for a float32 residual stream.
        dtype = got[name].dtype if name in ("dresidual",) else x.dtype
        if name in ("dweight", "dbias"):
            dtype = x.dtype  # parameter grads follow the activation dtype's tolerances
        assert_close_to_torch(kind, got[name], theirs[name], dtype, rows)
        assert_accuracy(kind, got[name], theirs[name], ref64[name], dtype, rows)
    return got


# (shape, normalized dims): M=1 and odd/prime D (vector tails), two normalized dims, many rows,
# and a row beyond the CPU's two-pass size (512 KiB of float32: one-read statistics).
SHAPES = [
    pytest.param((1, 7), 1, id="M1-D7"),  # a single row, no full vector
    pytest.param((5, 3, 129), 1, id="3d-D129"),  # odd D: one element after full vectors
    pytest.param((2, 3, 4, 5), 2, id="norm2"),  # two normalized dims (D=20)
    pytest.param((67, 257), 1, id="M67-D257"),  # more rows than the CPU backward's column split (32)
    pytest.param((3, 4099), 1, id="D4099"),  # prime D: scalar tails after many whole steps
    pytest.param((2, 131075), 1, id="D131075"),  # odd D past 131072 elements: one-read LayerNorm statistics
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm, has_weight, has_bias, dtype, param_dtype", norm_affine_dtype_params())
@pytest.mark.parametrize("shape, normalized_ndim", SHAPES)
def test_parity(shape, normalized_ndim, norm, has_weight, has_bias, dtype, param_dtype, device):
    nshape = shape[len(shape) - normalized_ndim :]
    x, residual = torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)
    weight, bias = make_params(norm, nshape, has_weight, has_bias, param_dtype, device)
    rows = x.numel() // x[(0,) * (x.dim() - normalized_ndim)].numel()
    check_parity(norm, x, residual, weight, bias, nshape, norm.default_eps, None, rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual_in_stream_dtype", [False, True])  # a first block's residual, a later block's
@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("shape", [(1, 7), (67, 257), (3, 4099)], ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_float32_residual_stream(norm, shape, dtype, param_dtype, residual_in_stream_dtype, device):
    """residual_dtype=float32 under half/bfloat16 input: residual_out and d(residual) are float32, y and dx the input's."""
    x = torch.randn(shape, device=device).to(dtype)
    residual = torch.randn(shape, device=device).to(torch.float32 if residual_in_stream_dtype else dtype)
    weight, bias = make_params(norm, shape[-1:], True, norm.has_bias, param_dtype, device)
    got = check_parity(norm, x, residual, weight, bias, shape[-1:], norm.default_eps, torch.float32, shape[0])
    assert got["residual_out"].dtype == torch.float32 and got["y"].dtype == dtype and got["dx"].dtype == dtype
    assert got["dresidual"].dtype == residual.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("d", [33, 131075])  # two-pass statistics; one read (LayerNorm beyond 131072 elements)
@pytest.mark.parametrize("norm", NORMS)
def test_same_bits_as_the_plain_norm(norm, d, dtype):
    """The fused forward is bitwise the plain torch_ln norm of x + residual; the fused backward's dx bitwise the plain
    backward's plus d(residual_out) (in float32 and float64: rounded once either way)."""
    x, residual = torch.randn(9, d).to(dtype), torch.randn(9, d).to(dtype)
    weight, bias = make_params(norm, (d,), True, norm.has_bias, dtype, "cpu")
    y, h = ours(norm, x, residual, (d,), weight, bias, norm.default_eps)
    assert torch.equal(h, x + residual)
    assert torch.equal(y, norm.ours(x + residual, (d,), weight, bias, norm.default_eps))
    if dtype == torch.bfloat16:
        return
    dy, dh_out = torch.randn(9, d).to(dtype), torch.randn(9, d).to(dtype)
    fused = run_fused(
        lambda *a: ours(norm, *a[:2], (d,), *a[2:], norm.default_eps), x, residual, weight, bias, (dy, dh_out)
    )
    hl = (x + residual).requires_grad_()
    params = [p.clone().requires_grad_() for p in (weight, bias) if p is not None]
    norm.ours(hl, (d,), *params, *([None] if not norm.has_bias else []), norm.default_eps).backward(dy)
    assert torch.equal(fused["dx"], hl.grad + dh_out)
    assert torch.equal(fused["dweight"], params[0].grad)


def _bfloat16_special_sums():
    """x and residual (bfloat16, one row of 4096) whose sums, between random normal values, include the lanes the
    CPU's AVX-512 BF16 rounding leaves to the integer one: zeros, denormals, NaN, and around them infinities, sums
    that overflow to infinity, and ties between two bfloat16 values (rounded to even)."""
    x, residual = torch.randn(1, 4096).bfloat16(), torch.randn(1, 4096).bfloat16()
    tiny = torch.finfo(torch.bfloat16).smallest_normal
    special = [
        (0.0, 0.0),  # +0
        (-0.0, -0.0),  # -0
        (tiny / 4, 0.0),  # a denormal
        (-tiny * 0.75, tiny / 8),  # a negative denormal sum
        (float("nan"), 1.0),
        (float("inf"), 1.0),
        (float("-inf"), -1.0),
        (3.0e38, 3.0e38),  # overflows to infinity
        (1.0, 2.0**-8),  # a tie: 1 + 2^-8 rounds to 1 (even)
        (1.0, 3 * 2.0**-8),  # a tie: 1 + 3 * 2^-8 rounds up to 1 + 2^-6 (even)
    ]
    for k, (a, b) in enumerate(special):  # lane k of every fourth 16-lane vector: the others stay plain
        x[0, 64 * k + 3], residual[0, 64 * k + 3] = a, b
    x[0, 4000:4016], residual[0, 4000:4016] = 2.0**-130, 0.0  # a whole vector of denormals
    return x, residual


@pytest.mark.parametrize("norm", NORMS)
def test_bfloat16_rounding_of_special_values(norm):
    """Regression (2026-12-02): the CPU rounds float to bfloat16 with AVX-512 BF16 where the CPU has it, except for
    vectors holding zeros, denormals or NaN, which that instruction flushes or keeps payloads of: residual_out (the
    y of every norm takes the same rounding) is still bitwise torch's x + residual, NaN as the same bits."""
    x, residual = _bfloat16_special_sums()
    _, h = ours(norm, x, residual, (4096,), None, None, norm.default_eps)
    assert torch.equal(h.view(torch.int16), (x + residual).view(torch.int16))


@pytest.mark.parametrize("norm", NORMS)
def test_outputs_never_alias_inputs(norm):
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    weight, _ = make_params(norm, (16,), True, False, torch.float32, "cpu")
    y, h = ours(norm, x, residual, (16,), weight, None, None if not norm.has_bias else 1e-5)
    storages = {t.untyped_storage().data_ptr() for t in (x, residual, weight)}
    assert y.untyped_storage().data_ptr() not in storages and h.untyped_storage().data_ptr() not in storages
    assert y.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()


@pytest.mark.parametrize("needs", ["x", "residual", "weight", "bias", "x,weight"])
@pytest.mark.parametrize("norm", NORMS)
def test_requires_grad_subsets(norm, needs):
    """Only some inputs need gradients; the ones computed equal the all-gradients run."""
    if "bias" in needs and not norm.has_bias:
        pytest.skip("RMSNorm has no bias")
    x, residual = torch.randn(40, 24), torch.randn(40, 24)
    weight, bias = make_params(norm, (24,), True, norm.has_bias, torch.float32, "cpu")
    grads = (torch.randn(40, 24), torch.randn(40, 24))
    full = run_fused(lambda *a: ours(norm, *a[:2], (24,), *a[2:], norm.default_eps), x, residual, weight, bias, grads)
    leaves = {"x": x.clone(), "residual": residual.clone(), "weight": weight.clone()}
    leaves["bias"] = bias.clone() if bias is not None else None
    for name in needs.split(","):
        leaves[name].requires_grad_()
    y, h = ours(norm, leaves["x"], leaves["residual"], (24,), leaves["weight"], leaves["bias"], norm.default_eps)
    torch.autograd.backward((y, h), grads)
    names = {"x": "dx", "residual": "dresidual", "weight": "dweight", "bias": "dbias"}
    for name, leaf in leaves.items():
        if leaf is None:
            continue
        assert (leaf.grad is not None) == (name in needs.split(",")), name
        if leaf.grad is not None:
            torch.testing.assert_close(leaf.grad, full[names[name]], atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# gradcheck, gradgradcheck, opcheck, compile, export.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 5), (6,), (4, 1)], ids=str)  # plain; no batch dims; D=1
@pytest.mark.parametrize("norm, has_weight, has_bias", norm_affine_params())
def test_gradcheck(norm, has_weight, has_bias, shape):
    x, residual = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    weight, bias = make_params(norm, shape[-1:], has_weight, has_bias, torch.float64, "cpu")
    inputs = [t.requires_grad_() for t in (x, residual, weight, bias) if t is not None]

    def fn(*args):
        it = iter(args)
        x, residual = next(it), next(it)
        return ours(
            norm, x, residual, shape[-1:], next(it) if has_weight else None, next(it) if has_bias else None, 1e-3
        )

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def _fwd_args(norm, dtype, param_dtype, residual_dtype, affine=True, shape=(5, 17)):
    x, residual = torch.randn(shape).to(dtype), torch.randn(shape).to(residual_dtype or dtype)
    weight, bias = make_params(norm, shape[-1:], affine, affine and norm.has_bias, param_dtype, "cpu")
    if norm.has_bias:
        return (x, residual, list(shape[-1:]), weight, bias, 1e-5, residual_dtype)
    return (x, residual, list(shape[-1:]), weight, None, residual_dtype)


OPCHECK_DTYPES = [
    (torch.float32, torch.float32, None, True),
    (torch.float64, torch.float64, None, False),
    (torch.bfloat16, torch.float32, torch.float32, True),
    (torch.float16, torch.float16, None, True),
]


@pytest.mark.parametrize("dtype, param_dtype, residual_dtype, affine", OPCHECK_DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_opcheck(norm, dtype, param_dtype, residual_dtype, affine):
    fwd = getattr(torch.ops.torch_ln, f"add_{norm.name}_fwd").default
    bwd = getattr(torch.ops.torch_ln, f"add_{norm.name}_bwd").default
    args = _fwd_args(norm, dtype, param_dtype, residual_dtype, affine)
    torch.library.opcheck(fwd, args)
    y, h, *stats = fwd(*args)
    weight = args[3]
    params = (weight, args[4]) if norm.has_bias else (weight,)
    for grad_h in (torch.randn_like(h), None):
        for dx_wanted in (True, False):
            mask = [dx_wanted] + [True] * len(params)
            torch.library.opcheck(bwd, (torch.randn_like(y), grad_h, h, args[2], *stats, *params, mask))


@pytest.mark.parametrize("norm", NORMS)
def test_compile_fullgraph_dynamic(norm):
    """torch.compile(fullgraph=True, dynamic=True) of a fused add + norm and its backward: eager's results."""
    module = (torch_ln.AddLayerNorm if norm.has_bias else torch_ln.AddRMSNorm)(48)
    with torch.no_grad():
        module.weight.normal_()

    def step(x, residual):
        return module(x, residual)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for rows in (3, 8, 17):
        x, residual = torch.randn(rows, 48, requires_grad=True), torch.randn(rows, 48, requires_grad=True)
        grads = (torch.randn(rows, 48), torch.randn(rows, 48))
        results = []
        for fn in (step, compiled):
            outs = fn(x, residual)
            results.append([*outs, *torch.autograd.grad(outs, (x, residual, module.weight), grads)])
        for name, eager, got in zip(["y", "residual_out", "dx", "dresidual", "dweight"], *results):
            assert torch.equal(got, eager), name  # the same kernels run: bitwise equal


@pytest.mark.parametrize("norm", NORMS)
def test_export(norm):
    module = (torch_ln.AddLayerNorm if norm.has_bias else torch_ln.AddRMSNorm)(32, residual_dtype=None)
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    batch = torch.export.Dim("batch", min=1, max=1024)
    exported = torch.export.export(module, (x, residual), dynamic_shapes={"x": {0: batch}, "residual": {0: batch}})
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert f"torch_ln.add_{norm.name}_fwd.default" in targets
    x, residual = torch.randn(9, 32), torch.randn(9, 32)
    for a, b in zip(exported.module()(x, residual), module(x, residual)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", NORMS)
def test_autocast(norm, dtype, device):
    """Under autocast y has the dtype torch's composite gives it (the input's on the CPU; on CUDA float32 where
    torch runs the norm in float32), and its values."""
    x, residual = torch.randn(6, 48, device=device).to(dtype), torch.randn(6, 48, device=device).to(dtype)
    weight, bias = make_params(norm, (48,), True, norm.has_bias, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16 if device == "cpu" else torch.float16):
        y, h = ours(norm, x, residual, (48,), weight, bias, norm.default_eps)
        theirs = norm.torch(x + residual, (48,), weight, bias, norm.default_eps)
    assert y.dtype == theirs.dtype
    torch.testing.assert_close(h.to(dtype), x + residual, atol=0, rtol=0)  # float32 on CUDA: exact sums
    atol, rtol = TOLERANCES[dtype].fwd
    torch.testing.assert_close(y, theirs, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------
# Determinism and batch invariance (bitwise), as the plain norms.
# ---------------------------------------------------------------------------------------


def _all(norm, x, residual, weight, bias, grads, residual_dtype=None):
    return run_fused(
        lambda *a: ours(norm, *a[:2], x.shape[-1:], *a[2:], norm.default_eps, residual_dtype),
        x,
        residual,
        weight,
        bias,
        grads,
    )


@pytest.mark.parametrize("residual_dtype", [None, torch.float32])
@pytest.mark.parametrize("m, d", [(2049, 257), (4, 65537)])  # many rows (parallel dweight); huge rows
@pytest.mark.parametrize("norm", NORMS)
def test_deterministic(norm, m, d, residual_dtype):
    """Bitwise identical outputs and gradients from run to run and whatever the thread count."""
    x, residual = torch.randn(m, d).bfloat16(), torch.randn(m, d).bfloat16()
    grads = (torch.randn(m, d), torch.randn(m, d))
    weight, bias = make_params(norm, (d,), True, norm.has_bias, torch.bfloat16, "cpu")
    first = _all(norm, x, residual, weight, bias, grads, residual_dtype)
    threads = torch.get_num_threads()
    try:
        for run_threads in (threads, 1, 2, 3):  # 3 threads split the 8 chunks across the sum tree's subtrees
            torch.set_num_threads(run_threads)
            again = _all(norm, x, residual, weight, bias, grads, residual_dtype)
            for name in first:
                assert torch.equal(first[name], again[name]), f"{name} differs ({run_threads} threads)"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# odd, two-pass; prime, many whole steps; odd beyond 131072 elements (one-read statistics)
@pytest.mark.parametrize("d", [33, 4099, 131075])
@pytest.mark.parametrize("norm", NORMS)
def test_batch_invariance(norm, d, dtype):
    """A row's y, residual_out and gradients are bitwise the same alone and inside batches, at any position."""
    row, res_row = torch.randn(1, d).to(dtype), torch.randn(1, d).to(dtype)
    grad_rows = (torch.randn(1, d).to(dtype), torch.randn(1, d).to(dtype))
    weight, bias = make_params(norm, (d,), True, norm.has_bias, dtype, "cpu")
    alone = _all(norm, row, res_row, weight, bias, grad_rows)
    # The CPU backward's column split, and its row chunks (1031 rows only for short rows: the long row's one-read
    # statistics are per row, and 64 rows already take the row chunks).
    for batch in (2, 64, 1031) if d < 10000 else (2, 64):
        for position in sorted({0, batch // 2, batch - 1}):
            x, residual = torch.randn(batch, d).to(dtype), torch.randn(batch, d).to(dtype)
            grads = (torch.randn(batch, d).to(dtype), torch.randn(batch, d).to(dtype))
            x[position], residual[position] = row[0], res_row[0]
            grads[0][position], grads[1][position] = grad_rows[0][0], grad_rows[1][0]
            inside = _all(norm, x, residual, weight, bias, grads)
            for name in ("y", "residual_out", "dx", "dresidual"):
                assert torch.equal(inside[name][position], alone[name][0]), f"{name} at {position} of {batch}"


# ---------------------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, exception, parts",
    [
        ({"residual": torch.randn(4, 15)}, ValueError, ["residual", "input's shape", "[4, 16]", "[4, 15]"]),
        ({"residual": torch.randn(16)}, ValueError, ["residual", "input's shape"]),
        ({"residual": torch.randn(4, 16).double()}, TypeError, ["residual", "Float", "Double"]),
        ({"residual_dtype": torch.int32}, TypeError, ["residual_dtype", "floating-point", "Int"]),
        ({"residual_dtype": torch.float64}, TypeError, ["residual_dtype", "input's dtype (Float)", "Double"]),
        ({"x": torch.randn(4, 16).bfloat16()}, TypeError, ["residual", "BFloat16", "Float"]),
        (
            {"x": torch.randn(4, 16).bfloat16(), "residual_dtype": torch.float16},
            TypeError,
            ["residual_dtype", "or float32", "Half"],
        ),
    ],
)
@pytest.mark.parametrize("norm", NORMS)
def test_errors(norm, change, exception, parts):
    args = {"x": torch.randn(4, 16), "residual": torch.randn(4, 16), "residual_dtype": None} | change
    with pytest.raises(exception) as info:
        ours(norm, args["x"], args["residual"], (16,), None, None, norm.default_eps, args["residual_dtype"])
    message = str(info.value)
    assert f"add_{norm.name}" in message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


def test_error_float32_residual_without_residual_dtype():
    """A float32 residual stream needs residual_dtype=float32 under bfloat16 input: no silent narrowing."""
    with pytest.raises(TypeError, match="expected residual of dtype BFloat16, but got residual.dtype=Float"):
        torch_ln.add_rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(2, 8), 8)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_error_backward_names_residual_out_dtype(norm):
    """Regression: a residual_out of the wrong dtype in the backward was reported as a bad residual_dtype, an argument
    the backward does not have."""
    grad_out, residual_out, stat = torch.randn(2, 8).bfloat16(), torch.randn(2, 8).half(), torch.ones(2, 1)
    expected = (
        "expected residual_out.dtype to be grad_out's dtype (BFloat16) or float32, but got residual_out.dtype=Half"
    )
    with pytest.raises(TypeError, match=re.escape(expected)):
        if norm == "layer_norm":
            torch.ops.torch_ln.add_layer_norm_bwd(grad_out, None, residual_out, [8], stat, stat, None, None, [True] * 3)
        else:
            torch.ops.torch_ln.add_rms_norm_bwd(grad_out, None, residual_out, [8], stat, None, [True] * 2)


# ---------------------------------------------------------------------------------------
# Modules and the pre-norm block recipe.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ours_cls, theirs_cls, kwargs",
    [
        (torch_ln.AddLayerNorm, nn.LayerNorm, {"eps": 1e-6}),
        (torch_ln.AddLayerNorm, nn.LayerNorm, {"elementwise_affine": False}),
        (torch_ln.AddLayerNorm, nn.LayerNorm, {"bias": False}),
        (torch_ln.AddRMSNorm, nn.RMSNorm, {"eps": None}),
        (torch_ln.AddRMSNorm, nn.RMSNorm, {"elementwise_affine": False}),
    ],
)
def test_module_matches_torch_module(ours_cls, theirs_cls, kwargs):
    """Same constructor and state_dict as the torch module; forward(x, residual) is the composite's."""
    theirs = theirs_cls((3, 8), **kwargs)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    fused = ours_cls((3, 8), **kwargs)
    assert fused.state_dict().keys() == theirs.state_dict().keys()
    fused.load_state_dict(theirs.state_dict())
    x, residual = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    y, h = fused(x, residual)
    assert torch.equal(h, x + residual)
    torch.testing.assert_close(y, theirs(x + residual), atol=1e-5, rtol=1e-5)  # float32 row of the table
    assert repr(fused).replace(ours_cls.__name__, theirs_cls.__name__) == repr(theirs)


class FusedPreNormEncoderLayer(nn.Module):
    """The pre-norm recipe (README, "Fused residual add"): ``nn.TransformerEncoderLayer(norm_first=True)``
    rewritten to carry (hidden, residual) between blocks, so that each sublayer's output is added to the
    residual stream by the next norm. ``forward`` takes the previous block's unadded output and the residual
    stream; the first block passes zeros as the output, and the last one's sum is its own h + residual."""

    def __init__(self, layer: nn.TransformerEncoderLayer):
        super().__init__()
        self.layer = layer  # its attention, feed-forward and the norms' parameters
        self.norm1, self.norm2 = (
            torch_ln.AddLayerNorm(layer.norm1.normalized_shape),
            torch_ln.AddLayerNorm(layer.norm2.normalized_shape),
        )
        self.norm1.load_state_dict(layer.norm1.state_dict())
        self.norm2.load_state_dict(layer.norm2.state_dict())

    def forward(self, hidden, residual):
        y, residual = self.norm1(hidden, residual)
        hidden = self.layer._sa_block(y, None, None)
        y, residual = self.norm2(hidden, residual)
        return self.layer._ff_block(y), residual


def test_pre_norm_recipe():
    """A stack of fused blocks computes what the torch stack of norm_first encoder layers does."""
    layers = [nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True) for _ in range(3)]
    for layer in layers:
        with torch.no_grad():
            for norm in (layer.norm1, layer.norm2):
                norm.weight.normal_(1, 0.2)
                norm.bias.normal_(0, 0.2)
        layer.eval()
    x = torch.randn(2, 5, 32)
    expected = x
    for layer in layers:
        expected = layer(expected)
    hidden, residual = torch.zeros_like(x), x
    for block in [FusedPreNormEncoderLayer(layer) for layer in layers]:
        hidden, residual = block(hidden, residual)
    torch.testing.assert_close(hidden + residual, expected, atol=1e-5, rtol=1e-5)  # float32 row of the table
