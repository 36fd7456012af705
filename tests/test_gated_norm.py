"""torch_ln.gated_rms_norm (the CPU kernels' gate option): forward and backward against the torch-ops arithmetic of
reference.gated_rms_norm (the classes' own, tests/test_gated_norm_reference.py) by the project's accuracy rule, with
the tolerance table of tests/norm_cases.py; the op's contract (shapes, errors, opcheck, compile, gradcheck); the
module; and replace_norms on a tiny model of every family with a gated RMSNorm.

"torch" below is reference.gated_rms_norm run in the input's dtype: what the classes compute, differentiated by
torch's autograd. ref64 is the same in float64, with no intermediate rounding.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import transformers
from gated_models import GATED_CLASSES, GATED_MODELS
from norm_cases import DEVICES, GATED_FORMS, assert_accuracy, assert_close_to_torch, gated_inputs
from test_gated_norm_reference import CLASSES, OPTIONAL_GATE
from test_gated_norm_reference import _class as gated_class

import torch_ln
from torch_ln import reference

# Tolerances: the table of tests/norm_cases.py, per dtype: y and the input's and gate's gradients by its fwd / dx
# rows (a gate's gradient is, like dx, a float32 value rounded once to the input's dtype), the weight's by its dparam
# row (a sum over rows: atol grows with sqrt(M)). On top, the accuracy rule: at most twice torch's error against
# float64, plus the table's floor.
GRAD_KIND = {"dx": "dx", "dgate": "dx", "dweight": "dweight"}

# (rows, row length, group size): M=1; an odd row length (97: no whole vector step) ungrouped; four groups of 16;
# groups of an odd size (3 x 65: groups straddle the vector steps); 40 rows (the backward's row chunks, from 32 rows
# up; fewer take the column split) with groups; a row longer than the column split's block (2048) with groups that
# straddle its block boundary (3 groups of 1400); D=1.
SHAPES = [(1, 64, None), (3, 97, None), (5, 64, 16), (4, 195, 65), (40, 128, 32), (3, 4200, 1400), (6, 1, None)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _run(fn, x, z, w, dy, to=None):
    """fn(x, z, w) forward and backward(dy), the leaves converted `to` a dtype first: {"y", "dx", "dgate",
    "dweight"} (the absent ones left out)."""
    leaves = [
        None if t is None else (t.detach().clone() if to is None else t.detach().to(to)).requires_grad_()
        for t in (x, z, w)
    ]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype if to is None else to))  # a promoted output (Mamba2's float32 weight) takes dy so
    out = {"y": y.detach()}
    out.update({name: t.grad for name, t in zip(("dx", "dgate", "dweight"), leaves) if t is not None})
    return out


def _check(x, z, w, dy, dtype, **options):
    rows = x.shape[0]

    def ours(x, z, w):
        return torch_ln.gated_rms_norm(x, z, x.shape[-1], w, 1e-6, **options)

    def theirs(x, z, w):
        return reference.gated_rms_norm(x, z, w, 1e-6, **options)

    got, want, ref64 = _run(ours, x, z, w, dy), _run(theirs, x, z, w, dy), _run(theirs, x, z, w, dy, torch.float64)
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.isfinite(got[name]).all(), name
        kind = "y" if name == "y" else GRAD_KIND[name]
        assert_close_to_torch(kind, got[name], want[name].to(got[name].dtype), dtype, rows)
        assert_accuracy(name, got[name], want[name], ref64[name], dtype, rows)


@pytest.mark.parametrize(("rows", "cols", "group_size"), SHAPES)
@pytest.mark.parametrize(("gate_position", "activation", "round_normalized"), GATED_FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm_matches_the_reference(
    rows, cols, group_size, gate_position, activation, round_normalized, dtype, device
):
    x, z, w, dy = gated_inputs(rows, cols, dtype, dtype, with_gate=True, device=device)
    _check(
        x,
        z,
        w,
        dy,
        dtype,
        gate_position=gate_position,
        activation=activation,
        group_size=group_size,
        round_normalized=round_normalized,
    )


# A float32 weight with half/bfloat16 input (the kernels' mixed parameters), no weight, no gate (a grouped plain
# RMSNorm: Mamba2's gate=None). Not Mamba2's form with a float32 weight: the class's output is then float32 (a
# promoted product, which its swap leaves to torch: test_swapped_class_matches_the_class).
VARIANTS = [
    (weight_dtype, with_gate, *form)
    for (weight_dtype, with_gate), form in itertools.product(
        [(torch.float32, True), (None, True), ("input", False)], GATED_FORMS
    )
    if not (weight_dtype == torch.float32 and form[0] == "before" and form[2])
]


@pytest.mark.parametrize(("weight_dtype", "with_gate", "gate_position", "activation", "round_normalized"), VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm_weight_and_gate_variants(
    weight_dtype, with_gate, gate_position, activation, round_normalized, dtype, device
):
    weight_dtype = dtype if weight_dtype == "input" else weight_dtype
    x, z, w, dy = gated_inputs(40, 192, dtype, weight_dtype, with_gate, device=device)
    _check(
        x,
        z,
        w,
        dy,
        dtype,
        gate_position=gate_position,
        activation=activation,
        group_size=64,
        round_normalized=round_normalized,
    )


def test_rstd_per_group_and_batch_shape():
    """rstd holds each group's float32 rsqrt(mean(h^2) + eps), in the batch's shape then the groups."""
    x, z, _, _ = gated_inputs(6, 96, torch.bfloat16, None, with_gate=True)
    x, z = x.view(2, 3, 96), z.view(2, 3, 96)
    _, rstd = torch.ops.torch_ln.gated_rms_norm_fwd(x, z, [96], None, 1e-6, "before", "silu", 32)
    h = (x.double() * torch.nn.functional.silu(z.double())).unflatten(-1, (3, 32))
    want = torch.rsqrt(h.square().mean(-1) + 1e-6)
    assert rstd.shape == (2, 3, 3) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd.double(), want, rtol=1e-6, atol=0)
    _, rstd = torch.ops.torch_ln.gated_rms_norm_fwd(x, z, [96], None, 1e-6)
    assert rstd.shape == (2, 3, 1)  # ungrouped: aten's statistics shape


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input_and_gate(device):
    """x read through its strides (a column slice), the gate made contiguous: as the contiguous call, bitwise."""
    base = torch.randn(8, 160, device=device)
    x, z = base[:, :96], torch.randn(8, 192, device=device)[:, ::2]
    got = torch_ln.gated_rms_norm(x, z, 96, None, group_size=32, gate_position="before")
    want = torch_ln.gated_rms_norm(x.contiguous(), z.contiguous(), 96, None, group_size=32, gate_position="before")
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_and_batch_invariant(device):
    """A row's output and gradients depend on that row only: the same bits alone and in a batch, run to run."""
    x, z, w, dy = gated_inputs(64, 256, torch.bfloat16, torch.bfloat16, with_gate=True, device=device)
    options = {"group_size": 64, "gate_position": "before", "round_normalized": True}
    full = torch_ln.gated_rms_norm(x, z, 256, w, **options)
    assert torch.equal(full, torch_ln.gated_rms_norm(x, z, 256, w, **options))
    assert torch.equal(full[5:6], torch_ln.gated_rms_norm(x[5:6], z[5:6], 256, w, **options))
    grads = [_run(lambda x, z, w: torch_ln.gated_rms_norm(x, z, 256, w, **options), x, z, w, dy) for _ in range(2)]
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


