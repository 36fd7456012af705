"""torch_ln's operators captured in a CUDA graph (issue 36, item 5: decode-time calls run under graphs): the forward,
and the forward with its backward through torch.autograd.grad, of layer_norm, rms_norm, add_layer_norm and
add_rms_norm (and memory_efficient=True's backward), captured once, then replayed with new values copied into the
static inputs; every replay's outputs must equal, bitwise, an eager call on the same input tensors. GPU-only: every
test skips without CUDA.

The eager reference runs on the graph's own static tensors, so that both see the same addresses (a launch plan may
depend on alignment: batch invariance promises results that depend on D, dtype, alignment and the device only).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torch_ln
from torch_ln import _extension

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not _extension.cuda_compiled(), reason="torch_ln was built without CUDA"
    ),
]

OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
# Decode-time rows at a model width, and an odd width (rows that end in a partial vector).
SHAPES = [(1, 4096), (8, 4096), (64, 4096), (8, 1000)]
DTYPES = [torch.float32, torch.bfloat16]
REPLAYS = 3


def _static_inputs(op: str, M: int, D: int, dtype: torch.dtype, requires_grad: bool) -> dict[str, torch.Tensor]:
    def make(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device="cuda", dtype=dtype).requires_grad_(requires_grad)

    inputs = {"x": make(M, D), "weight": make(D)}
    if op in ("layer_norm", "add_layer_norm"):
        inputs["bias"] = make(D)
    if op.startswith("add_"):
        inputs["residual"] = make(M, D)
    return inputs


def _fill(tensors: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """New values, copied into the tensors in place (as a decode loop refills a graph's static inputs)."""
    with torch.no_grad():
        for name, t in tensors.items():
            values = torch.randn(t.shape, device="cuda", generator=generator)
            if name == "weight":
                values = 1 + 0.1 * values
            t.copy_(values)


def _forward(op: str, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    x, weight, bias, residual = (inputs.get(k) for k in ("x", "weight", "bias", "residual"))
    D = x.shape[-1]
    if op == "layer_norm":
        return [torch_ln.layer_norm(x, (D,), weight, bias)]
    if op == "rms_norm":
        return [torch_ln.rms_norm(x, (D,), weight)]
    if op == "add_layer_norm":
        return list(torch_ln.add_layer_norm(x, residual, (D,), weight, bias))
    return list(torch_ln.add_rms_norm(x, residual, (D,), weight))


def _forward_backward(op: str, inputs: dict[str, torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs and the gradients of every input, for incoming gradients `grads` (one per output)."""
    outputs = _forward(op, inputs)
    wrt = list(inputs.values())
    return [o.detach() for o in outputs] + list(torch.autograd.grad(outputs, wrt, grads))


def _capture(step: Callable[[], list[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """Captures one call of `step` after a warm-up on a side stream (as torch.cuda.graphs asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def _replay_and_compare(
    graph: torch.cuda.CUDAGraph,
    outputs: list[torch.Tensor],
    step: Callable[[], list[torch.Tensor]],
    static: dict[str, torch.Tensor],
    seed: int,
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for replay in range(REPLAYS):
        _fill(static, generator)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [o.clone() for o in outputs]
        eager = step()  # the same static tensors, outside the graph
        torch.cuda.synchronize()
        assert len(replayed) == len(eager)
        for index, (got, want) in enumerate(zip(replayed, eager, strict=True)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.isfinite(want.float()).all()
            assert torch.equal(got, want), f"replay {replay}, result {index}: graph and eager differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("M, D", SHAPES, ids=[f"M{M}-D{D}" for M, D in SHAPES])
@pytest.mark.parametrize("op", OPS)
def test_cuda_graph_forward(op, M, D, dtype):
    """Inference: inputs that do not require grad, as a decode step under a graph."""
    static = _static_inputs(op, M, D, dtype, requires_grad=False)
    _fill(static, torch.Generator(device="cuda").manual_seed(0))

    def step() -> list[torch.Tensor]:
        return _forward(op, static)

    graph, outputs = _capture(step)
    _replay_and_compare(graph, outputs, step, static, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("M, D", SHAPES, ids=[f"M{M}-D{D}" for M, D in SHAPES])
@pytest.mark.parametrize("op", OPS)
def test_cuda_graph_forward_backward(op, M, D, dtype):
    """The forward and torch.autograd.grad of every input in one captured region (leaf inputs that require grad;
    the incoming gradients are static inputs too)."""
    static = _static_inputs(op, M, D, dtype, requires_grad=True)
    incoming = {
        f"d{i}": torch.empty(M, D, device="cuda", dtype=dtype) for i in range(2 if op.startswith("add_") else 1)
    }
    generator = torch.Generator(device="cuda").manual_seed(0)
    _fill(static, generator)
    _fill(incoming, generator)

    def step() -> list[torch.Tensor]:
        return _forward_backward(op, static, list(incoming.values()))

    graph, outputs = _capture(step)
    _replay_and_compare(graph, outputs, step, {**static, **incoming}, seed=1)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_cuda_graph_memory_efficient_backward(op):
    """memory_efficient=True (no bias): its backward reads y and checks the weight for zeros; while the graph
    records, that check runs on the device (a host synchronization would end the capture)."""
    M, D, dtype = 8, 4096, torch.bfloat16
    static = {"x": torch.empty(M, D, device="cuda", dtype=dtype).requires_grad_()}
    static["weight"] = torch.empty(D, device="cuda", dtype=dtype).requires_grad_()
    incoming = {"dy": torch.empty(M, D, device="cuda", dtype=dtype)}
    generator = torch.Generator(device="cuda").manual_seed(0)
    _fill(static, generator)
    _fill(incoming, generator)
    norm = torch_ln.layer_norm if op == "layer_norm" else torch_ln.rms_norm

    def step() -> list[torch.Tensor]:
        y = norm(static["x"], (D,), static["weight"], memory_efficient=True)
        return [y.detach(), *torch.autograd.grad([y], list(static.values()), [incoming["dy"]])]

    graph, outputs = _capture(step)
    _replay_and_compare(graph, outputs, step, {**static, **incoming}, seed=1)


def test_cuda_graph_replays_into_the_same_outputs():
    """A replay writes the tensors the capture returned (no new allocation): a decode loop reads them in place."""
    static = _static_inputs("rms_norm", 8, 4096, torch.bfloat16, requires_grad=False)
    _fill(static, torch.Generator(device="cuda").manual_seed(0))
    graph, (y,) = _capture(lambda: _forward("rms_norm", static))
    address = y.data_ptr()
    before = y.clone()
    with torch.no_grad():
        static["x"].mul_(2).add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert y.data_ptr() == address
    assert not torch.equal(y, before)
    assert torch.equal(y, _forward("rms_norm", static)[0])
