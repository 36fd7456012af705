"""torch_ln in real transformers and timm models (tiny configs, random init, nothing downloaded), and the
rounding options that reproduce their norm classes (torch_ln.integrations)."""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
from norm_cases import assert_accuracy, assert_close_to_torch
from torch import nn

import torch_ln
from torch_ln import integrations, reference
from torch_ln.integrations import tiny_llama_config
from torch_ln.modules import _is_torch_ln

transformers = pytest.importorskip("transformers", reason="the transformers tests need transformers (pip install)")
timm = pytest.importorskip("timm", reason="the timm tests need timm (pip install)")

from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

REDUCED = [torch.bfloat16, torch.float16]


def _ulps(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """|ours - theirs| in units in the last place of theirs (its dtype's spacing at |theirs|)."""
    finfo = torch.finfo(theirs.dtype)
    exponent = torch.floor(torch.log2(theirs.double().abs().clamp_min(finfo.tiny)))
    spacing = torch.exp2(exponent - (finfo.nmant if hasattr(finfo, "nmant") else _MANTISSA[theirs.dtype]))
    return ((ours.double() - theirs.double()).abs() / spacing).round()


_MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def _histogram(ulps: torch.Tensor) -> dict[int, int]:
    return dict(sorted(collections.Counter(int(u) for u in ulps.flatten().tolist()).items()))


def _hf_module(cls, dtype, d, weight_scale):
    module = cls(d).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight_scale(torch.randn(d)))
    return module


# The HF classes torch_ln reproduces, with weights as trained ones look (Llama's around 1, Gemma's around 0).
MODULE_CASES = [
    pytest.param(LlamaRMSNorm, lambda w: 1 + 0.3 * w, id="llama"),
    pytest.param(GemmaRMSNorm, lambda w: 0.3 * w, id="gemma"),
    pytest.param(T5LayerNorm, lambda w: 1 + 0.3 * w, id="t5"),
    pytest.param(CohereLayerNorm, lambda w: 1 + 0.3 * w, id="cohere"),
    pytest.param(Gemma3nRMSNorm, lambda w: 1 + 0.3 * w, id="gemma3n"),
]

# M=1: a single row; D=4099 (prime): the scalar tails of every kernel loop; D=64: the usual vector path.
SHAPES = [(1, 64), (37, 64), (8, 4099)]


def _swapped(module: nn.Module) -> nn.Module:
    swapped = torch_ln.replace_norms(copy.deepcopy(module))
    assert _is_torch_ln(swapped) and isinstance(swapped, type(module)), type(swapped)
    return swapped


def _rstd_of(x: torch.Tensor, eps: float, centered: bool, power: bool = False) -> torch.Tensor:
    """HF's own statistics, as the classes compute them (float32); `power`: Gemma3n's pow(mean + eps, -0.5)."""
    h = x.float()
    if centered:
        h = h - h.mean(-1, keepdim=True)
    mean = h.pow(2).mean(-1, keepdim=True) + eps
    return torch.pow(mean, -0.5) if power else torch.rsqrt(mean)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, *REDUCED])
