"""Strided rows (issue 39 item 1): the plain norms read x through its strides instead of copying it.

A layout is read in place when each row's normalized elements are contiguous and the rows, the leading dimensions
flattened, are at most two strides deep: a column slice, a chunk or split of the last dimension, leading dimensions
that collapse (a slice of a 3-D tensor), a broadcast row (stride 0), transposed leading dimensions, the heads of a
packed QKV projection. Any other layout (three strides deep, rows whose elements are strided) is copied first, as
before. The fused add reads x and residual contiguous. Outputs (y, dx) are contiguous.

Every result on a strided input must be bitwise the result on its contiguous copy: the kernels compute each row
the same way wherever it is read from (the CUDA kernels' vector path needs every row start 16-byte aligned, as the
base: otherwise the scalar path, same bits).
"""

from __future__ import annotations

import pytest
import torch
from norm_cases import NORMS, make_params
from torch.profiler import ProfilerActivity, profile


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _column_slice(M, D, dtype):
    return torch.randn(M, D + 13).to(dtype)[:, 5 : 5 + D]  # odd row stride, base 5 elements in: unaligned


def _aligned_slice(M, D, dtype):
    return torch.randn(M, D + 64).to(dtype)[:, :D]  # row stride D + 64: 16-byte aligned in every dtype


def _chunk(M, D, dtype):
    return torch.randn(M, 3 * D).to(dtype).chunk(3, dim=-1)[1]  # the middle third, as q, k, v = qkv.chunk(3, -1)


def _three_d_slice(M, D, dtype):
    return torch.randn(2, M, D + 8).to(dtype)[:, :, :D]  # leading dims [2, M] collapse into one stride


def _broadcast_row(M, D, dtype):
    return torch.randn(1, D).to(dtype).expand(M, D)  # stride 0: one row read M times


def _transposed(M, D, dtype):
    return torch.randn(M, 2, D).to(dtype).transpose(0, 1)  # leading dims [2, M] strided [D, 2D]: two levels


def _packed_heads(M, D, dtype):
    # q of a packed QKV projection [tokens, (2 + 1 + 1) heads x D] viewed as [tokens, 2, D]: heads D apart, tokens
    # 4D apart, two levels
    return torch.randn(M, 4 * D).to(dtype)[:, : 2 * D].view(M, 2, D)


def _packed_heads_odd_width(M, D, dtype):
    # as _packed_heads with one element more per token: the tokens' stride is odd (the CUDA kernels' scalar path)
    return torch.randn(M, 4 * D + 1).to(dtype)[:, D : 3 * D].view(M, 2, D)


# Layouts read in place.
IN_PLACE = [
    _column_slice,
    _aligned_slice,
    _chunk,
    _three_d_slice,
    _broadcast_row,
    _transposed,
    _packed_heads,
    _packed_heads_odd_width,
]


def _three_levels(M, D, dtype):
    # leading dims [2, M, 2] strided [3D, 6D, D]: no two of them merge, three levels
    return torch.randn(M, 2, 3, D).to(dtype)[:, :, :2].transpose(0, 1)


def _strided_elements(M, D, dtype):
    return torch.randn(D, M).to(dtype).t()  # each row's elements M apart


COPIED = [_three_levels, _strided_elements]


