"""torch_ln under torch.distributed: DTensor sharding, tensor + sequence parallel, FSDP2.

Real process groups: the module starts its own ranks (torch.multiprocessing, spawn) on the loopback
interface, 2 CPU ranks over gloo, and on a machine with a GPU one CUDA rank over NCCL (a 1-rank mesh: the
sharding rules do not depend on the device). The ranks run every scenario once, each rank recording per
scenario "ok" or the failure; the tests below assert on those records. Everything runs in float64, so that
sharded and single-process results differ only by summation order: tolerances are 1e-10.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from norm_cases import LAYER_NORM, RMS_NORM
from torch import nn

import torch_ln

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TIMEOUT_S = 150  # the whole group, start-up included; a hung collective fails the tests instead of hanging them
ATOL = RTOL = 1e-10  # float64; sharded sums only reorder additions
SHAPE = (4, 6, 16)  # (batch, sequence, hidden): two batch dims to shard, normalized over hidden
FUSED = {"layer_norm": torch_ln.add_layer_norm, "rms_norm": torch_ln.add_rms_norm}
PLACEMENTS = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate(), "shard_hidden": Shard(2)}


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------------
# Scenarios (run on every rank)
# ------------------------------------------------------------------------------------------------


def _dtensor_ops(mesh, device: str, norm, placement_name: str) -> None:
    """fwd and bwd operators on a DTensor input: values equal the single-process ones, placements as expected."""
    placement = PLACEMENTS[placement_name]
    torch.manual_seed(0)  # every rank builds the same global tensors
    x = torch.randn(SHAPE, dtype=torch.float64, device=device)
    grad_out = torch.randn(SHAPE, dtype=torch.float64, device=device)
    params = [torch.randn(SHAPE[-1], dtype=torch.float64, device=device) for _ in norm.params]
    shape = (SHAPE[-1],)

    y, stats = norm.fwd(x, shape, *params)
    grads = norm.bwd(grad_out, x, shape, stats, *params)

    replicated = [distribute_tensor(p, mesh, [Replicate()]) for p in params]
    y_d, stats_d = norm.fwd(distribute_tensor(x, mesh, [placement]), shape, *replicated)
    grads_d = norm.bwd(
        distribute_tensor(grad_out, mesh, [placement]),
        distribute_tensor(x, mesh, [placement]),
        shape,
        stats_d,
        *replicated,
    )
    for name, got, want in [("y", y_d, y), *zip(("mean", "rstd")[-len(stats) :], stats_d, stats)]:
        _close(got.full_tensor(), want, name)
    for name, got, want in zip(("dx", "dweight", "dbias"), grads_d, grads):
        _close(got.full_tensor(), want, name)
    if placement_name == "shard_hidden":
        # Redistributed to whole rows (DTensor picks how); the result must just be right.
        assert all(p != Shard(2) for p in y_d.placements), y_d.placements
        return
    for t in (y_d, *stats_d, grads_d[0]):
        assert t.placements == (placement,), t.placements
    expected_param_grad = Replicate() if placement == Replicate() else Partial("sum")
    for g in grads_d[1:]:
        assert g.placements == (expected_param_grad,), g.placements


def _dtensor_autograd(mesh, device: str, norm) -> None:
    """The functional under autograd with a Shard(1) input and replicated parameters, odd batch included."""
    torch.manual_seed(1)
    x = torch.randn(3, 5, 16, dtype=torch.float64, device=device)  # 5 rows on 2 ranks: uneven shards
    params = [torch.randn(16, dtype=torch.float64, device=device) for _ in norm.params]
    ref = [t.clone().requires_grad_() for t in (x, *params)]
    norm.torch(ref[0], (16,), *ref[1:]).pow(2).sum().backward()
    ours = [
        distribute_tensor(t, mesh, [Shard(1) if i == 0 else Replicate()]).requires_grad_() for i, t in enumerate(ref)
    ]
    y = norm.ours(ours[0], (16,), *ours[1:])
    y.pow(2).sum().backward()
    for i, (got, want) in enumerate(zip(ours, ref)):
        _close(_full(got.grad), want.grad, f"grad of argument {i}")


def _dtensor_fused(mesh, device: str, norm, placement_name: str) -> None:
    """add_*_fwd/bwd on DTensors (residual, residual_out and grad_residual_out placed like x), then the public
    function under autograd: values equal the single-process ones, rows keep their placement."""
    placement = PLACEMENTS[placement_name]
    fwd = getattr(torch.ops.torch_ln, f"add_{norm.name}_fwd").default
    bwd = getattr(torch.ops.torch_ln, f"add_{norm.name}_bwd").default
    torch.manual_seed(5)
    x, residual, grad_out, grad_residual_out = (
        torch.randn(SHAPE, dtype=torch.float64, device=device) for _ in range(4)
    )
    params = [torch.randn(SHAPE[-1], dtype=torch.float64, device=device) for _ in norm.params]
    shape, mask = [SHAPE[-1]], [True] * (1 + len(params))

    def run(x, residual, grad_out, grad_residual_out, params):
        y, residual_out, *stats = fwd(x, residual, shape, *params, norm.default_eps, None)
        return (y, residual_out, *stats, *bwd(grad_out, grad_residual_out, residual_out, shape, *stats, *params, mask))

    want = run(x, residual, grad_out, grad_residual_out, params)
    rows = [distribute_tensor(t, mesh, [placement]) for t in (x, residual, grad_out, grad_residual_out)]
    got = run(*rows, [distribute_tensor(p, mesh, [Replicate()]) for p in params])
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g.full_tensor(), w, f"output {i}")
    for t in got[: len(got) - len(params)]:  # y, residual_out, statistics, d residual_out
        assert t.placements == (placement,), t.placements

    ref = [t.clone().requires_grad_() for t in (x, residual, *params)]
    ours = [
        distribute_tensor(t, mesh, [placement] if i < 2 else [Replicate()]).requires_grad_() for i, t in enumerate(ref)
    ]
    for args in (ref, ours):
        y, residual_out = FUSED[norm.name](args[0], args[1], shape, *args[2:])
        (y.pow(2).sum() + residual_out.pow(3).sum()).backward()
    for i, (got_arg, want_arg) in enumerate(zip(ours, ref)):
        _close(_full(got_arg.grad), want_arg.grad, f"grad of argument {i}")


class _Block(nn.Module):
    """A pre-norm transformer-style block: two residual sublayers, LayerNorm before one, RMSNorm before the other."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.norm1, self.up1, self.down1 = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.norm2, self.up2, self.down2 = nn.RMSNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        with torch.no_grad():  # affine parameters away from their (1, 0) start, so their gradients matter
            for p in (self.norm1.weight, self.norm1.bias, self.norm2.weight):
                p.normal_(1, 0.2)

    def forward(self, x):
        x = x + self.down1(torch.tanh(self.up1(self.norm1(x))))
        return x + self.down2(torch.tanh(self.up2(self.norm2(x))))