@pytest.mark.parametrize("cls, weight_scale", MODULE_CASES)
def test_module_output_bitwise_where_statistics_agree(cls, weight_scale, dtype, shape):
    """The swapped module's output equals the HF module's bit for bit in every row whose rstd it computes
    identically. The only other difference is the summation order of mean(x^2) (torch's vectorized cascade
    vs torch_ln's): the sums differ by about an ulp, which after the division, eps, sqrt and reciprocal
    leaves rstd at most 2 ulps of float32 apart (measured over 2000 rows at D = 64, 768, 4099: 0 ulps in
    ~78%, 1 in ~21%, 2 in <1%). y = x * rstd * w then differs by at most 4 float32 ulps (rstd's 2, and a
    rounding flip in each product), and in half/bfloat16, where 2^-22 is far below an ulp, by rounding
    flips: 1 ulp, 2 where Llama's two roundings both flip. The ulp histograms are printed (pytest -s)."""
    torch.manual_seed(0)
    module = _hf_module(cls, dtype, shape[-1], weight_scale)
    x = (3 * torch.randn(shape) + 0.5).to(dtype)
    want, got = module(x), _swapped(module)(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    centered = cls is CohereLayerNorm
    if centered:
        _, _, rstd = torch.ops.torch_ln.layer_norm_fwd(x, [shape[-1]], None, None, eps)
    else:
        _, rstd = torch.ops.torch_ln.rms_norm_fwd(x, [shape[-1]], None, eps)
    hf_rstd = _rstd_of(x, eps, centered, power=cls is Gemma3nRMSNorm).view(-1)
    assert _ulps(rstd.view(-1), hf_rstd).max() <= 2
    same_stats = (rstd.view(-1) == hf_rstd).view(-1, 1).expand(shape)
    if centered:
        # Cohere's mean differs in summation order too, and x - mean cancels, so ulps of y say nothing near the
        # mean: the tolerance table and the accuracy rule against float64 instead.
        ref64 = reference.layer_norm(x.double(), shape[-1:], module.weight.double(), None, eps)
        assert_close_to_torch("y", got, want, dtype, rows=shape[0])
        assert_accuracy("y", got, want, ref64, dtype, rows=shape[0])
        return
    assert torch.equal(got[same_stats], want[same_stats]), "rows with identical rstd differ"
    ulps = _ulps(got, want)
    print(f"\n{cls.__name__} {dtype} {shape}: ulp histogram {_histogram(ulps)}")
    assert ulps.max() <= (4 if dtype == torch.float32 else 2), _histogram(ulps)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, *REDUCED])
@pytest.mark.parametrize("cls, weight_scale", MODULE_CASES)
def test_module_gradients_match_hf_autograd(cls, weight_scale, dtype, shape):
    """dx and dweight against autograd of the HF module: the project's tolerance table, and the accuracy rule
    against a float64 reference of the same function (torch_ln at most 2x the HF module's error)."""
    torch.manual_seed(1)
    module = _hf_module(cls, dtype, shape[-1], weight_scale)
    swapped = _swapped(module)
    base = (3 * torch.randn(shape) + 0.5).to(dtype)
    grad_out = torch.randn(shape).to(dtype)
    results = []
    for m in (swapped, module):
        x = base.clone().requires_grad_()
        m.weight.grad = None
        m(x).backward(grad_out)
        results.append({"dx": x.grad, "dweight": m.weight.grad.clone()})
    ref = _reference64(cls, module, base, grad_out)
    for name in ("dx", "dweight"):
        assert results[0][name].dtype == results[1][name].dtype
        assert_close_to_torch(name, results[0][name], results[1][name], dtype, rows=shape[0])
        assert_accuracy(name, results[0][name], results[1][name], ref[name], dtype, rows=shape[0])


def _reference64(cls, module, base, grad_out) -> dict:
    """The exact gradients of the class's function (no intermediate rounding), in float64."""
    x = base.double().requires_grad_()
    w = module.weight.detach().double().requires_grad_()
    if cls is CohereLayerNorm:
        y = reference.layer_norm(x, w.shape, w, None, module.variance_epsilon)
    else:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        y = reference.rms_norm(x, w.shape, w, eps, weight_offset=1.0 if cls is GemmaRMSNorm else 0.0)
    y.backward(grad_out.double())
    return {"dx": x.grad, "dweight": w.grad}