ERRORS = [
    ({"gate": torch.randn(4, 32)}, "expected gate to have input's shape"),
    ({"gate": torch.randn(4, 64, dtype=torch.float64)}, "expected gate of dtype Float"),
    ({"gate_position": "inside"}, "expected gate_position 'before' or 'after', but got gate_position='inside'"),
    ({"activation": "gelu"}, "expected activation 'silu' or 'sigmoid', but got activation='gelu'"),
    (
        {"group_size": 24},
        "expected group_size to be a positive divisor of the normalized size 64, but got group_size=24",
    ),
    ({"group_size": 0}, "but got group_size=0"),
    ({"weight": torch.ones(32)}, "weight"),
]


@pytest.mark.parametrize(("change", "message"), ERRORS)
def test_errors_name_the_argument(change, message):
    args = {"gate": torch.randn(4, 64), "weight": torch.ones(64), **change}
    options = {k: v for k, v in args.items() if k not in ("gate", "weight")}
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        torch_ln.gated_rms_norm(torch.randn(4, 64), args["gate"], 64, args["weight"], **options)


def test_meta_input_takes_the_fake_kernel():
    """Shapes without data (the fake kernel: what torch.compile and export trace through), rstd a value per group."""
    x = torch.randn(2, 3, 8, device="meta")
    y, rstd = torch.ops.torch_ln.gated_rms_norm_fwd(x, x, [8], None, None, "before", "silu", 4, False)
    assert (y.shape, y.device, rstd.shape, rstd.dtype) == (x.shape, x.device, (2, 3, 2), torch.float32)