def _train(model, batches, loss_scale: float = 1.0, total=lambda loss: loss) -> list[float]:
    """Two SGD steps (momentum: the second step depends on the first's gradients too); the losses, totalled."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x in batches:
        optimizer.zero_grad()
        loss = model(x).pow(2).sum() * loss_scale
        loss.backward()
        optimizer.step()
        losses.append(float(total(loss.detach())))
    return losses


def _reference_run(device: str, batches: list, loss_scale: float = 1.0):
    torch.manual_seed(2)
    model = _Block().to(device, torch.float64)  # torch's norms
    return model, _train(model, batches, loss_scale)


def _all_reduce_sum(mesh):
    def total(loss):
        dist.all_reduce(loss, group=mesh.get_group())
        return loss

    return total


def _tensor_sequence_parallel(mesh, device: str) -> None:
    """parallelize_module: Colwise/Rowwise linears, SequenceParallel torch_ln norms; two optimizer steps."""
    torch.manual_seed(3)
    batches = [torch.randn(2, 8, 16, dtype=torch.float64, device=device) for _ in range(2)]
    reference_model, reference_losses = _reference_run(device, batches)

    torch.manual_seed(2)
    model = torch_ln.replace_norms(_Block().to(device, torch.float64))
    sublayer = {"input_layouts": Shard(1)}
    plan = {
        "norm1": SequenceParallel(),
        "up1": ColwiseParallel(**sublayer),
        "down1": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "up2": ColwiseParallel(**sublayer),
        "down2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(model, mesh, plan)
    rank, world = mesh.get_local_rank(), mesh.size()
    local = [b.chunk(world, dim=1)[rank] for b in batches]  # each rank holds its part of the sequence
    losses = _train(model, local, total=_all_reduce_sum(mesh))
    assert isinstance(model.norm1, torch_ln.LayerNorm) and isinstance(model.norm2, torch_ln.RMSNorm)
    _close(torch.tensor(losses), torch.tensor(reference_losses), "losses")
    for (name, p), (_, want) in zip(model.named_parameters(), reference_model.named_parameters()):
        _close(_full(p.grad), want.grad, f"{name}.grad")
        _close(_full(p.detach()), want.detach(), name)


def _fsdp2(mesh, device: str) -> None:
    """fully_shard per block and at the root, torch_ln norms; data parallel over the batch; two optimizer steps."""
    torch.manual_seed(4)
    batches = [torch.randn(4, 5, 16, dtype=torch.float64, device=device) for _ in range(2)]
    world, rank = mesh.size(), mesh.get_local_rank()
    # FSDP averages the ranks' gradients: the single-process equivalent is the full batch's loss over world.
    reference_model, reference_losses = _reference_run(device, batches, loss_scale=1 / world)

    torch.manual_seed(2)
    model = torch_ln.replace_norms(_Block().to(device, torch.float64))
    for sublayer in (model.up1, model.down1, model.up2, model.down2):
        fully_shard(sublayer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = [b.chunk(world, dim=0)[rank] for b in batches]  # data parallel: each rank its part of the batch
    losses = _train(model, local, total=lambda loss: _all_reduce_sum(mesh)(loss) / world)
    _close(torch.tensor(losses), torch.tensor(reference_losses), "losses")
    for (name, p), (_, want) in zip(model.named_parameters(), reference_model.named_parameters()):
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), (name, p)
        _close(p.full_tensor().detach(), want.detach(), name)


def _scenarios(device: str) -> dict:
    cases = {}
    for norm in (LAYER_NORM, RMS_NORM):
        for placement in PLACEMENTS:
            cases[f"ops-{norm.name}-{placement}"] = lambda mesh, n=norm, p=placement: _dtensor_ops(mesh, device, n, p)
        cases[f"autograd-{norm.name}"] = lambda mesh, n=norm: _dtensor_autograd(mesh, device, n)
        cases[f"fused-{norm.name}"] = lambda mesh, n=norm: _dtensor_fused(mesh, device, n, "shard1")
    cases["tensor_sequence_parallel"] = lambda mesh: _tensor_sequence_parallel(mesh, device)
    cases["fsdp2"] = lambda mesh: _fsdp2(mesh, device)
    return cases


def _worker(rank: int, world: int, port: int, device: str, out: str) -> None:
    # A rank killed by a signal prints every thread's Python stack (stderr, in the test's report): once (main's suite
    # in a fresh-clone CI of 6315ea9, 2026-12-07) rank 0 died of SIGSEGV once the fsdp2 scenario had started, no results
    # written; 12 reruns under load passed.
    faulthandler.enable(all_threads=True)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    mesh = init_device_mesh(device, (world,))
    results = {}
    for name, run in _scenarios(device).items():
        try:
            run(mesh)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 (recorded for the test to report; the ranks go on)
            results[name] = traceback.format_exc()
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    # Skip the interpreter's teardown: once (CI of 20b601a, 2026-12-04) a rank aborted there after all of this had
    # run ("terminate called without an active exception": a thread of torch's, torch_ln starts none), which failed
    # every test of the module with its results already written.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(world: int, device: str, tmp: Path) -> list[dict]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    context = mp.start_processes(
        _worker, args=(world, _free_port(), device, str(tmp)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    try:
        while not context.join(timeout=1):
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"the {world} ranks did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    return _run_group(2, "cpu", tmp_path_factory.mktemp("gloo"))


@pytest.fixture(scope="module")
def cuda_results(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return _run_group(1, "cuda", tmp_path_factory.mktemp("nccl"))


def _assert_ok(results: list[dict], scenario: str) -> None:
    for rank, recorded in enumerate(results):
        assert recorded[scenario] == "ok", f"rank {rank}:\n{recorded[scenario]}"


SCENARIOS = list(_scenarios("cpu"))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_cpu_ranks(cpu_results, scenario):
    _assert_ok(cpu_results, scenario)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_one_cuda_rank(cuda_results, scenario):
    _assert_ok(cuda_results, scenario)


_CHECK_REGISTERED = """
import sys, torch
{imports}
from torch.distributed.tensor import DTensor
strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
missing = [n for n in torch_ln._transforms.OPS if getattr(torch.ops.torch_ln, n).default not in strategies]
assert not missing, missing
"""


def test_sharding_registered_whichever_is_imported_first():
    """torch_ln registers its strategies when DTensor loads, before or after torch_ln (which does not load it)."""
    orders = {
        "torch_ln first": "import torch_ln\nassert 'torch.distributed.tensor' not in sys.modules\n"
        "import torch.distributed.tensor",
        "DTensor first": "import torch.distributed.tensor\nimport torch_ln",
    }
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _CHECK_REGISTERED.format(imports=imports)], stderr=subprocess.PIPE
        )
        for name, imports in orders.items()
    }
    for name, run in runs.items():
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, f"{name}:\n{err.decode()}"