@pytest.mark.parametrize(
    "weight_dtype, input_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("cls, weight_scale", MODULE_CASES)
def test_module_mixed_dtypes_bitwise(cls, weight_scale, weight_dtype, input_dtype):
    """Weight and input of different dtypes (a float32 weight with bfloat16 activations under autocast):
    the output dtype follows the class's type promotion, and the values are the class's bit for bit where
    the statistics agree (the bound is the one of the test above)."""
    torch.manual_seed(2)
    module = _hf_module(cls, weight_dtype, 64, weight_scale)
    x = (3 * torch.randn(16, 64)).to(input_dtype)
    want, got = module(x), _swapped(module)(x)
    assert got.dtype == want.dtype
    if cls is CohereLayerNorm:  # x - mean cancels: see above
        assert_close_to_torch("y", got, want, input_dtype, rows=16)
        return
    ulps = _ulps(got, want)
    assert ulps.max() <= (4 if want.dtype == torch.float32 else 2), _histogram(ulps)


def test_float64_input_takes_the_class_forward():
    """All four families compute float64 input in float32; torch_ln hands it to the class's own forward."""
    module = _hf_module(LlamaRMSNorm, torch.float64, 64, lambda w: 1 + w)
    x = torch.randn(4, 64, dtype=torch.float64)
    assert torch.equal(_swapped(module)(x), module(x))


def test_cohere_per_head_weight():
    """CohereLayerNorm with a [heads, head_dim] weight (QK-norm): each head's row normalized by the kernel,
    the per-head weight applied in float32 and rounded once, as the class does."""
    torch.manual_seed(3)
    module = CohereLayerNorm((4, 16)).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(1 + 0.3 * torch.randn(4, 16))
    x = torch.randn(2, 5, 4, 16).to(torch.bfloat16).requires_grad_()
    swapped = _swapped(module)
    assert_close_to_torch("y", swapped(x), module(x), torch.bfloat16, rows=40)
    swapped(x).sum().backward()
    assert x.grad is not None and swapped.weight.grad.shape == (4, 16)


ROUNDING = [
    pytest.param({"round_normalized": True}, id="round_normalized"),
    pytest.param({"weight_offset": 1.0}, id="weight_offset"),
    pytest.param({"weight_offset": 1.0, "round_normalized": True}, id="both"),
]


@pytest.mark.parametrize("rounding", ROUNDING)
@pytest.mark.parametrize(
    "dtype, param_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
)
# M=1 and prime D (scalar tails); 1 and 5 rows: the CPU backward's column split (< 32 rows); 37 and 64 rows: its
# row chunks; D=4099: many whole steps, then a scalar tail.
@pytest.mark.parametrize("rows, cols", [(1, 1021), (5, 4099), (37, 64), (64, 2048)])
def test_rounding_options_cpu_kernels(rounding, dtype, param_dtype, rows, cols):
    """The CPU forward is the rounding model (torch_ln.reference.apply_weight on the kernel's own rstd) bit for
    bit; the backward is held to the tolerance table against autograd of that model in the input's precision,
    and to the accuracy rule against float64."""
    torch.manual_seed(4)
    x = (2 * torch.randn(rows, cols)).to(dtype)
    weight = (0.5 * torch.randn(cols)).to(param_dtype)
    y, rstd = torch.ops.torch_ln.rms_norm_fwd(x, [cols], weight, 1e-5, **rounding)
    assert torch.equal(y, reference.apply_weight(x, x.to(rstd.dtype) * rstd, weight, **rounding))
    grad_out = torch.randn(rows, cols).to(dtype)
    results = []
    for fn, cast in [(torch_ln.rms_norm, None), (reference.rms_norm, None), (reference.rms_norm, torch.float64)]:
        xl = x.detach().to(cast or dtype).requires_grad_()
        wl = weight.detach().to(cast or param_dtype).requires_grad_()
        fn(xl, (cols,), wl, 1e-5, **rounding).backward(grad_out.to(cast or dtype))
        results.append({"dx": xl.grad, "dweight": wl.grad})
    ours, model, ref64 = results
    for name in ("dx", "dweight"):
        assert_close_to_torch(name, ours[name], model[name], dtype, rows=rows)
        assert_accuracy(name, ours[name], model[name], ref64[name], dtype, rows=rows)


@pytest.mark.parametrize("rounding", ROUNDING)
def test_rounding_options_double_backward(rounding):
    """Double backward (create_graph) differentiates the reference with the same options."""
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w: torch_ln.rms_norm(x, (7,), w, 1e-5, **rounding)
    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))


def test_rms_norm_options_need_a_weight_for_the_offset():
    with pytest.raises(ValueError, match="expected a weight with weight_offset=1"):
        torch_ln.rms_norm(torch.randn(2, 8), (8,), None, weight_offset=1.0)


# ---------------------------------------------------------------------------------------
# The registry, the kernel hub, the report and patching before construction.
# ---------------------------------------------------------------------------------------


