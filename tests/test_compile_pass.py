"""torch_ln.compile: the backend that rewrites a captured graph to torch_ln's operators, without replace_norms.

The yardstick is the module swap: a model compiled with the pass computes what the same model swapped by
replace_norms computes, compiled with the same inner backend, because both run the same kernels with the same
rounding options. Logits and gradients are compared bitwise in float32. In bfloat16 the logits are bitwise too; the
gradients differ where the fused add rounds d(residual_out) + dx once and autograd of the separate add rounds them
twice, so there they are held to the project's bfloat16 tolerance table (and bitwise with the fused add excluded).
Most tests use the aot_eager inner backend (autograd traced as with Inductor, no code generation: seconds per
model); one runs Inductor with dynamic shapes.
"""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from norm_cases import assert_close_to_torch
from torch import nn

import torch_ln
import torch_ln.compile
from torch_ln.integrations import tiny_llama_config


def _causal_lm(config_cls, model_cls, **extra):
    config = tiny_llama_config(config_cls, **extra)
    return model_cls(config), {"input_ids": torch.randint(0, config.vocab_size, (2, 12))}


def _t5():
    config = transformers.T5Config(vocab_size=97, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4)
    ids = torch.randint(0, 97, (2, 12))
    return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "decoder_input_ids": ids}


# (builder, the rewrites expected in the training graph: norms of two layers and the final norm, the adds before
# every norm but the first)
MODELS = {
    "llama": (
        lambda: _causal_lm(transformers.LlamaConfig, transformers.LlamaForCausalLM),
        {"decomposed_rms_norm": 5, "add_norm": 4},
    ),
    "qwen2": (
        lambda: _causal_lm(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        {"decomposed_rms_norm": 5, "add_norm": 4},
    ),
    "gemma": (
        lambda: _causal_lm(transformers.GemmaConfig, transformers.GemmaForCausalLM, head_dim=16),
        {"decomposed_rms_norm": 5, "add_norm": 4},
    ),
    # Encoder: 2 layers x 2 norms + final; decoder: 2 x 3 + final. The first norm of each stack has no add.
    "t5": (_t5, {"decomposed_rms_norm": 12, "add_norm": 10}),
    # A decomposed LayerNorm, one per layer (attention and MLP in parallel) and a final one; the sum of the residual
    # and both branches feeds the next norm.
    "cohere": (
        lambda: _causal_lm(transformers.CohereConfig, transformers.CohereForCausalLM),
        {"decomposed_layer_norm": 3, "add_norm": 2},
    ),
}


def _build(name, dtype):
    torch.manual_seed(0)
    model, inputs = MODELS[name][0]()
    model = model.to(dtype).eval()  # no dropout; gradients are still taken
    with torch.no_grad():  # norm weights as trained ones look, so a wrong weight path shows
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.3 * torch.randn_like(param))
    return model, inputs


def _counting(inner="aot_eager", **options):
    """The pass as a backend, and the counts of what it rewrote (summed over the graphs it compiled)."""
    counts: collections.Counter[str] = collections.Counter()

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        for key, n in torch_ln.compile.rewrite(gm, **options).items():
            counts[key.split(" ")[0]] += n
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)

    return backend, counts


def _step(model, inputs, grad_out, backend, dynamic=None):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    model.zero_grad(set_to_none=True)
    logits = compiled(**inputs, use_cache=False).logits
    logits.backward(grad_out)
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _compare(name, dtype, options=(), bitwise_grads=True, inner="aot_eager", dynamic=None):
    model, inputs = _build(name, dtype)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    backend, counts = _counting(inner, exclude=options)
    grad_out = torch.randn(*inputs["input_ids"].shape, model.config.vocab_size).to(dtype)
    got, got_grads = _step(model, inputs, grad_out, backend, dynamic)
    want, want_grads = _step(swapped, inputs, grad_out, inner, dynamic)
    assert torch.equal(got, want), f"logits differ by {(got - want).abs().max()}"
    assert got_grads.keys() == want_grads.keys()
    rows = math.prod(got.shape[:-1])
    for param, grad in want_grads.items():
        if bitwise_grads:
            assert torch.equal(got_grads[param], grad), param
        else:
            assert_close_to_torch(param, got_grads[param], grad, dtype, rows=rows)
    return counts


