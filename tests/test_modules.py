"""torch_ln.LayerNorm / torch_ln.RMSNorm as drop-ins for torch.nn's, and torch_ln.replace_norms."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from norm_cases import DEVICES, LAYER_NORM, NORMS, RMS_NORM, TOLERANCES, assert_close_to_torch
from torch import nn

import torch_ln

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _constructor_cases():
    """(norm, kwargs) over normalized_shape forms, eps, elementwise_affine and bias."""
    cases = []
    shapes = [8, (8,), [2, 4], torch.Size([3, 5])]  # int, tuple, list, Size: all become a tuple
    for norm in (LAYER_NORM, RMS_NORM):
        epss = [1e-5, 1e-3] if norm is LAYER_NORM else [None, 1e-6]  # RMSNorm's default eps is None
        biases = [True, False] if norm.has_bias else [None]
        for shape, eps, affine, bias in itertools.product(shapes, epss, (True, False), biases):
            kwargs = {"normalized_shape": shape, "eps": eps, "elementwise_affine": affine}
            if bias is not None:
                kwargs["bias"] = bias
            cases.append(pytest.param(norm, kwargs, id=f"{norm.name}-{shape}-{eps}-affine{affine}-bias{bias}"))
    return cases


def _same_params(a: nn.Module, b: nn.Module) -> None:
    names_a, names_b = [n for n, _ in a.named_parameters()], [n for n, _ in b.named_parameters()]
    assert names_a == names_b
    for name in ("weight", "bias"):
        pa, pb = getattr(a, name, None), getattr(b, name, None)
        assert (pa is None) == (pb is None), name
        if pa is not None:
            assert isinstance(pa, nn.Parameter)
            assert pa.shape == pb.shape and pa.dtype == pb.dtype and pa.device == pb.device, name
            assert torch.equal(pa, pb), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [None, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("norm, kwargs", _constructor_cases())
def test_constructor_parity(norm, kwargs, dtype, device):
    ours = norm.module(**kwargs, device=device, dtype=dtype)
    theirs = norm.torch_module(**kwargs, device=device, dtype=dtype)
    assert isinstance(ours, norm.torch_module)
    assert ours.normalized_shape == theirs.normalized_shape
    assert isinstance(ours.normalized_shape, tuple)
    assert ours.eps == theirs.eps
    assert ours.elementwise_affine == theirs.elementwise_affine
    _same_params(ours, theirs)
    if kwargs.get("bias") is False:
        assert ours.bias is None
    assert ours.extra_repr() == theirs.extra_repr()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]


@pytest.mark.parametrize("norm", NORMS)
def test_reset_parameters(norm):
    ours = norm.module(16)
    with torch.no_grad():
        for p in ours.parameters():
            p.uniform_(-3, 3)
    ours.reset_parameters()
    _same_params(ours, norm.torch_module(16))


@pytest.mark.parametrize("norm", NORMS)
def test_state_dict_cross_loading(norm):
    """A torch checkpoint loads into torch_ln's module and back, strictly."""
    theirs = norm.torch_module((3, 8))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours = norm.module((3, 8))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    _same_params(ours, theirs)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    back = norm.torch_module((3, 8))
    back.load_state_dict(ours.state_dict(), strict=True)
    _same_params(back, ours)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm, kwargs", [c for c in _constructor_cases() if c.values[1]["normalized_shape"] != 8])