def test_unknown_module_untouched_and_reported(caplog):
    """A norm-like class nobody registered stays as it is, and the report names it."""

    class HomemadeNorm(nn.Module):
        def forward(self, x):
            return x / x.norm(dim=-1, keepdim=True)

    model = nn.Sequential(HomemadeNorm(), LlamaRMSNorm(8), nn.GroupNorm(2, 8))
    with caplog.at_level("INFO", logger="torch_ln"):
        torch_ln.replace_norms(model)
    assert type(model[0]) is HomemadeNorm and type(model[2]) is nn.GroupNorm and _is_torch_ln(model[1])
    assert "swapped LlamaRMSNorm x1" in caplog.text
    assert "not swapped (unregistered): " in caplog.text and "HomemadeNorm x1" in caplog.text
    assert "GroupNorm x1" in caplog.text


def test_register_norm_custom_class():
    """The documented way to teach replace_norms a class: register_norm with a forward_converter."""

    class ScaleNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def forward(self, x):
        return torch_ln.rms_norm(x, self.weight.shape, self.weight, 1e-6)

    torch_ln.register_norm(ScaleNorm, torch_ln.forward_converter(forward))
    module = ScaleNorm(32)
    hook_calls = []
    module.register_forward_hook(lambda *_: hook_calls.append(1))
    swapped = torch_ln.replace_norms(module)
    assert isinstance(swapped, ScaleNorm) and swapped.weight is module.weight and hook_calls == []
    x = torch.randn(4, 32)
    torch.testing.assert_close(swapped(x), module(x))
    assert hook_calls == [1, 1]
    with pytest.raises(TypeError, match="expected cls to be an nn.Module subclass"):
        torch_ln.register_norm(int, forward)


def test_kernel_hub_forward_is_replaced(monkeypatch):
    """transformers' kernel hub (use_kernel_forward_from_hub + kernelize) installs a forward on the instance,
    or replaces the class's: either way the swapped module runs torch_ln, and the class is still recognized
    by the source of its own arithmetic."""
    signature = integrations.arithmetic_signature(LlamaRMSNorm)
    module = LlamaRMSNorm(16)
    module.forward = lambda x: pytest.fail("the hub's instance forward ran")
    monkeypatch.setattr(LlamaRMSNorm, "forward", lambda self, x: pytest.fail("the hub's class forward ran"))
    assert integrations.arithmetic_signature(LlamaRMSNorm) == signature
    swapped = _swapped(module)
    assert "forward" not in swapped.__dict__
    x = torch.randn(2, 16)
    torch.testing.assert_close(swapped(x), torch_ln.rms_norm(x, (16,), module.weight, module.variance_epsilon))


def test_patch_transformers_builds_torch_ln_norms():
    config = _llama_config()
    with integrations.patch_transformers("llama") as patched:
        model = transformers.LlamaForCausalLM(config)
    assert patched == ["transformers.models.llama.modeling_llama.LlamaRMSNorm"]
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 2 * config.num_hidden_layers + 1 and all(_is_torch_ln(m) for m in norms)
    # Restored afterwards.
    assert not any(_is_torch_ln(m) for m in transformers.LlamaForCausalLM(config).modules())
    with (
        pytest.raises(ValueError, match="expected a norm class torch_ln recognizes"),
        integrations.patch_transformers("bert"),
    ):
        pass


# ---------------------------------------------------------------------------------------
# Whole models.
# ---------------------------------------------------------------------------------------


def _llama_config(cls=None, **extra):
    return tiny_llama_config(cls or transformers.LlamaConfig, **extra)


def _tokens(config):
    return {"input_ids": torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))}


def _causal_lm(config_cls, model_cls, **extra):
    config = _llama_config(config_cls, **extra)
    return lambda: (model_cls(config), _tokens(config))


def _t5():
    config = transformers.T5Config(vocab_size=97, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4)
    inputs = _tokens(config)
    return transformers.T5ForConditionalGeneration(config), {**inputs, "decoder_input_ids": inputs["input_ids"]}


def _gpt2():
    config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config), _tokens(config)


def _bert():
    config = transformers.BertConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96
    )
    return transformers.BertForMaskedLM(config), _tokens(config)


def _vit():
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96
    )
    return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


def _timm_vit(**extra):
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=10, **extra
    )
    return model, {"x": torch.randn(2, 3, 32, 32)}


def _timm_convnext(channels_last=False):
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10, depths=(1, 1, 1, 1))
    x = torch.randn(2, 3, 64, 64)
    return model, {"x": x.contiguous(memory_format=torch.channels_last) if channels_last else x}


