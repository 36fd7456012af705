"""torch_ln.qk_rms_norm (issue 39 item 1): QK-norm on a packed QKV projection, each head of q and k RMS-normalized in
place, with no copy of qkv.

Its results are defined as torch_ln.rms_norm of the contiguous q and k heads, so every comparison is bitwise: the
kernels compute a row the same way wherever they read it from (rms_norm's accuracy against torch and float64 is
tested in test_ops.py).
"""

from __future__ import annotations

import pytest
import torch
from test_strided_rows import _copies

import torch_ln


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _split(qkv, q_heads, kv_heads, head_dim):
    """q and k heads of qkv as contiguous copies, the way model code without the fused entry gets them."""
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.unflatten(-1, (q_heads, head_dim)).contiguous(), k.unflatten(-1, (kv_heads, head_dim)).contiguous()


def _weights(head_dim, dtype, requires_grad=False):
    return [torch.randn(head_dim, dtype=dtype).requires_grad_(requires_grad) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "leading,q_heads,kv_heads,head_dim",
    [
        ((1,), 1, 1, 64),  # one token, one head each
        ((2, 7), 8, 2, 128),  # [batch, seq]: grouped-query attention, Llama/Qwen3 head size
        ((5,), 4, 4, 61),  # prime head_dim: the CPU kernels' scalar tails
        ((3,), 2, 1, 1000),  # long heads, several vectors a row
    ],
)
@pytest.mark.parametrize("weighted", [True, False])
def test_bitwise_rms_norm_of_the_heads(leading, q_heads, kv_heads, head_dim, dtype, weighted):
    """q and k, and the gradients of qkv and of both weights, bitwise those of rms_norm on the contiguous heads."""
    qkv = torch.randn(*leading, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_weight, k_weight = _weights(head_dim, dtype, requires_grad=True) if weighted else (None, None)
    grads_out = [torch.randn(*leading, heads, head_dim, dtype=dtype) for heads in (q_heads, kv_heads)]
    results = []
    for fused in (True, False):
        leaf = qkv.clone().requires_grad_()
        if fused:
            q, k = torch_ln.qk_rms_norm(leaf, q_heads, kv_heads, head_dim, q_weight, k_weight, 1e-6)
        else:
            q_in, k_in = _split(leaf, q_heads, kv_heads, head_dim)
            q, k = torch_ln.rms_norm(q_in, head_dim, q_weight, 1e-6), torch_ln.rms_norm(k_in, head_dim, k_weight, 1e-6)
        params = [p for p in (q_weight, k_weight) if p is not None]
        grads = torch.autograd.grad((q, k), [leaf, *params], grads_out)
        results.append([q, k, *grads])
    assert results[0][0].shape == (*leading, q_heads, head_dim) and results[0][1].shape == (
        *leading,
        kv_heads,
        head_dim,
    )
    assert results[0][0].is_contiguous() and results[0][1].is_contiguous()
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)
    # v's part of qkv gets no gradient: qk_rms_norm leaves v alone
    assert torch.count_nonzero(results[0][2][..., (q_heads + kv_heads) * head_dim :]) == 0


def test_rounding_options_as_rms_norm():
    """weight_offset and round_normalized reach both heads (Gemma3's QK-norm: 1 + w)."""
    qkv = torch.randn(3, (2 + 2 * 1) * 32, dtype=torch.bfloat16)
    q_weight, k_weight = _weights(32, torch.bfloat16)
    options = {"weight_offset": 1.0, "round_normalized": True}
    q, k = torch_ln.qk_rms_norm(qkv, 2, 1, 32, q_weight, k_weight, **options)
    q_in, k_in = _split(qkv, 2, 1, 32)
    assert torch.equal(q, torch_ln.rms_norm(q_in, 32, q_weight, **options))
    assert torch.equal(k, torch_ln.rms_norm(k_in, 32, k_weight, **options))


def test_no_copy_of_qkv():
    """Forward and backward read the heads in place: no copy operator runs on the CPU (the split and .contiguous()
    that model code does otherwise, as a control, does copy)."""
    qkv = torch.randn(16, (4 + 2 * 2) * 64, requires_grad=True)
    q_weight, k_weight = _weights(64, torch.float32, requires_grad=True)
    assert _copies(lambda: torch_ln.qk_rms_norm(qkv.detach(), 4, 2, 64, q_weight.detach(), k_weight.detach())) == []
    q, k = torch_ln.qk_rms_norm(qkv, 4, 2, 64, q_weight, k_weight)
    # The backward's gradient of qkv is a new tensor the heads' gradients are written into (slice_backward), so
    # copies run there; the norm backward itself reads the saved views: look for the contiguous() of a head.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.grad((q, k), [qkv, q_weight, k_weight], [torch.ones_like(q), torch.ones_like(k)])
    assert not [e.name for e in prof.events() if e.name in ("aten::clone", "aten::contiguous")]
    assert _copies(lambda: _split(qkv.detach(), 4, 2, 64)) != []


def test_gradcheck():
    qkv = torch.randn(2, 3, (2 + 2 * 1) * 5, dtype=torch.float64, requires_grad=True)
    q_weight, k_weight = _weights(5, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: torch_ln.qk_rms_norm(a[0], 2, 1, 5, a[1], a[2]), (qkv, q_weight, k_weight)
    )


def test_compile_fullgraph_dynamic_and_export():
    q_weight, k_weight = _weights(16, torch.float32)

    def fn(qkv):
        q, k = torch_ln.qk_rms_norm(qkv, 4, 2, 16, q_weight, k_weight, 1e-6)
        return q * 2, k + 1

    qkv = torch.randn(2, 9, (4 + 2 * 2) * 16)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for ours, theirs in zip(compiled(qkv), fn(qkv)):
        assert torch.equal(ours, theirs)

    class QKNorm(torch.nn.Module):
        def forward(self, qkv):
            return fn(qkv)

    program = torch.export.export(QKNorm(), (qkv,))
    for ours, theirs in zip(program.module()(qkv), fn(qkv)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.randn(2, 5 * 8), 2, 1, 16), r"qkv's last dimension .* = 64, but got qkv.shape=\(2, 40\)"),
        ((torch.randn(2, 64), 0, 1, 16), "q_heads to be positive, but got q_heads=0"),
        ((torch.randn(2, 64), 2, -1, 16), "kv_heads to be positive, but got kv_heads=-1"),
        ((torch.randn(2, 64), 2, 1, 0), "head_dim to be positive, but got head_dim=0"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        torch_ln.qk_rms_norm(*args)


def test_weight_of_the_wrong_shape_names_it():
    qkv = torch.randn(2, (2 + 2 * 1) * 16)
    with pytest.raises(ValueError, match=r"expected weight to have shape normalized_shape=\[16\]"):
        torch_ln.qk_rms_norm(qkv, 2, 1, 16, torch.ones(8), torch.ones(16))