@pytest.mark.parametrize("name", list(MODELS))
def test_model_float32_equals_the_swapped_model_bitwise(name):
    counts = _compare(name, torch.float32)
    assert counts["graphs"] == 1
    assert {k: counts[k] for k in MODELS[name][1]} == MODELS[name][1], counts


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_model_bfloat16(name):
    """Norms alone: bitwise. With the fused add: the logits bitwise (its forward is the plain norm of the sum, bit
    for bit), the gradients by the bfloat16 tolerance table (one rounding of d(residual_out) + dx instead of two)."""
    counts = _compare(name, torch.bfloat16, options=["add_norm"])
    assert counts["add_norm"] == 0 and counts["decomposed_rms_norm"] == 5
    counts = _compare(name, torch.bfloat16, bitwise_grads=False)
    assert counts["add_norm"] == 4


def test_inductor_fullgraph_dynamic():
    """Inductor with dynamic shapes (the model's float eps becomes a graph input, read as a SymFloat): two sequence
    lengths, the swapped model's results bit for bit, every graph Dynamo made rewritten."""
    model, inputs = _build("llama", torch.float32)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    backend, counts = _counting("inductor")
    torch._dynamo.reset()
    ours = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    theirs = torch.compile(swapped, fullgraph=True, dynamic=True)
    for length in (12, 7):
        ids = inputs["input_ids"][:, :length]
        with torch.no_grad():
            assert torch.equal(ours(input_ids=ids, use_cache=False).logits, theirs(input_ids=ids).logits)
    assert counts["graphs"] >= 1
    assert counts["decomposed_rms_norm"] == 5 * counts["graphs"] and counts["add_norm"] == 4 * counts["graphs"]


# The transformers norm classes whose forms the pass matches, each with the form it reports.
HF_NORMS = [
    pytest.param("llama.modeling_llama.LlamaRMSNorm", "llama", id="llama"),
    pytest.param("gemma.modeling_gemma.GemmaRMSNorm", "gemma", id="gemma"),
    pytest.param("t5.modeling_t5.T5LayerNorm", "llama", id="t5"),  # T5's rounding is Llama's in one dtype
    pytest.param("cohere.modeling_cohere.CohereLayerNorm", "float32 product", id="cohere"),
    pytest.param("gemma3n.modeling_gemma3n.Gemma3nRMSNorm", "float32 product", id="gemma3n"),  # pow(-0.5)
]


@pytest.mark.parametrize("path, form", HF_NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_classes_match_their_swap(path, form, dtype):
    """Each class the module swap knows, compiled with the pass: the swapped module's output and gradients, bit for
    bit, with the form the swap uses for it."""
    module_path, name = path.rsplit(".", 1)
    cls = getattr(__import__(f"transformers.models.{module_path}", fromlist=[name]), name)
    torch.manual_seed(0)
    module = cls(48).to(dtype)
    with torch.no_grad():
        module.weight.add_(0.3 * torch.randn_like(module.weight))
    swapped = torch_ln.replace_norms(copy.deepcopy(module))
    rewrites = collections.Counter()

    def backend(gm, example_inputs):
        rewrites.update(torch_ln.compile.rewrite(gm))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    x, grad_out = torch.randn(5, 48).to(dtype), torch.randn(5, 48).to(dtype)
    runs = []
    for fn, m in ((compiled, module), (swapped, swapped)):
        xl = x.clone().requires_grad_()
        m.weight.grad = None
        y = fn(xl)
        y.backward(grad_out)
        runs.append((y.detach(), xl.grad, m.weight.grad))
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)
    pattern = "decomposed_layer_norm" if name == "CohereLayerNorm" else "decomposed_rms_norm"
    if dtype == torch.float32 and form == "llama":  # in float32 the rounding to the input's dtype is no step
        form = "float32 product"
    assert rewrites == {f"{pattern} ({form})": 1}


