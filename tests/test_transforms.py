"""torch_ln under torch.func: vmap (batching rules, no per-sample fallback), grad, vjp, jacrev, jacfwd, jvp,
hessians, per-sample gradients and functional_call, against torch's norms.

Everything is float64 with small inputs: transforms only rearrange the same arithmetic, so results agree
with torch to rounding (tolerance 1e-10, far below any formula error and far above float64 rounding).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from norm_cases import DEVICES, LAYER_NORM, NORMS, RMS_NORM
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import torch_ln

TOL = {"atol": 1e-10, "rtol": 1e-10}

# (input shape, normalized ndim): M=1; a prime D (7) with two batch dims; two normalized dims (D=15).
SHAPES = [
    pytest.param((1, 7), 1, id="M1-D7"),
    pytest.param((2, 3, 7), 1, id="2x3x7"),
    pytest.param((2, 3, 5), 2, id="norm2-D15"),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@contextlib.contextmanager
def no_vmap_fallback(capfd):
    """torch's per-sample vmap fallback turned into an error, and its warning (printed by C++) looked for."""
    torch._C._functorch._set_vmap_fallback_enabled(False)
    torch._C._functorch._set_vmap_fallback_warning_enabled(True)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(True)
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    assert "batching rule" not in capfd.readouterr().err


def _check_vmap_against_samples(f, rows, in_dims, capfd):
    """f under vmap over the row tensors `rows` (dim in_dims), vs. f run sample by sample, stacked."""
    with no_vmap_fallback(capfd):
        got = vmap(f, in_dims=in_dims)(*rows)
    samples = [f(*(t.select(in_dims, i) for t in rows)) for i in range(rows[0].shape[in_dims])]
    want = [torch.stack(outputs) for outputs in zip(*samples)]
    torch.testing.assert_close(list(got), want, **TOL)


def _inputs(norm, shape, normalized_ndim, device):
    x = torch.randn(shape, dtype=torch.float64, device=device)
    params = [torch.randn(shape[-normalized_ndim:], dtype=torch.float64, device=device) for _ in norm.params]
    return x, params, shape[-normalized_ndim:]


def _functions(norm, normalized_shape):
    """(ours, torch's) as functions of (x, *params), reduced to a scalar with a nonlinearity for grad."""
    return (lambda x, *p: norm.ours(x, normalized_shape, *p)), (lambda x, *p: norm.torch(x, normalized_shape, *p))


def _scalar(f):
    return lambda *args: f(*args).pow(3).sum()


def test_fallback_detection_works(capfd):
    """The guard used below does catch an operator without a batching rule."""
    lib = torch.library.Library("torch_ln_test_no_rule", "DEF")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CompositeExplicitAutograd")
    with pytest.raises(RuntimeError, match="vmap fallback"), no_vmap_fallback(capfd):
        vmap(torch.ops.torch_ln_test_no_rule.double)(torch.randn(3, 4))


def _transform_results(transform, ours, theirs, args, scalar, cotangent):
    """(ours, theirs) under one torch.func transform, at args; `scalar` makes a function's outputs one scalar (grad,
    hessian), `cotangent` is vjp's."""
    argnums = tuple(range(len(args)))
    if transform == "grad":
        return (grad(scalar(f), argnums)(*args) for f in (ours, theirs))
    if transform == "vjp":
        return (vjp(f, *args)[1](cotangent) for f in (ours, theirs))
    if transform in ("jacrev", "jacfwd"):
        jac = jacrev if transform == "jacrev" else jacfwd
        return (jac(f, argnums)(*args) for f in (ours, theirs))
    if transform == "jvp":
        tangents = tuple(torch.randn_like(a) for a in args)
        return (jvp(f, args, tangents) for f in (ours, theirs))
    # forward-over-reverse, and the other three orders
    f = scalar(ours)
    got = [hessian(f)(*args), jacrev(jacrev(f))(*args), jacfwd(jacfwd(f))(*args), jacrev(jacfwd(f))(*args)]
    return got, [hessian(scalar(theirs))(*args)] * 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, normalized_ndim", SHAPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "jacfwd", "jvp", "hessian"])