def test_module_forward_backward(norm, kwargs, dtype, device):
    """Module outputs, input gradient and parameter gradients equal torch's module's."""
    theirs = norm.torch_module(**kwargs, device=device, dtype=dtype)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours = norm.module(**kwargs, device=device, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    shape = (5, *theirs.normalized_shape)
    x = torch.randn(shape, device=device, dtype=dtype)
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    results = []
    for module in (ours, theirs):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(grad_out)
        results.append({"y": y.detach(), "dx": xi.grad, **{f"d{n}": p.grad for n, p in module.named_parameters()}})
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert_close_to_torch(name, results[0][name], results[1][name], dtype, rows=5)


# ---------------------------------------------------------------------------------------
# replace_norms.
# ---------------------------------------------------------------------------------------


def _count_calls(model: nn.Module) -> list[int]:
    """Counts forward calls of torch_ln's modules (to prove the swapped modules really run)."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    for m in model.modules():
        if isinstance(m, (torch_ln.LayerNorm, torch_ln.RMSNorm)):
            m.register_forward_hook(hook)
    return calls


def _forward_backward(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(grad_out)
    return {"y": y.detach(), "dx": x.grad, **{n: p.grad for n, p in model.named_parameters()}}


def _assert_same_results(swapped: dict, original: dict, atol=1e-5, rtol=1e-5) -> None:
    assert swapped.keys() == original.keys()
    for name, expected in original.items():
        torch.testing.assert_close(
            swapped[name], expected, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )


def _check_swap(model: nn.Module, x: torch.Tensor, expected_norms: int) -> nn.Module:
    """Swaps a deep copy of `model`; checks identity of parameters, training flags, the count
    of swapped norms, and that outputs and all gradients equal the original's."""
    original = model
    model = copy.deepcopy(original)
    params_before = list(model.parameters())
    norms_before = {name: m for name, m in model.named_modules() if type(m) in (nn.LayerNorm, nn.RMSNorm)}
    training_before = {name: m.training for name, m in model.named_modules()}
    returned = torch_ln.replace_norms(model)
    assert returned is model
    assert len(norms_before) == expected_norms
    swapped_modules = dict(model.named_modules())
    for name, old in norms_before.items():
        new = swapped_modules[name]
        assert type(new) is {nn.LayerNorm: torch_ln.LayerNorm, nn.RMSNorm: torch_ln.RMSNorm}[type(old)]
        assert new.weight is old.weight and new.bias is old.bias if hasattr(old, "bias") else new.weight is old.weight
        assert new.eps == old.eps and new.normalized_shape == old.normalized_shape
    assert not any(type(m) in (nn.LayerNorm, nn.RMSNorm) for m in model.modules())
    params_after = list(model.parameters())
    assert len(params_after) == len(params_before) and all(a is b for a, b in zip(params_after, params_before))
    assert {name: m.training for name, m in model.named_modules()} == training_before
    calls = _count_calls(model)
    grad_out = torch.randn_like(original(x))
    want = _forward_backward(original, x, grad_out)
    got = _forward_backward(model, x, grad_out)
    assert calls[0] >= expected_norms, "torch_ln's norms did not run"
    _assert_same_results(got, want)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("final_norm", [False, True])
@pytest.mark.parametrize("norm_first", [True, False])
def test_replace_norms_transformer_encoder(norm_first, final_norm, device):
    layer = nn.TransformerEncoderLayer(
        32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    model = nn.TransformerEncoder(
        layer, num_layers=2, norm=nn.LayerNorm(32) if final_norm else None, enable_nested_tensor=False
    ).to(device)
    with torch.no_grad():  # non-trivial norm parameters
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1, 0.3)
                m.bias.normal_()
    model.eval()
    x = torch.randn(3, 10, 32, device=device)
    _check_swap(model, x, expected_norms=4 + final_norm)


def test_replace_norms_keeps_training_mode():
    model = nn.Sequential(nn.LayerNorm(8), nn.Sequential(nn.RMSNorm(8), nn.LayerNorm(8)))
    model.train()
    model[1][0].eval()  # mixed modes
    swapped = _check_swap(model, torch.randn(4, 8), expected_norms=3)
    assert swapped[0].training and not swapped[1][0].training and swapped[1][1].training


def test_replace_norms_keeps_dtype_and_device():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.RMSNorm(8)).double()
    _check_swap(model, torch.randn(4, 8, dtype=torch.float64), expected_norms=2)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    assert all(p.dtype == torch.float64 for p in swapped.parameters())


@pytest.mark.parametrize(
    "layout",
    [
        "different-parents",  # the same norm in two submodules
        # The same norm twice in one parent. Found: replace_norms walked parent.named_children(),
        # which yields a module only once per parent, so the second slot kept the nn.LayerNorm
        # (torch_ln/modules.py, replace_norms: `for name, child in list(parent.named_children())`).
        "same-parent",
    ],
)
def test_replace_norms_shared_norm_stays_shared(layout):
    shared = nn.LayerNorm(8)
    if layout == "same-parent":
        model = nn.Sequential(nn.Linear(8, 8), shared, nn.Linear(8, 8), shared)
        slots = lambda: (model[1], model[3])
    else:
        model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), shared), nn.Sequential(shared))
        slots = lambda: (model[0][1], model[1][0])
    parameters_before = [id(p) for p in model.parameters()]  # the shared norm counted once
    torch_ln.replace_norms(model)
    first, second = slots()
    assert type(first) is torch_ln.LayerNorm and type(second) is torch_ln.LayerNorm
    assert first is second
    assert first.weight is shared.weight
    assert [id(p) for p in model.parameters()] == parameters_before