def test_backend_logs_and_excludes(caplog, capsys):
    model, inputs = _build("llama", torch.float32)
    torch._dynamo.reset()
    backend = torch_ln.compile.backend("aot_eager", exclude=["add_norm"], verbose=True)
    with caplog.at_level("INFO", logger="torch_ln"), torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(**inputs, use_cache=False)
    printed = capsys.readouterr().out
    assert "torch_ln.compile: rewrote decomposed_rms_norm (float32 product) x5" in printed
    assert "add_norm" not in printed and "decomposed_rms_norm" in caplog.text


def test_unknown_pattern_is_refused():
    with pytest.raises(ValueError, match=r"expected exclude to name patterns of .*'add_norm'.*but got \['add_nrom'\]"):
        torch_ln.compile.backend(exclude=["add_nrom"])


# --------------------------------------------------------------------------------------
# User code: inline norms, torch's functional norms, and what must not match.
# --------------------------------------------------------------------------------------


def _rewritten(fn, *args, **options):
    """fn compiled with the pass (aot_eager), its outputs, and the rewrite counts."""
    backend, counts = _counting(**options)
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)(*args), counts


def test_user_inline_rms_norm():
    """A user's own RMSNorm, with a weight: torch_ln.rms_norm of the same input, and its gradients."""
    weight = torch.randn(24, requires_grad=True)

    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    x = torch.randn(5, 24, requires_grad=True)
    y, counts = _rewritten(norm, x)
    assert counts == {"graphs": 1, "decomposed_rms_norm": 1}
    expected = torch_ln.rms_norm(x, (24,), weight, 1e-6)
    assert torch.equal(y, expected)
    grads = torch.autograd.grad(y.sum(), (x, weight))
    for a, b in zip(grads, torch.autograd.grad(expected.sum(), (x, weight))):
        assert torch.equal(a, b)


def test_functional_norms_and_their_adds():
    """F.layer_norm (an nn.LayerNorm, inlined) and F.rms_norm become torch_ln's, and the add before each the fused
    op, whose residual_out serves the sum's later use."""
    ln, rms = nn.LayerNorm(16), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_(), rms.weight.normal_()

    def block(x, residual):
        h = x + residual
        h2 = F.gelu(ln(h)) + h
        return rms(h2) * 2 + h2

    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    y, counts = _rewritten(block, x, residual)
    assert counts == {"graphs": 1, "layer_norm": 1, "rms_norm": 1, "add_norm": 2}
    swapped_ln, swapped_rms = torch_ln.replace_norms(copy.deepcopy(ln)), torch_ln.replace_norms(copy.deepcopy(rms))
    h = x + residual
    h2 = F.gelu(swapped_ln(h)) + h
    assert torch.equal(y, swapped_rms(h2) * 2 + h2)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_float32_residual_stream(norm):
    """bfloat16 activations added to a float32 residual stream, the float32 norm's output rounded back to bfloat16:
    the fused op with residual_dtype=float32. residual_out is the float32 sum bit for bit; y rounds once where the
    graph rounded twice (float32, then bfloat16), so it may differ by one bfloat16 ulp where the float32 value fell
    on a tie."""
    weight = torch.randn(32)

    def block(x, residual):
        h = x + residual
        y = F.layer_norm(h, (32,), weight) if norm == "layer_norm" else F.rms_norm(h, (32,), weight, 1e-6)
        return y.to(x.dtype), h

    x, residual = torch.randn(6, 32).bfloat16(), torch.randn(6, 32)
    (y, h), counts = _rewritten(block, x, residual)
    assert counts == {"graphs": 1, norm: 1, "add_norm": 1}
    want_y, want_h = block(x, residual)
    assert y.dtype == torch.bfloat16 and torch.equal(h, want_h)
    torch.testing.assert_close(y, want_y, rtol=2**-7, atol=0)