def test_transform_matches_torch(transform, norm, shape, normalized_ndim, device, capfd):
    x, params, nshape = _inputs(norm, shape, normalized_ndim, device)
    ours, theirs = _functions(norm, nshape)
    with no_vmap_fallback(capfd):
        got, want = _transform_results(transform, ours, theirs, (x, *params), _scalar, torch.randn_like(x))
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize(
    "in_dims",
    [
        pytest.param(0, id="batch-front"),
        pytest.param(1, id="batch-middle"),  # a vmapped dim between the row dims
        pytest.param(3, id="inside-normalized"),  # the physical layout puts it among the normalized dims
    ],
)
def test_vmap_forward_and_backward_ops(norm, in_dims, device, capfd):
    """The fwd and bwd operators under vmap over every row argument, vs. the operator run per sample."""
    physical = [4, 3, 5, 6]  # 4 samples of (3, 5, 6) when in_dims=0; normalized over the last logical dim
    x = torch.randn(physical, dtype=torch.float64, device=device)
    x = x.movedim(0, in_dims)
    grad_out = torch.randn_like(x)
    params = [torch.randn(6, dtype=torch.float64, device=device) for _ in norm.params]

    def fwd_bwd(x, grad_out):
        y, stats = norm.fwd(x, (6,), *params)
        return (y, *stats, *norm.bwd(grad_out, x, (6,), stats, *params))

    _check_vmap_against_samples(fwd_bwd, (x, grad_out), in_dims, capfd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", NORMS)
def test_vmap_backward_only_grad_out_batched(norm, device, capfd):
    """jacobians through torch.autograd.grad(is_grads_batched=True): the bwd kernel with one vmapped argument."""
    x = torch.randn(3, 7, dtype=torch.float64, device=device, requires_grad=True)
    params = [torch.randn(7, dtype=torch.float64, device=device, requires_grad=True) for _ in norm.params]
    basis = torch.eye(21, dtype=torch.float64, device=device).view(21, 3, 7)
    jacobians = []
    for f in (norm.ours, norm.torch):
        y = f(x, (7,), *params)
        with no_vmap_fallback(capfd):
            jacobians.append(torch.autograd.grad(y, (x, *params), basis, is_grads_batched=True))
    torch.testing.assert_close(jacobians[0], jacobians[1], **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "norm, batched",
    [(LAYER_NORM, "weight"), (LAYER_NORM, "bias"), (RMS_NORM, "weight")],
    ids=["layer_norm-weight", "layer_norm-bias", "rms_norm-weight"],
)
def test_vmap_batched_parameters(norm, batched, device, capfd):
    """A vmapped weight or bias (model ensembles): the documented per-sample path, still right."""
    x = torch.randn(2, 5, 8, dtype=torch.float64, device=device)
    stacked = {name: torch.randn(3, 8, dtype=torch.float64, device=device) for name in norm.params}
    in_dims = tuple(0 if name == batched else None for name in norm.params)
    fixed = [stacked[name] if name == batched else stacked[name][0] for name in norm.params]

    def f(*params):
        return norm.ours(x, (8,), *params)

    with no_vmap_fallback(capfd):
        got = vmap(f, in_dims=in_dims)(*fixed)
    want = torch.stack(
        [norm.torch(x, (8,), *(p[i] if d == 0 else p for p, d in zip(fixed, in_dims))) for i in range(3)]
    )
    torch.testing.assert_close(got, want, **TOL)


class _TinyModel(nn.Module):
    def __init__(self, norm_types):
        super().__init__()
        self.inp, self.ln, self.out, self.rms = nn.Linear(6, 10), norm_types[0](10), nn.Linear(10, 6), norm_types[1](6)
        with torch.no_grad():
            for p in (self.ln.weight, self.ln.bias, self.rms.weight):
                p.normal_(1, 0.3)

    def forward(self, x):
        return self.rms(self.out(torch.tanh(self.ln(self.inp(x)))))


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_grads_functional_call(device, capfd):
    """The torch.func per-sample-gradient recipe: vmap(grad(functional_call)) over a batch, vs. torch's norms."""
    torch.manual_seed(1)
    ours = _TinyModel((torch_ln.LayerNorm, torch_ln.RMSNorm)).to(device, torch.float64)
    theirs = _TinyModel((nn.LayerNorm, nn.RMSNorm)).to(device, torch.float64)
    theirs.load_state_dict(ours.state_dict())
    data = torch.randn(5, 4, 6, dtype=torch.float64, device=device)  # 5 samples of 4 tokens

    def per_sample(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, sample):
            return functional_call(model, p, (sample,)).pow(2).sum()

        return vmap(grad(loss), in_dims=(None, 0))(params, data)

    with no_vmap_fallback(capfd):
        got = per_sample(ours)
    want = per_sample(theirs)
    assert got.keys() == want.keys() and {t.shape[0] for t in got.values()} == {5}
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", NORMS)
def test_forward_ad_dual_tensors(norm, device):
    """torch.autograd.forward_ad (no torch.func) uses the same jvp rule."""
    fwad = torch.autograd.forward_ad
    x, params, _ = _inputs(norm, (3, 9), 1, device)
    tangents = [torch.randn_like(t) for t in (x, *params)]
    want = jvp(lambda *a: norm.torch(a[0], (9,), *a[1:]), (x, *params), tuple(tangents))[1]
    with fwad.dual_level():
        duals = [fwad.make_dual(p, t) for p, t in zip((x, *params), tangents)]
        got = fwad.unpack_dual(norm.ours(duals[0], (9,), *duals[1:])).tangent
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("norm", [LAYER_NORM, RMS_NORM], ids=["layer_norm", "rms_norm"])
def test_statistics_tangents(norm):
    """jvp of the fwd operator's statistics outputs, vs. finite differences of them in float64."""
    x, params, _ = _inputs(norm, (4, 11), 1, "cpu")
    t = torch.randn_like(x)
    _, (stats_tangents) = jvp(lambda x: norm.fwd(x, (11,), *params)[1], (x,), (t,))
    h = 1e-6
    plus, minus = norm.fwd(x + h * t, (11,), *params)[1], norm.fwd(x - h * t, (11,), *params)[1]
    # Central differences: error O(h^2) ~ 1e-12 relative, rounding ~ 1e-16 / h = 1e-10.
    for got, p, m in zip(stats_tangents, plus, minus):
        torch.testing.assert_close(got, (p - m) / (2 * h), atol=1e-8, rtol=1e-7)


# ------------------------------------------------------------------------------------------------
# The fused residual add + norm: (y, residual_out) = (norm(x + residual), x + residual)
# ------------------------------------------------------------------------------------------------

FUSED = {"layer_norm": torch_ln.add_layer_norm, "rms_norm": torch_ln.add_rms_norm}


def _fused_functions(norm, normalized_shape):
    """(ours, the composite with torch's norm) as functions of (x, residual, *params) -> (y, residual_out)."""

    def composite(x, residual, *params):
        h = x + residual
        return norm.torch(h, normalized_shape, *params), h

    return (lambda x, residual, *p: FUSED[norm.name](x, residual, normalized_shape, *p)), composite


def _fused_scalar(f):
    return lambda *args: sum(out.pow(3).sum() for out in f(*args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, normalized_ndim", SHAPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "jacfwd", "jvp", "hessian"])
def test_fused_transform_matches_composite(transform, norm, shape, normalized_ndim, device, capfd):
    x, params, nshape = _inputs(norm, shape, normalized_ndim, device)
    ours, theirs = _fused_functions(norm, nshape)
    args = (x, torch.randn_like(x), *params)
    cotangents = (torch.randn_like(x), torch.randn_like(x))
    with no_vmap_fallback(capfd):
        got, want = _transform_results(transform, ours, theirs, args, _fused_scalar, cotangents)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_grad_residual_out", [True, False], ids=["grad_residual_out", "no-grad_residual_out"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("in_dims", [pytest.param(0, id="batch-front"), pytest.param(3, id="inside-normalized")])
def test_vmap_fused_forward_and_backward_ops(norm, in_dims, with_grad_residual_out, device, capfd):
    """add_*_fwd and add_*_bwd under vmap over every row argument, vs. the operators run per sample."""
    fwd = getattr(torch.ops.torch_ln, f"add_{norm.name}_fwd").default
    bwd = getattr(torch.ops.torch_ln, f"add_{norm.name}_bwd").default
    rows = [torch.randn(4, 3, 5, 6, dtype=torch.float64, device=device).movedim(0, in_dims) for _ in range(4)]
    params = [torch.randn(6, dtype=torch.float64, device=device) for _ in norm.params]
    mask = [True] * (1 + len(params))

    def fwd_bwd(x, residual, grad_out, grad_residual_out):
        y, residual_out, *stats = fwd(x, residual, [6], *params, norm.default_eps, None)
        grad_residual_out = grad_residual_out if with_grad_residual_out else None
        return (y, residual_out, *stats, *bwd(grad_out, grad_residual_out, residual_out, [6], *stats, *params, mask))

    _check_vmap_against_samples(fwd_bwd, rows, in_dims, capfd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", NORMS)
def test_fused_per_sample_grads(norm, device, capfd):
    """vmap(grad) over samples with shared parameters: per-sample parameter gradients of the fused op."""
    x, params, _ = _inputs(norm, (5, 4, 8), 1, device)
    residual = torch.randn_like(x)
    losses = [_fused_scalar(f) for f in _fused_functions(norm, (8,))]

    def per_sample(loss):
        return vmap(grad(loss, argnums=tuple(range(len(params) + 2))), in_dims=(0, 0, *(None,) * len(params)))

    with no_vmap_fallback(capfd):
        got = per_sample(losses[0])(x, residual, *params)
    torch.testing.assert_close(got, per_sample(losses[1])(x, residual, *params), **TOL)


@pytest.mark.parametrize("norm", NORMS)
def test_fused_jvp_float32_residual_stream(norm):
    """bfloat16 x and residual with residual_dtype=float32: the tangents in the dtypes of the outputs, y's equal to
    the composite's (the sum exact in float32: bfloat16 addends; tolerance: bfloat16 rounding of y's tangent)."""
    x, params, _ = _inputs(norm, (3, 16), 1, "cpu")
    x, residual = x.bfloat16(), torch.randn_like(x).bfloat16()
    params = [p.float() for p in params]  # parameters of x's dtype or float32
    fused = FUSED[norm.name]

    def composite(x, residual):
        h = x.float() + residual.float()
        return norm.torch(h, (16,), *params).to(torch.bfloat16), h

    tangents = (torch.randn_like(x), torch.randn_like(x))
    got = jvp(lambda x, r: fused(x, r, (16,), *params, residual_dtype=torch.float32), (x, residual), tangents)
    want = jvp(composite, (x, residual), tangents)
    assert [t.dtype for t in got[1]] == [torch.bfloat16, torch.float32]
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------------------
# The gated RMSNorm: y = rms_norm(x * act(z)) or rms_norm(x) * act(z), groups with their own rstd
# ------------------------------------------------------------------------------------------------

# (gate_position, activation, group_size): Mamba2's (before, groups of 4 in a row of 12), the sigmoid gate after an
# ungrouped norm, FalconH1's silu gate after a grouped one.
GATED_FORMS = [("before", "silu", 4), ("after", "sigmoid", None), ("after", "silu", 6)]


def _gated_functions(position, activation, group_size):
    """(ours, the torch-ops reference) as functions of (x, z, weight)."""
    options = {"gate_position": position, "activation": activation, "group_size": group_size}
    return (
        lambda x, z, w: torch_ln.gated_rms_norm(x, z, 12, w, 1e-5, **options),
        lambda x, z, w: torch_ln.reference.gated_rms_norm(x, z, w, 1e-5, **options),
    )


def _gated_inputs(shape, device):
    return [torch.randn(s, dtype=torch.float64, device=device) for s in (shape, shape, shape[-1:])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("position", "activation", "group_size"), GATED_FORMS)
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "jacfwd", "jvp", "hessian"])
def test_gated_transform_matches_reference(transform, position, activation, group_size, device, capfd):
    args = _gated_inputs((2, 3, 12), device)
    ours, theirs = _gated_functions(position, activation, group_size)
    with no_vmap_fallback(capfd):
        got, want = _transform_results(transform, ours, theirs, tuple(args), _scalar, torch.randn_like(args[0]))
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("position", "activation", "group_size"), GATED_FORMS)
@pytest.mark.parametrize("in_dims", [pytest.param(0, id="batch-front"), pytest.param(2, id="inside-normalized")])
def test_vmap_gated_forward_and_backward_ops(position, activation, group_size, in_dims, device, capfd):
    """gated_rms_norm_fwd and _bwd under vmap over every row argument (x, z, grad_out), vs. the operators run per
    sample: the backward's dweight is summed per sample (_gated_norm_param_grads), dx and dgate by the kernels."""
    options = (position, activation, group_size, False)
    weight = torch.randn(12, dtype=torch.float64, device=device)
    rows = [torch.randn(4, 3, 12, dtype=torch.float64, device=device).movedim(0, in_dims) for _ in range(3)]

    def fwd_bwd(x, z, grad_out):
        y, rstd = torch.ops.torch_ln.gated_rms_norm_fwd(x, z, [12], weight, 1e-5, *options)
        grads = torch.ops.torch_ln.gated_rms_norm_bwd(grad_out, x, z, [12], rstd, weight, [True] * 3, *options)
        return y, rstd, *grads

    _check_vmap_against_samples(fwd_bwd, rows, in_dims, capfd)


@pytest.mark.parametrize("device", DEVICES)
def test_gated_per_sample_grads(device, capfd):
    """vmap(grad) over samples with a shared weight: per-sample gradients of x, z and the weight."""
    x, z, w = _gated_inputs((5, 4, 12), device)
    losses = [_scalar(f) for f in _gated_functions("before", "silu", 4)]

    def per_sample(loss):
        return vmap(grad(loss, argnums=(0, 1, 2)), in_dims=(0, 0, None))

    with no_vmap_fallback(capfd):
        got = per_sample(losses[0])(x, z, w)
    torch.testing.assert_close(got, per_sample(losses[1])(x, z, w), **TOL)


@pytest.mark.parametrize(("position", "activation", "group_size"), GATED_FORMS)
def test_gated_rstd_tangent(position, activation, group_size):
    """jvp of the forward operator's rstd (a value per row and group), vs. finite differences in float64."""
    x, z, w = _gated_inputs((4, 12), "cpu")
    tangents = (torch.randn_like(x), torch.randn_like(z))

    def rstd(x, z):
        return torch.ops.torch_ln.gated_rms_norm_fwd(x, z, [12], w, 1e-5, position, activation, group_size)[1]

    _, got = jvp(rstd, (x, z), tangents)
    h = 1e-6
    plus, minus = rstd(x + h * tangents[0], z + h * tangents[1]), rstd(x - h * tangents[0], z - h * tangents[1])
    # Central differences: error O(h^2) ~ 1e-12 relative, rounding ~ 1e-16 / h = 1e-10.
    torch.testing.assert_close(got, (plus - minus) / (2 * h), atol=1e-8, rtol=1e-7)