# (model builder, the norm classes every one of whose instances must be swapped)
MODELS = {
    "llama": (_causal_lm(transformers.LlamaConfig, transformers.LlamaForCausalLM), {"LlamaRMSNorm"}),
    "qwen2": (_causal_lm(transformers.Qwen2Config, transformers.Qwen2ForCausalLM), {"Qwen2RMSNorm"}),
    "mistral": (_causal_lm(transformers.MistralConfig, transformers.MistralForCausalLM), {"MistralRMSNorm"}),
    "gemma": (_causal_lm(transformers.GemmaConfig, transformers.GemmaForCausalLM, head_dim=16), {"GemmaRMSNorm"}),
    "gemma2": (
        _causal_lm(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, head_dim=16),
        {"Gemma2RMSNorm"},
    ),
    "t5": (_t5, {"T5LayerNorm"}),
    "gpt2": (_gpt2, {"LayerNorm"}),
    "bert": (_bert, {"LayerNorm"}),
    "vit": (_vit, {"LayerNorm"}),
    "timm_vit": (_timm_vit, {"LayerNorm"}),
    "timm_vit_rms_norm": (lambda: _timm_vit(norm_layer=timm.layers.RmsNorm), {"RmsNorm"}),
    "timm_vit_layer_norm_fp32": (lambda: _timm_vit(norm_layer=timm.layers.LayerNormFp32), {"LayerNormFp32"}),
    "timm_convnext": (_timm_convnext, {"LayerNorm2d"}),
    "timm_convnext_channels_last": (lambda: _timm_convnext(channels_last=True), {"LayerNorm2d"}),
}