@pytest.mark.parametrize(
    ("gate_position", "activation", "group_size"), [("before", "silu", 4), ("after", "sigmoid", None)]
)
def test_gradcheck_float64(gate_position, activation, group_size):
    """Gradients (first and second order, the latter through the torch-ops reference) by finite differences."""
    g = torch.Generator().manual_seed(1)
    x, z = (torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = (1 + 0.3 * torch.randn(8, generator=g, dtype=torch.float64)).requires_grad_()
    options = {"gate_position": gate_position, "activation": activation, "group_size": group_size}

    def fn(x, z, w):
        return torch_ln.gated_rms_norm(x, z, 8, w, 1e-5, **options)

    assert torch.autograd.gradcheck(fn, (x, z, w))
    assert torch.autograd.gradgradcheck(fn, (x, z, w))


@pytest.mark.parametrize("group_size", [None, 16])
def test_opcheck(group_size):
    x, z, w, _ = gated_inputs(4, 64, torch.float32, torch.float32, with_gate=True)
    args = (x.requires_grad_(), z.requires_grad_(), [64], w.requires_grad_(), 1e-6, "before", "silu", group_size)
    torch.library.opcheck(torch.ops.torch_ln.gated_rms_norm_fwd.default, args)


def test_module_state_dict_and_compile_fullgraph():
    """GatedRMSNorm keeps nn.RMSNorm's constructor and state_dict; compiled with fullgraph (a graph break raises),
    forward and backward equal eager."""
    norm = torch_ln.GatedRMSNorm(64, eps=1e-6, gate_position="before", group_size=16)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert norm.state_dict().keys() == torch.nn.RMSNorm(64).state_dict().keys()
    assert "group_size=16" in repr(norm)
    x, z, _, dy = gated_inputs(6, 64, torch.float32, None, with_gate=True)
    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True, dynamic=True)
    for module in (norm, compiled):
        xs, zs = x.clone().requires_grad_(), z.clone().requires_grad_()
        y = module(xs, zs)
        y.backward(dy)
        if module is norm:
            want = (y.detach(), xs.grad, zs.grad)
        else:
            torch.testing.assert_close((y.detach(), xs.grad, zs.grad), want, atol=0, rtol=0)


# ---- replace_norms on transformers' gated classes ----

pinned = pytest.mark.skipif(transformers.__version__ != "5.23.0", reason="the pinned transformers' classes")


def _gated_modules(model):
    return [m for m in model.modules() if "RMSNormGated" in type(m).__name__]


@pinned
@pytest.mark.parametrize("name", list(GATED_MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_swapped_logits_and_gradients(name, dtype):
    """Every gated norm of the model swapped; logits and every parameter's gradient equal the unswapped model's
    within the tolerance table of the model's dtype (in bfloat16: the classes' roundings, which the swap follows,
    where the statistics agree, else a rounding flip of an ulp propagated through two layers; Mamba2's scan hands
    its norm float32 input with a bfloat16 gate, which the swap converts exactly, as the class does)."""
    torch.manual_seed(0)
    model, inputs = GATED_MODELS[name]()
    model = model.to(dtype).eval()
    with torch.no_grad():  # norm weights as trained ones look, so a wrong weight path shows
        for m in _gated_modules(model):
            m.weight.add_(0.3 * torch.randn_like(m.weight))
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    norms = _gated_modules(swapped)
    assert norms and all(type(m).__name__ == GATED_CLASSES[name] for m in norms)
    assert all(torch_ln.modules._SUFFIX in type(m).__qualname__ for m in norms), [type(m) for m in norms]
    results = []
    for m in (model, swapped):
        out = m(**inputs)
        logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
        grad_out = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2)).to(logits.dtype)
        logits.backward(grad_out)
        results.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = results
    assert_close_to_torch("y", got, want, dtype, rows=1)
    assert got_grads.keys() == want_grads.keys()
    batch = math.prod(want.shape[:-1])
    for param, grad in want_grads.items():
        assert_close_to_torch(param, got_grads[param], grad, dtype, rows=batch)