def test_replace_norms_bare_norm_and_subclasses():
    assert type(torch_ln.replace_norms(nn.LayerNorm(8))) is torch_ln.LayerNorm
    assert type(torch_ln.replace_norms(nn.RMSNorm(8))) is torch_ln.RMSNorm

    class CustomNorm(nn.LayerNorm):  # may override forward: left alone
        pass

    model = nn.Sequential(CustomNorm(8), nn.LayerNorm(8))
    torch_ln.replace_norms(model)
    assert type(model[0]) is CustomNorm and type(model[1]) is torch_ln.LayerNorm
    # Already swapped: a second pass changes nothing.
    again = model[1]
    torch_ln.replace_norms(model)
    assert model[1] is again


def test_replace_norms_keeps_hooks():
    norm = nn.LayerNorm(8)
    seen = []
    norm.register_forward_hook(lambda m, i, o: seen.append(type(m)))
    model = nn.Sequential(norm)
    torch_ln.replace_norms(model)
    model(torch.randn(2, 8))
    assert seen == [torch_ln.LayerNorm]


def test_replace_norms_optimizer_keeps_working():
    """An optimizer built before the swap updates the swapped modules' parameters."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_ln.replace_norms(model)
    before = model[1].weight.detach().clone()
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    assert not torch.equal(model[1].weight, before)


# A small Llama-style decoder block, written here (transformers is not installed): pre-norm
# RMSNorm, causal multi-head attention with rotary embeddings, SwiGLU MLP, final RMSNorm.


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    @staticmethod
    def _rotary(t: torch.Tensor) -> torch.Tensor:
        seq, half = t.shape[-2], t.shape[-1] // 2
        freqs = 1.0 / (10000 ** (torch.arange(half, device=t.device, dtype=t.dtype) / half))
        angles = torch.arange(seq, device=t.device, dtype=t.dtype)[:, None] * freqs
        cos, sin = angles.cos(), angles.sin()
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(self._rotary(q), self._rotary(k), v, is_causal=True)
        return self.out(out.transpose(1, 2).reshape(batch, seq, dim))


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _LlamaBlock(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 88, eps: float | None = 1e-6):
        super().__init__()
        self.input_norm = nn.RMSNorm(dim, eps=eps)
        self.attn = _Attention(dim, heads)
        self.post_attention_norm = nn.RMSNorm(dim, eps=eps)
        self.mlp = _SwiGLU(dim, hidden)
        self.final_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x):
        x = x + self.attn(self.input_norm(x))
        x = x + self.mlp(self.post_attention_norm(x))
        return self.final_norm(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eps", [1e-6, None])  # Llama's eps, and torch's default (machine eps)
def test_replace_norms_llama_block(eps, device):
    model = _LlamaBlock(eps=eps).to(device)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.RMSNorm):
                m.weight.normal_(1, 0.3)
    x = torch.randn(2, 12, 32, device=device)
    _check_swap(model, x, expected_norms=3)


@pytest.mark.parametrize("device", DEVICES)
def test_replace_norms_llama_block_bf16(device):
    """The same in bfloat16: outputs and gradients within bfloat16's tolerance of torch's."""
    model = _LlamaBlock().to(device=device, dtype=torch.bfloat16)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    x = torch.randn(2, 12, 32, device=device, dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    want, got = _forward_backward(model, x, grad_out), _forward_backward(swapped, x, grad_out)
    # Through attention and the MLP, a 1-ulp difference in a norm's output moves later
    # values by a few bfloat16 ulps: 4x the table's forward tolerance.
    atol, rtol = (4 * t for t in TOLERANCES[torch.bfloat16].fwd)
    _assert_same_results(got, want, atol=atol, rtol=rtol)