def test_a_swapped_model_gets_the_fused_add():
    """torch_ln's own norms already in the graph (replace_norms) take the fused add as well."""
    model, inputs = _build("llama", torch.float32)
    swapped = torch_ln.replace_norms(model)
    backend, counts = _counting()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(swapped, backend=backend, fullgraph=True)(**inputs, use_cache=False)
    assert counts == {"graphs": 1, "add_norm": 4}


def _not_trailing(x):
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)  # over dim 1 of 3: not the rows


def _no_keepdim(x):
    return x * torch.rsqrt(x.pow(2).mean(-1).unsqueeze(-1) + 1e-6)


def _eps_tensor(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.full_like(x[..., :1], 1e-6))  # an eps per row


def _other_input(x):
    y = x.flip(-1)
    return y * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # statistics of x, applied to another tensor


def _add_not_normalized(x):
    h = x + x.flip(0)
    return h * 2, F.layer_norm(x, (8,))  # the sum is not what is normalized


def _float64(x):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # computed in float64: not the kernels' float32


@pytest.mark.parametrize(
    "fn, expected",
    [
        (_not_trailing, {}),
        (_no_keepdim, {}),
        (_eps_tensor, {}),
        (_other_input, {}),
        (_add_not_normalized, {"layer_norm": 1}),
        (_float64, {}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_patterns_that_must_not_match(fn, expected):
    x = torch.randn(4, 3, 8)
    y, counts = _rewritten(fn, x)
    assert dict(counts) == {"graphs": 1, **expected}
    ref = fn(x)
    for a, b in zip(y if isinstance(y, tuple) else (y,), ref if isinstance(ref, tuple) else (ref,)):
        torch.testing.assert_close(a, b)


def test_rewrite_of_an_exported_graph():
    """rewrite() on the ATen graph of torch.export (nodes carry 'val', ops are aten's), then export again: the
    program holds torch_ln's operator and computes what torch_ln does."""
    weight = torch.randn(8)

    class Norm(nn.Module):
        def forward(self, x):
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
            return weight * normed.to(x.dtype)

    x = torch.randn(4, 8)
    gm = torch.export.export(Norm(), (x,)).module()
    counts = torch_ln.compile.rewrite(gm)
    assert counts == {"decomposed_rms_norm (float32 product)": 1}, counts
    program = torch.export.export(gm, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "torch_ln.rms_norm_fwd.default" in targets
    assert torch.equal(program.module()(x), torch_ln.rms_norm(x, (8,), weight, 1e-6))


def test_refused_rewrite_leaves_the_graph_as_it_was():
    """F.layer_norm of bfloat16 input with a float16 weight (which the kernels would take converted to float32) and
    a float16 bias (which they cannot take): the rewrite is refused, the graph unchanged, the weight's conversion
    never inserted. (Traced only: torch's own kernels refuse these dtypes when run.)"""

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, dtype=torch.float16))
            self.bias = nn.Parameter(torch.randn(8, dtype=torch.float16))

        def forward(self, x):
            return F.layer_norm(x, (8,), self.weight, self.bias)

    gm = torch.export.export(Norm(), (torch.randn(4, 8, dtype=torch.bfloat16),)).module()
    nodes = len(gm.graph.nodes)
    assert torch_ln.compile.rewrite(gm) == {}
    assert len(gm.graph.nodes) == nodes, [n.format_node() for n in gm.graph.nodes]


def test_rewrite_of_a_decomposed_exported_layer_norm():
    """After export's decompositions LayerNorm is aten.native_layer_norm (y, mean, rstd); with only y used it becomes
    torch_ln's layer_norm."""
    norm = nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = torch.randn(4, 8)
    gm = torch.export.export(norm, (x,)).run_decompositions().module()
    assert any(n.target is torch.ops.aten.native_layer_norm.default for n in gm.graph.nodes)
    assert torch_ln.compile.rewrite(gm) == {"layer_norm": 1}
    assert torch.equal(gm(x), torch_ln.layer_norm(x, (8,), norm.weight, norm.bias))