def _run(norm, x, weight, bias, grad_out):
    """Forward through the *_fwd operator, then its backward: y, statistics, dx, dweight (and dbias)."""
    shape = [x.shape[-1]]
    y, stats = norm.fwd(x, shape, weight, bias)
    grads = norm.bwd(grad_out, x, shape, stats, weight, bias)
    return [y, *stats, *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("D", [64, 1021])  # vectors; prime D, the scalar tails
@pytest.mark.parametrize("layout", IN_PLACE + COPIED)
@pytest.mark.parametrize("norm", NORMS)
def test_strided_bitwise_as_contiguous(norm, layout, D, dtype):
    x = layout(37, D, dtype)  # 37 rows: the CPU backward's row chunks
    weight, bias = make_params(norm, (D,), True, norm.has_bias, dtype, "cpu")
    grad_out = torch.randn(x.shape).to(dtype)
    ours, theirs = _run(norm, x, weight, bias, grad_out), _run(norm, x.contiguous(), weight, bias, grad_out)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert ours[0].is_contiguous()


def _copies(fn) -> list[str]:
    """The copy operators the call of fn ran (torch.profiler on the CPU)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name in ("aten::clone", "aten::copy_", "aten::contiguous")]


@pytest.mark.parametrize("layout", IN_PLACE)
@pytest.mark.parametrize("norm", NORMS)
def test_no_copy_of_a_strided_input(norm, layout):
    """The operators read a strided input in place: no copy runs, forward or backward (the copied layouts, as a
    control, show the copy this test looks for)."""
    x = layout(8, 64, torch.float32)
    weight, bias = make_params(norm, (64,), True, norm.has_bias, torch.float32, "cpu")
    grad_out = torch.randn(x.shape)
    _, stats = norm.fwd(x, [64], weight, bias)
    assert _copies(lambda: norm.fwd(x, [64], weight, bias)) == []
    assert _copies(lambda: norm.bwd(grad_out, x, [64], stats, weight, bias)) == []
    for copied_layout in COPIED:
        copied = copied_layout(8, 64, torch.float32)
        assert _copies(lambda copied=copied: norm.fwd(copied, [64], weight, bias)) != []


@pytest.mark.parametrize("norm", NORMS)
def test_autograd_saves_the_view(norm):
    """Through torch_ln's functional API and autograd, a column slice's gradients equal those of its contiguous copy,
    bit for bit: on the eager path (C++ autograd, the kernels) and under torch.func.grad (the registered autograd,
    whose backward is the closed form in torch ops, as torch.func asks for a differentiable one)."""
    base = torch.randn(9, 80)
    weight, bias = make_params(norm, (64,), True, norm.has_bias, torch.float32, "cpu")
    grad_out = torch.randn(9, 64)
    results = []
    for as_view in (True, False):

        def rows(b, as_view=as_view):
            return b[:, 8:72] if as_view else b[:, 8:72].contiguous()

        leaf = base.clone().requires_grad_()
        norm.ours(rows(leaf), (64,), weight, bias, norm.default_eps).backward(grad_out)
        results.append(leaf.grad)
        loss = lambda b, rows=rows: (norm.ours(rows(b), (64,), weight, bias, norm.default_eps) * grad_out).sum()
        results.append(torch.func.grad(loss)(base))
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])


# Views of a [6, 160] tensor, 32 elements a row: a column slice (one stride), the first two heads of a packed
# [6, 5 heads x 32] projection (two strides).
VIEWS = {
    "column_slice": lambda base: base[:, 5:37],
    "packed_heads": lambda base: base[:, :64].unflatten(-1, (2, 32)),
}


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("norm", NORMS)
def test_opcheck_and_compile_with_strided_input(norm, view):
    rows_of = VIEWS[view]
    x = rows_of(torch.randn(6, 160))
    weight, bias = make_params(norm, (32,), True, norm.has_bias, torch.float32, "cpu")
    args = (x, [32], weight, bias, 1e-5) if norm.has_bias else (x, [32], weight, 1e-5)
    torch.library.opcheck(norm.fwd_op, args)
    _, *stats = norm.fwd_op(*args)
    params = (weight, bias) if norm.has_bias else (weight,)
    torch.library.opcheck(norm.bwd_op, (torch.randn(x.shape), x, [32], *stats, *params, [True] * (1 + len(params))))

    def fn(base):
        return norm.ours(rows_of(base), (32,), weight, bias, norm.default_eps)

    base = torch.randn(6, 160)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(base), fn(base))

    class Sliced(torch.nn.Module):
        def forward(self, base):
            return fn(base)

    program = torch.export.export(Sliced(), (base,))
    assert torch.equal(program.module()(base), fn(base))