@pinned
@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weight_dtype", ["input", torch.float32])
@pytest.mark.parametrize("device", DEVICES)
def test_swapped_class_matches_the_class(name, dtype, weight_dtype, device):
    """Each gated class swapped: its output dtype, and output and gradients by the tolerance table and the accuracy
    rule against the class itself (torch's arithmetic, whose roundings the swap follows) and float64."""
    constructor, form = CLASSES[name]
    norm = gated_class(name)(**constructor, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(3)))
    norm = norm.to(device, dtype if weight_dtype == "input" else weight_dtype)
    swapped = torch_ln.replace_norms(copy.deepcopy(norm))
    assert type(swapped) is not type(norm) and isinstance(swapped, type(norm))
    x, z, _, dy = gated_inputs(40, norm.weight.shape[0], dtype, None, with_gate=True, device=device)
    gates = [z, None] if gated_class(name).__name__ in OPTIONAL_GATE else [z]
    for gate in gates:

        def module_call(module):
            return lambda x, z, weight: torch.func.functional_call(module, {"weight": weight}, (x, z))

        w = norm.weight.detach()
        got, want = (_run(module_call(m), x, gate, w, dy) for m in (swapped, norm))
        ref64 = _run(lambda x, z, w: reference.gated_rms_norm(x, z, w, 1e-6, **form), x, gate, w, dy, torch.float64)
        assert got["y"].dtype == want["y"].dtype
        for key in got:
            kind = "y" if key == "y" else GRAD_KIND[key]
            assert_close_to_torch(kind, got[key], want[key], dtype, 40)
            assert_accuracy(key, got[key], want[key], ref64[key], dtype, 40)


# Qwen4Exp's indexed attention does not compile with fullgraph with or without the swap (a data-dependent size in
# its top-k selection, checked 2026-12-05 on transformers 5.23.0): its gated norm is Qwen3-Next's, compiled here in
# the four models of that form.
COMPILED_MODELS = [name for name in GATED_MODELS if name != "qwen4_exp"]


@pinned
@pytest.mark.parametrize("name", COMPILED_MODELS)
def test_tiny_model_compiles_fullgraph(name):
    """torch.compile(fullgraph=True) of the swapped model: no graph breaks (fullgraph raises on one), a gated
    operator in the graph for every gated norm, and the compiled logits equal the eager ones within the float32
    tolerance table (not bitwise: on torch 2.11, dynamo's graph of the gated-DeltaNet models' own torch code moves
    their logits by an ulp, 1.2e-7, unswapped as swapped; the gated operator is deterministic)."""
    torch.manual_seed(0)
    model, inputs = GATED_MODELS[name]()
    swapped = torch_ln.replace_norms(model.eval())
    torch._dynamo.reset()
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(swapped, fullgraph=True, backend=backend)
    with torch.no_grad():
        inputs = {**inputs, "use_cache": False}
        got, want = compiled(**inputs), swapped(**inputs)
    gated_ops = sum("torch_ln.gated_rms_norm_fwd" in target for target in targets)
    assert gated_ops == len(_gated_modules(swapped)) > 0, targets
    key = "logits" if hasattr(want, "logits") else "last_hidden_state"
    assert_close_to_torch("y", getattr(got, key), getattr(want, key), torch.float32, rows=1)


def test_backward_checks_rstd_per_group():
    """The backward's statistics: an entry per row and group; a wrong count is named."""
    x, z, w, dy = gated_inputs(4, 96, torch.float32, torch.float32, with_gate=True)
    _, rstd = torch.ops.torch_ln.gated_rms_norm_fwd(x, z, [96], w, 1e-6, "before", "silu", 32)
    with pytest.raises(ValueError, match=r"expected rstd to have an entry per row and group \(12\).*rstd.numel\(\)=4"):
        torch.ops.torch_ln.gated_rms_norm_bwd(dy, x, z, [96], rstd[:, :1], w, [True, True, True], "before", "silu", 32)
