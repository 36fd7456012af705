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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, normalized_ndim", SHAPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize(
    "transform",
    ["grad", "vjp", "jacrev", "jacfwd", "jvp", "hessian"],
)
def test_transform_matches_torch(transform, norm, shape, normalized_ndim, device, capfd):
    x, params, nshape = _inputs(norm, shape, normalized_ndim, device)
    ours, theirs = _functions(norm, nshape)
    args = (x, *params)
    argnums = tuple(range(len(args)))
    with no_vmap_fallback(capfd):
        if transform == "grad":
            got, want = (grad(_scalar(f), argnums)(*args) for f in (ours, theirs))
        elif transform == "vjp":
            cotangent = torch.randn_like(x)
            got, want = (vjp(f, *args)[1](cotangent) for f in (ours, theirs))
        elif transform in ("jacrev", "jacfwd"):
            jac = jacrev if transform == "jacrev" else jacfwd
            got, want = (jac(f, argnums)(*args) for f in (ours, theirs))
        elif transform == "jvp":
            tangents = tuple(torch.randn_like(a) for a in args)
            got, want = (jvp(f, args, tangents) for f in (ours, theirs))
        else:  # forward-over-reverse, and the other three orders
            f = _scalar(ours)
            got = [hessian(f)(*args), jacrev(jacrev(f))(*args), jacfwd(jacfwd(f))(*args), jacrev(jacfwd(f))(*args)]
            want = [hessian(_scalar(theirs))(*args)] * 4
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

    with no_vmap_fallback(capfd):
        got = vmap(fwd_bwd, in_dims=in_dims)(x, grad_out)
    samples = [fwd_bwd(x.select(in_dims, i), grad_out.select(in_dims, i)) for i in range(4)]
    want = [torch.stack(outputs) for outputs in zip(*samples)]
    torch.testing.assert_close(list(got), want, **TOL)


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
