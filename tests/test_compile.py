"""torch_ln under torch.compile and torch.export: no graph breaks, eager results."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from norm_cases import DEVICES
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import torch_ln

# Compiled code may fuse the Linear layers' epilogues differently from eager: float32
# results agree to a few ulps times the depth of the model.
ATOL = RTOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


class _Model(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear -> RMSNorm (default eps) -> LayerNorm without bias."""

    def __init__(self, dim: int = 24, hidden: int = 40):
        super().__init__()
        self.inp = nn.Linear(dim, hidden)
        self.ln = torch_ln.LayerNorm(hidden)
        self.out = nn.Linear(hidden, dim)
        self.rms = torch_ln.RMSNorm(dim)
        self.ln_nobias = torch_ln.LayerNorm(dim, bias=False)
        with torch.no_grad():
            for p in (self.ln.weight, self.rms.weight, self.ln_nobias.weight):
                p.normal_(1, 0.3)
            self.ln.bias.normal_()

    def forward(self, x):
        return self.ln_nobias(self.rms(self.out(torch.nn.functional.gelu(self.ln(self.inp(x))))))


def _forward_backward(model, x, grad_out):
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(grad_out)
    # A compiled module holds the model as _orig_mod: the same parameters under a prefix.
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return {"y": y.detach(), "dx": x.grad, **grads}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, expected in want.items():
        torch.testing.assert_close(got[name], expected, atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic(device):
    """fullgraph=True (a graph break raises), dynamic=True; eager results for several batch sizes."""
    model = _Model().to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="inductor")
    for batch in (1, 3, 8):
        x = torch.randn(batch, 5, 24, device=device)
        grad_out = torch.randn(batch, 5, 24, device=device)
        _assert_same(_forward_backward(compiled, x, grad_out), _forward_backward(model, x, grad_out))


def test_compile_no_graph_breaks():
    model = _Model()
    explanation = torch._dynamo.explain(model)(torch.randn(3, 5, 24))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(model, dynamic=True, backend="eager")
    compiled(torch.randn(2, 5, 24)).sum().backward()
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("norm_name", ["layer_norm", "rms_norm"])
def test_compile_functional_dynamic_feature_dim(norm_name):
    """The functionals compiled with dynamic shapes in every dim (rows and D), including M=1."""
    fn = getattr(torch_ln, norm_name)

    def f(x, w):
        return fn(x, (x.shape[-1],), w)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="inductor")
    for rows, d in [(4, 16), (1, 33), (7, 65)]:
        x = torch.randn(rows, d)
        w = torch.randn(d)
        torch.testing.assert_close(compiled(x, w), f(x, w), atol=ATOL, rtol=RTOL)


def test_compiled_backward_uses_the_bwd_kernel():
    """The compiled backward graph calls torch_ln's bwd operators (not a decomposed
    reference), and the forward graph its fwd operators."""
    graphs = {}

    def capture(kind):
        def compiler(gm, _inputs):
            graphs[kind] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    model = _Model()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    compiled(torch.randn(3, 5, 24, requires_grad=True)).sum().backward()
    assert {"torch_ln.layer_norm_fwd.default", "torch_ln.rms_norm_fwd.default"} <= graphs["fw"], graphs["fw"]
    assert {"torch_ln.layer_norm_bwd.default", "torch_ln.rms_norm_bwd.default"} <= graphs["bw"], graphs["bw"]


def test_export_dynamic_batch():
    model = _Model().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    x = torch.randn(4, 5, 24)
    exported = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch}})
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert {"torch_ln.layer_norm_fwd.default", "torch_ln.rms_norm_fwd.default"} <= targets, targets
    runnable = exported.module()
    with torch.no_grad():
        for rows in (1, 4, 9):
            x = torch.randn(rows, 5, 24)
            torch.testing.assert_close(runnable(x), model(x), atol=ATOL, rtol=RTOL)