def _build(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    build, norm_classes = MODELS[name]
    model, inputs = build()
    model = model.to(dtype).eval()  # eval: no dropout; gradients are still taken
    with torch.no_grad():  # norm weights as trained ones look, so a wrong weight path shows
        for m in model.modules():
            if type(m).__name__ in norm_classes and getattr(m, "weight", None) is not None:
                m.weight.add_(0.3 * torch.randn_like(m.weight))
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    return model, inputs, norm_classes


def _logits(model, inputs):
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def _step(model, inputs, grad_out=None):
    logits = _logits(model, inputs)
    grad_out = torch.randn_like(logits) if grad_out is None else grad_out
    logits.backward(grad_out)
    return logits.detach(), grad_out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_swapped_logits_and_gradients_match_float32(name):
    """Every norm of the model's known classes swapped; logits and every parameter's gradient equal the
    unswapped model's within the project's float32 tolerance table."""
    model, inputs, norm_classes = _build(name, torch.float32)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    _check_all_swapped(model, swapped, norm_classes)
    want, grad_out, want_grads = _step(model, inputs)
    got, _, got_grads = _step(swapped, inputs, grad_out)
    assert_close_to_torch("y", got, want, torch.float32, rows=1)
    assert got_grads.keys() == want_grads.keys()
    batch = math.prod(want.shape[:-1])
    for param, grad in want_grads.items():
        assert_close_to_torch(param, got_grads[param], grad, torch.float32, rows=batch)


def _check_all_swapped(model, swapped, norm_classes):
    originals = dict(model.named_modules())
    found = collections.Counter()
    for path, module in swapped.named_modules():
        if type(originals[path]).__name__ in norm_classes:
            assert _is_torch_ln(module), f"{path} ({type(module).__qualname__}) was not swapped"
            assert isinstance(module, type(originals[path]))
            found[type(originals[path]).__name__] += 1
    assert set(found) == norm_classes, found


@pytest.mark.parametrize("name", ["llama", "gemma", "gemma2", "qwen2"])
def test_model_bfloat16_within_the_classes_rounding(name):
    """In bfloat16 the swapped norms round exactly as the classes do where the statistics agree; the rest
    differs by bfloat16 rounding flips (1 ulp = 2^-8 relative) in a norm, propagated through two layers,
    and the weight gradients by the classes' own per-element bfloat16 rounding of dy * x_normed: the
    project's bfloat16 tolerance table covers both."""
    model, inputs, norm_classes = _build(name, torch.bfloat16)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    _check_all_swapped(model, swapped, norm_classes)
    want, grad_out, want_grads = _step(model, inputs)
    got, _, got_grads = _step(swapped, inputs, grad_out)
    assert_close_to_torch("y", got, want, torch.bfloat16, rows=1)
    batch = math.prod(want.shape[:-1])
    for param, grad in want_grads.items():
        assert_close_to_torch(param, got_grads[param], grad, torch.bfloat16, rows=batch)


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_model_compiles_fullgraph(name):
    """torch.compile(fullgraph=True) of the swapped model: no graph breaks (fullgraph raises on one), the
    torch_ln operators in the graph, and the compiled logits equal the eager ones."""
    model, inputs, _ = _build(name, torch.float32)
    swapped = torch_ln.replace_norms(model)
    torch._dynamo.reset()
    counts = collections.Counter()

    def backend(gm, example_inputs):
        counts.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(swapped, fullgraph=True, backend=backend)
    with torch.no_grad():
        inputs = {**inputs, "use_cache": False}
        got, want = _logits(compiled, inputs), _logits(swapped, inputs)
    norm_ops = sum(n for target, n in counts.items() if "torch_ln.rms_norm_fwd" in target)
    assert norm_ops == 2 * 2 + 1, counts
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# timm's norm classes beyond LayerNorm and LayerNorm2d (issue 38 item 3): (class, input shape). RmsNorm2d is given
# an NCHW input, contiguous and channels-last.
TIMM_CASES = [
    pytest.param(lambda: timm.layers.RmsNorm(64), (37, 64), False, id="RmsNorm"),
    pytest.param(lambda: timm.layers.RmsNorm2d(8), (2, 8, 5, 3), False, id="RmsNorm2d"),
    pytest.param(lambda: timm.layers.RmsNorm2d(8), (2, 8, 5, 3), True, id="RmsNorm2d-channels_last"),
    pytest.param(lambda: timm.layers.LayerNormFp32(64), (37, 64), False, id="LayerNormFp32"),
]


def _timm_reference64(module, x: torch.Tensor) -> torch.Tensor:
    """The class's function in float64, no intermediate rounding."""
    w = module.weight.detach().double()
    if isinstance(module, timm.layers.LayerNormFp32):
        return reference.layer_norm(x.double(), w.shape, w, module.bias.detach().double(), module.eps)
    h = x.double().movedim(1, -1) if isinstance(module, timm.layers.RmsNorm2d) else x.double()
    y = reference.rms_norm(h, w.shape, w, module.eps)
    return y.movedim(-1, 1) if isinstance(module, timm.layers.RmsNorm2d) else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("make, shape, channels_last", TIMM_CASES)
def test_timm_norm_classes(make, shape, channels_last, dtype):
    """Swapped, each gives the class's output and gradients by the tolerance table and the accuracy rule (float32
    statistics summed in another order are the only difference). RmsNorm and RmsNorm2d compute in the input's
    dtype, statistics included: bfloat16 input takes the class's own forward, bit for bit; LayerNormFp32 rounds
    float64 input to float32 and takes its forward there."""
    torch.manual_seed(5)
    module = make().to(dtype)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn_like(param))
    swapped = _swapped(module)
    base = (2 * torch.randn(shape) + 0.5).to(dtype)
    if channels_last:
        base = base.contiguous(memory_format=torch.channels_last)
    grad_out = torch.randn(shape).to(dtype)
    results = []
    for m in (swapped, module):
        x = base.clone().requires_grad_()
        m.zero_grad()
        y = m(x)
        y.backward(grad_out)
        results.append({"y": y.detach(), "dx": x.grad, "dweight": m.weight.grad.clone()})
    ours, theirs = results
    class_forward = dtype == torch.bfloat16 and not isinstance(module, timm.layers.LayerNormFp32)
    if class_forward or (dtype == torch.float64 and isinstance(module, timm.layers.LayerNormFp32)):
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), name
        return
    rows = base.numel() // base.shape[1 if len(shape) == 4 else -1]
    ref64 = _timm_reference64(module, base)
    assert ours["y"].dtype == theirs["y"].dtype and ours["y"].shape == theirs["y"].shape
    assert_close_to_torch("y", ours["y"], theirs["y"], dtype, rows=rows)
    assert_accuracy("y", ours["y"], theirs["y"], ref64, dtype, rows=rows)
    for name in ("dx", "dweight"):
        assert_close_to_torch(name, ours[name], theirs[name], dtype, rows=rows)
