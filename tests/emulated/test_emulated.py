"""The CUDA kernels, run on the CPU under the SIMT emulation (csrc/emulated).

The kernels, their launch planning and their host launchers are the exact code
the CUDA build compiles; only the device layer differs. scripts/run.sh runs this
file under AddressSanitizer and UndefinedBehaviorSanitizer, so an out-of-bounds
or misaligned access fails it. The emulated device has 2 SMs of 2048 threads.

Which case covers which path (plans from csrc/cuda/launch_plan.h):
- short rows, several rows per warp (tpr < 32): D=1, D=7, D=64
- a warp per row, 4 rows per block (tpr = 32): D=1024 float32 (256 vectors / 8)
- several warps per row, 2 rows per block (tpr = 64, cross-warp reduction): D=2048 float32
- a block per row (tpr >= 128): D=4096 bfloat16 (512 vectors / 4 = 128)
- forward, rows too long for registers (D > 32 x 512, scalar > 8 x 512): staged in shared memory, a block per row
  (D=40000 float32, 33001 scalar; the weight and bias slices beside them where they fit), over a thread-block
  cluster of 2, 4 or 8 blocks where one block's shared memory is not enough (an emulated device with little
  shared memory reaches them at short rows), and the multi-pass path where even a cluster has no room (the same
  small device without clusters: GPUs before sm_90); every dtype, vectors and scalar: D=16392 and 16411;
  backward multi-pass: D=9000 float32 (> 4 x 512 vectors), D=16384 bfloat16, D=9001 (scalar, > 16 x 512);
  every dtype, vectors and scalar: D=8200 and 8209; rows over a cluster launched in clusters of 2-8 such groups
  (the groups walk rows in lockstep, the last walk partly idle)
- 16-byte vectors: float32 (4), float16/bfloat16 (8), float64 (2); the scalar path: odd/prime D
  (7, 1021, 9001) and unaligned pointers (a view starting one element in)
- the weight-gradient partial sums over many slots with many rows each: M=1500 and M=600; there the forward's
  blocks (one wave) reuse their shared copy of the weight and bias for many rows, and without room for that
  copy they read global memory
- M=0 and M=1; every dtype, mixed precision, with and without weight and bias
- the fused residual add (add_layer_norm/add_rms_norm) over the same plans, with a float32 residual stream
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re

import emulated_build as build
import pytest
import torch
import torch.nn.functional as F

from torch_ln import reference

SANITIZED = build.load()
ops = torch.ops.torch_ln_emulated

# Forward and backward errors against a float64 reference may be at most twice
# torch's own CPU error in the same dtype, plus this floor: the floor covers
# outputs where torch happens to be exact (error 0) while a different but
# equally valid summation order rounds once (half an ulp of a result near 1-4).
FLOOR = {torch.float32: 1e-6, torch.float64: 1e-13, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Weight/bias gradients sum M rows: rounding grows with sqrt(M) in the worst order.
GRAD_PARAM_FLOOR_PER_SQRT_ROW = {torch.float32: 1e-6, torch.float64: 1e-13, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _random(n, generator, dtype, offset=0):
    """n values starting `offset` elements into a fresh allocation."""
    return torch.randn(n + offset, generator=generator, dtype=torch.float64).to(dtype)[offset:]


def _inputs(rows, cols, dtype, param_dtype, affine, unaligned=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = _random(rows * cols, g, dtype, offset=int("input" in unaligned)).view(rows, cols)
    weight = _random(cols, g, param_dtype, offset=int("weight" in unaligned)) if affine[0] else None
    bias = torch.randn(cols, generator=g, dtype=torch.float64).to(param_dtype) if affine[1] else None
    dy = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(dtype)
    return x, weight, bias, dy


def _grads_of(fn, x, weight, bias, dy):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def _torch_norm(kind, eps):
    if kind == "layer":
        return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, eps)
    return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, eps)


def _emulated(kind, x, weight, bias, dy, eps, mask=(True, True, True), from_output=False, **rounding):
    """Forward and backward through the emulated kernels: y, dx, dweight, dbias, and the statistics.
    `rounding`: weight_offset (both kinds) and round_normalized (rms_norm). from_output: the backward reads y
    (memory_efficient's), not x."""
    shape = [x.shape[-1]]
    if kind == "layer":
        y, mean, rstd = ops.layer_norm_fwd(x, shape, weight, bias, eps, **rounding)
        rows = y if from_output else x
        dx, dw, db = ops.layer_norm_bwd(
            dy, rows, shape, mean, rstd, weight, bias, list(mask), **rounding, from_output=from_output
        )
        return [y, dx, dw, db], (mean, rstd)
    y, rstd = ops.rms_norm_fwd(x, shape, weight, eps, **rounding)
    rows = y if from_output else x
    dx, dw = ops.rms_norm_bwd(dy, rows, shape, rstd, weight, list(mask[:2]), **rounding, from_output=from_output)
    return [y, dx, dw, None], (rstd,)


def _emulated_forward(kind, x, weight, bias, eps):
    if kind == "layer":
        return ops.layer_norm_fwd(x, [x.shape[-1]], weight, bias, eps)[0]
    return ops.rms_norm_fwd(x, [x.shape[-1]], weight, eps)[0]


def _check_against_torch(kind, x, weight, bias, dy, eps=1e-5, from_output=False, **rounding):
    """The emulated kernels against torch, or with `rounding` against autograd of torch_ln.reference (the rounding
    model) in the input's precision; each within 2x the yardstick's error from float64 plus a floor. from_output:
    the backward from y, as memory_efficient's."""
    ours, stats = _emulated(kind, x, weight, bias, dy, eps, from_output=from_output, **rounding)
    fn = _torch_norm(kind, eps)
    if rounding and kind == "layer":
        fn = lambda x, w, b: reference.layer_norm(x, x.shape[-1:], w, b, eps, **rounding)
    elif rounding:
        fn = lambda x, w, b: reference.rms_norm(x, x.shape[-1:], w, eps, **rounding)
    # torch's CPU backward rejects a float32 bias with no weight beside a half input;
    # a weight of ones gives it the same computation.
    torch_weight = weight
    if weight is None and bias is not None and bias.dtype != x.dtype:
        torch_weight = torch.ones_like(bias)
    theirs = _grads_of(fn, x, torch_weight, bias, dy)
    theirs[2] = None if weight is None else theirs[2]
    exact = _grads_of(fn, x.double(), *(t.double() if t is not None else None for t in (weight, bias, dy)))
    names = ["y", "dx", "dweight", "dbias"]
    rows = x.shape[0]
    for name, o, t, e in zip(names, ours, theirs, exact):
        if e is None:
            continue
        assert o is not None and o.dtype == t.dtype and o.shape == t.shape, name
        floor = FLOOR[x.dtype] if name in ("y", "dx") else GRAD_PARAM_FLOOR_PER_SQRT_ROW[x.dtype] * max(1, rows) ** 0.5
        # Parameter gradients have the parameter's dtype: float32 ones get float32's floor.
        if o.dtype == torch.float32 and name in ("dweight", "dbias"):
            floor = FLOOR[torch.float32] * max(1, rows) ** 0.5
        err_ours = (o.double() - e).abs().max().item() if o.numel() else 0.0
        err_torch = (t.double() - e).abs().max().item() if t.numel() else 0.0
        assert err_ours <= 2 * err_torch + floor, f"{name}: error {err_ours:.3g} vs torch's {err_torch:.3g}"
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert all(s.dtype == acc and s.numel() == rows for s in stats)
    return ours


DTYPES = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),  # mixed precision
    (torch.bfloat16, torch.float32),  # mixed precision
]
# (weight, bias) present: every combination for LayerNorm; RMSNorm has no bias.
KIND_AFFINE = [("layer", (w, b)) for w in (True, False) for b in (True, False)] + [
    ("rms", (True, False)),
    ("rms", (False, False)),
]


@pytest.mark.parametrize("kind,affine", KIND_AFFINE)
@pytest.mark.parametrize("dtype,param_dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,cols",
    [
        (3, 1),  # D=1: the variance is exactly 0
        (5, 7),  # odd: the scalar path, several rows per warp
        (33, 64),  # short rows in vectors, tpr < 32; 33 rows leave a partial tile
        (6, 1024),  # a warp per row (float32), 4 rows per block
        (1, 1021),  # prime D on the scalar path, M = 1
    ],
)
def test_layouts_every_dtype(kind, affine, dtype, param_dtype, rows, cols):
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, affine)
    _check_against_torch(kind, x, weight, bias, dy)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,rows,cols",
    [
        (torch.float32, 3, 2048),  # several warps per row, 2 rows per block: cross-warp reduction
        (torch.bfloat16, 2, 4096),  # a block of 128 threads per row
        (torch.float32, 2, 9000),  # backward multi-pass (more than 2048 vectors), forward in registers
        (torch.bfloat16, 2, 16384),  # backward multi-pass with 16-byte vectors of 8
        (torch.float32, 2, 40000),  # forward multi-pass too
        (torch.float32, 2, 9001),  # backward multi-pass on the scalar path (prime D)
        (torch.float32, 1, 33001),  # forward multi-pass on the scalar path
    ],
)
def test_long_rows(kind, dtype, rows, cols):
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    _check_against_torch(kind, x, weight, bias, dy)


# D just past every register tier, in 16-byte vectors of every dtype and on the scalar path (a prime D), so that
# every dtype's kernels for longer rows run. The forward keeps 32 float32 (16 float64) values a thread x 512 threads
# in registers, 8 on the scalar path: 16392 = 8 * 2049 and the prime 16411. The backward keeps 16 (8): 8200 = 8 * 1025
# and the prime 8209; a backward call also runs the forward and the reduce (2 x D / 32 blocks: slow to emulate),
# so the backward cases are the shortest rows that reach its long-row paths.
FORWARD_LONG_COLS = [16392, 16411]
BACKWARD_LONG_COLS = [8200, 8209]


@contextlib.contextmanager
def _device(shared=None, cluster=None, sms=2, threads=2048, shared_per_sm=None):
    """The emulated device (`sms` SMs of `threads` threads) with `shared` bytes of shared memory a block and clusters
    of up to `cluster` blocks (None: an sm_90's 227 KB and 8); `shared_per_sm` bytes of shared memory an SM bound its
    resident blocks (None: threads alone do)."""
    ops.set_device(sms, threads, shared, cluster, shared_per_sm)
    try:
        yield
    finally:
        ops.set_device(2, 2048)


# A GPU without clusters (sm_80): 163 KB of shared memory a block.
SM80 = {"shared": 163 * 1024, "cluster": 1}


# The forward's paths for rows too long for registers, and the emulated devices that take them at D=16392/16411:
# shared memory (an sm_90), and the multi-pass path (a device whose shared memory holds no such row, no clusters).
FORWARD_LONG_PATHS = {"shared": {}, "multipass": {"shared": 1024, "cluster": 1}}


def _forward_kernel(kind, x, weight, bias, residual=None, residual_dtype=None):
    """y (and residual_out with a residual) from the emulated forward, and the row kernel's launch record."""
    shape = [x.shape[-1]]
    ops.set_counting(True)
    try:
        if residual is None:
            out = [_emulated_forward(kind, x, weight, bias, 1e-5)]
        elif kind == "layer":
            out = ops.add_layer_norm_fwd(x, residual, shape, weight, bias, 1e-5, residual_dtype)[:2]
        else:
            out = ops.add_rms_norm_fwd(x, residual, shape, weight, 1e-5, residual_dtype)[:2]
    finally:
        ops.set_counting(False)
    return out, json.loads(ops.take_launch_log())[0]


def _forward_quant(kind, x, weight, bias):
    """The quantized forward (float8_e4m3fn, per-row scales; the kernels' QUANTIZED instances): y, codes and scales,
    and the row kernel's launch record."""
    cols = x.shape[-1]
    quant = {"out_dtype": torch.float8_e4m3fn, "return_unquantized": True}
    ops.set_counting(True)
    try:
        if kind == "layer":
            q, scales, y = ops.layer_norm_quant(x, [cols], weight, bias, 1e-5, **quant)
        else:
            q, scales, y = ops.rms_norm_quant(x, [cols], weight, 1e-5, **quant)
    finally:
        ops.set_counting(False)
    return [y, q.view(torch.uint8), scales], json.loads(ops.take_launch_log())[0]


def _check_forward(kind, x, weight, bias, y):
    """y against torch per the accuracy rule: at most twice torch's error from float64 in the same dtype, plus the
    floor."""
    ref = _torch_norm(kind, 1e-5)
    exact = ref(x.double(), *(t.double() if t is not None else None for t in (weight, bias)))
    err_ours = (y.double() - exact).abs().max().item()
    err_torch = (ref(x, weight, bias).double() - exact).abs().max().item()
    assert err_ours <= 2 * err_torch + FLOOR[x.dtype], f"error {err_ours:.3g} vs torch's {err_torch:.3g}"


@pytest.mark.parametrize("path", FORWARD_LONG_PATHS)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,param_dtype", DTYPES)
@pytest.mark.parametrize("cols", FORWARD_LONG_COLS)
def test_forward_long_rows_every_dtype(path, kind, dtype, param_dtype, cols):
    x, weight, bias, _ = _inputs(2, cols, dtype, param_dtype, (True, kind == "layer"))
    with _device(**FORWARD_LONG_PATHS[path]):
        (y,), launch = _forward_kernel(kind, x, weight, bias)
    assert path in launch["kernel"]
    _check_forward(kind, x, weight, bias, y)


def _acc_bytes(dtype):
    return 8 if dtype == torch.float64 else 4


def _reread_device(cols, dtype, grads, with_weight=False, param_dtype=None):
    """A device without clusters whose blocks hold the backward's `grads` gradient sums of a row of `cols` (and the
    weight beside them if `with_weight`) but not the row: the shared-memory backward reads each row twice. 1 KB covers
    the rounding, the partial sums and the row-sum scratch; the row needs at least 2 x 2 bytes an element more."""
    weight_bytes = with_weight * (param_dtype or dtype).itemsize
    return _device(shared=cols * (grads * _acc_bytes(dtype) + weight_bytes) + 1024, cluster=1)


# The backward's paths for rows too long for registers, and the emulated devices that take them at D=8200/8209
# (with the weight, and the gradients of weight and bias asked for): the row and the weight in one block's shared
# memory (an sm_90; float64 rows take a cluster of 2), the gradient sums alone on chip and the row read twice, and
# the multi-pass path (a device whose shared memory holds not even the sums, no clusters).
BACKWARD_LONG_PATHS = {
    "shared": lambda cols, dtype, grads: _device(),
    "reread": _reread_device,
    "multipass": lambda cols, dtype, grads: _device(shared=1024, cluster=1),
}


def _backward_kernel(kind, x, weight, bias, dy, mask=(True, True, True), check=True):
    """The emulated forward and backward (checked against torch where `check`), and the backward row kernel's launch
    record."""
    ops.set_counting(True)
    try:
        if check:
            ours = _check_against_torch(kind, x, weight, bias, dy)
        else:
            ours, _ = _emulated(kind, x, weight, bias, dy, 1e-5, mask)
    finally:
        ops.set_counting(False)
    log = json.loads(ops.take_launch_log())
    return ours, next(launch for launch in log if "norm_backward" in launch["kernel"])


@pytest.mark.parametrize("path", BACKWARD_LONG_PATHS)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,param_dtype", DTYPES)
@pytest.mark.parametrize("cols", BACKWARD_LONG_COLS)
def test_backward_long_rows_every_dtype(path, kind, dtype, param_dtype, cols):
    x, weight, bias, dy = _inputs(2, cols, dtype, param_dtype, (True, kind == "layer"))
    grads = 1 + (kind == "layer")
    with BACKWARD_LONG_PATHS[path](cols, dtype, grads):
        _, launch = _backward_kernel(kind, x, weight, bias, dy)
    assert ("shared" if path == "reread" else path) in launch["kernel"]
    row_bytes = cols * (dtype.itemsize + dtype.itemsize)  # x and dy
    assert path != "reread" or launch["dynamic_smem"] < row_bytes + cols * grads * _acc_bytes(dtype)
    assert path != "shared" or launch["dynamic_smem"] * launch["cluster"] >= row_bytes + cols * param_dtype.itemsize


@pytest.mark.parametrize("path", BACKWARD_LONG_PATHS)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_long_rows_without_weight_or_dx(path, kind):
    # The long-row kernels' arms without a weight, without dx (only the parameter gradients), and (LayerNorm)
    # with the bias gradient alone, or the weight gradient alone.
    cols = BACKWARD_LONG_COLS[0]
    x, weight, bias, dy = _inputs(2, cols, torch.float32, torch.float32, (False, kind == "layer"))
    with BACKWARD_LONG_PATHS[path](cols, torch.float32, int(kind == "layer")):
        _check_against_torch(kind, x, weight, bias, dy)
    x, weight, bias, dy = _inputs(2, cols, torch.float32, torch.float32, (True, kind == "layer"))
    with BACKWARD_LONG_PATHS[path](cols, torch.float32, 1 + (kind == "layer")):
        full, _ = _emulated(kind, x, weight, bias, dy, 1e-5)
        no_dx, _ = _emulated(kind, x, weight, bias, dy, 1e-5, mask=(False, True, True))
        dx_and_dbias, _ = _emulated(kind, x, weight, bias, dy, 1e-5, mask=(True, False, True))
        dx_and_dweight, _ = _emulated(kind, x, weight, bias, dy, 1e-5, mask=(True, True, False))
    assert no_dx[1].numel() == 0 and torch.equal(no_dx[2], full[2])
    assert no_dx[3] is None or torch.equal(no_dx[3], full[3])
    assert torch.equal(dx_and_dbias[1], full[1]) and dx_and_dbias[2].numel() == 0
    assert dx_and_dbias[3] is None or torch.equal(dx_and_dbias[3], full[3])
    assert torch.equal(dx_and_dweight[1], full[1]) and torch.equal(dx_and_dweight[2], full[2])
    assert dx_and_dweight[3] is None or dx_and_dweight[3].numel() == 0


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_long_rows_no_rows(kind):
    # M = 0 on the shared-memory path: every block writes its zero partial sums.
    x, weight, bias, dy = _inputs(0, BACKWARD_LONG_COLS[0], torch.float32, torch.float32, (True, kind == "layer"))
    (_, dx, dw, db), _ = _emulated(kind, x, weight, bias, dy, 1e-5)
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(weight))
    assert db is None or torch.equal(db, torch.zeros_like(bias))


def _backward_cluster_device(cols, dtype, cluster, param_dtype, grads, max_cluster=None):
    """A device whose blocks hold 1/cluster of a row of `cols` elements of `dtype` (x and dy), of the weight and of
    `grads` gradient sums, and no more: the backward splits such rows over a cluster of `cluster` blocks. Its
    clusters have up to `max_cluster` blocks (None: `cluster`, so the rows' clusters are not grouped)."""
    per_elem = 2 * dtype.itemsize + param_dtype.itemsize + grads * _acc_bytes(dtype)
    return _device(shared=-(-cols // cluster) * per_elem + 1024, cluster=max_cluster or cluster)


@pytest.mark.parametrize("cluster", [2, 4, 8, 16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,param_dtype,rows,cols",
    [
        (torch.float32, torch.float32, 3, 8200),  # 16-byte vectors; 3 rows: the 2-SM device's clusters walk rows
        (torch.bfloat16, torch.float32, 2, 8200),  # 32-byte gradient-sum and parameter vectors
        (torch.float64, torch.float64, 2, 8200),  # double sums through the cluster; 16-byte vectors of 2
        (torch.float32, torch.float32, 1, 8209),  # the scalar path (prime D), the last slice shorter; M = 1
    ],
)
def test_backward_cluster_sizes(cluster, kind, dtype, param_dtype, rows, cols):
    # Every cluster size (16: sm_90's non-portable one): each block's slice of x, dy, the weight and the gradient
    # sums on chip; the row sums through distributed shared memory in rank order.
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    with _backward_cluster_device(cols, dtype, cluster, param_dtype, 1 + (kind == "layer")):
        _, launch = _backward_kernel(kind, x, weight, bias, dy)
    assert "shared" in launch["kernel"] and launch["cluster"] == cluster


@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,param_dtype,rows,cols",
    [
        (torch.float32, torch.float32, 20, 8192),  # a block per row: each block's own row on chip, then the cluster's
        (torch.bfloat16, torch.bfloat16, 40, 4096),  # 2 rows a block
        (torch.float32, torch.float32, 70, 1024),  # 4 rows a block: their rows added first; the last tile partial
        (torch.float16, torch.float32, 41, 1021),  # the scalar path (prime D); mixed precision
    ],
)
def test_backward_partial_clusters(cluster, kind, dtype, param_dtype, rows, cols):
    # The register backward's blocks add their partial rows over a thread-block cluster (of up to `cluster`, the
    # device's largest) in rank order through distributed shared memory, so the reduce reads one row per cluster.
    # A device of 4 SMs holds two clusters of 8.
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    with _device(cluster=cluster, sms=4):
        _, launch = _backward_kernel(kind, x, weight, bias, dy)
        plan = ops.plan("bwd", rows, cols, dtype.itemsize, cols * dtype.itemsize % 16 == 0, 0, 1 + (kind == "layer"))
    assert "norm_backward_kernel" in launch["kernel"] and plan[9] == launch["cluster"] == cluster
    assert launch["grid"] % cluster == 0 and launch["grid"] > cluster  # several clusters: partial rows to reduce


@pytest.mark.parametrize(
    "group,dtype,param_dtype,cols",
    [
        (2, torch.float32, torch.float32, 8200),
        (4, torch.float32, torch.float32, 8200),
        *[(8, dtype, param_dtype, 8200) for dtype, param_dtype in DTYPES if dtype != torch.float64],
        (8, torch.float32, torch.float32, 8209),  # the scalar path (prime D)
        (8, torch.bfloat16, torch.float32, 8209),  # the scalar path, mixed precision
    ],
)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_shared_row_partial_clusters(group, dtype, param_dtype, cols, kind):
    # Rows one block's shared memory holds (the device's sized for the row): blocks that each walk whole rows add
    # their gradient sums over a cluster of `group` in rank order, so each cluster writes one partial row. Every
    # dtype pair (float64 keeps a partial row per block: test_backward_float64_without_partial_clusters).
    rows = 20
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    grads = 1 + (kind == "layer")
    per_elem = 2 * dtype.itemsize + param_dtype.itemsize + grads * _acc_bytes(dtype)  # x, dy, the weight, the sums
    with _device(shared=cols * per_elem + 1024, cluster=group, sms=4):
        _, launch = _backward_kernel(kind, x, weight, bias, dy)
    assert "shared" in launch["kernel"] and launch["cluster"] == group
    assert launch["grid"] % group == 0 and launch["grid"] > group


@pytest.mark.parametrize(
    "row_cluster,groups,dtype,param_dtype,rows,cols",
    [
        (2, 4, torch.float32, torch.float32, 11, 8200),  # 11 rows, 4 groups: the last walk leaves a group idle
        (4, 4, torch.bfloat16, torch.float32, 9, 8200),  # a cluster of 16 (sm_90's non-portable); mixed precision
        (8, 2, torch.float16, torch.float16, 3, 8200),  # 3 rows: the second group takes one, then idles
        (2, 8, torch.float32, torch.float32, 8, 8209),  # the scalar path (prime D), the last slice shorter
        # 16-bit LayerNorm slices of 5 rounds: its sums in shared memory beside bulk loads (no held-sums instance
        # holds them), a group idle in the last walk as in the first case; RMSNorm's held.
        (2, 4, torch.bfloat16, torch.bfloat16, 11, 40000),
    ],
)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_row_cluster_groups(row_cluster, groups, dtype, param_dtype, rows, cols, kind):
    # Rows split over `row_cluster` blocks, launched in clusters of `groups` such groups (the device's largest
    # cluster): the groups walk their own rows in lockstep (every row sum's barrier is the whole cluster's), the row
    # sums go over each group's blocks alone, and the groups' gradient sums are added in group order, so a cluster
    # writes one partial row. Checked against torch, every gradient.
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    grads = 1 + (kind == "layer")
    with _backward_cluster_device(cols, dtype, row_cluster, param_dtype, grads, max_cluster=row_cluster * groups):
        _, launch = _backward_kernel(kind, x, weight, bias, dy)
    assert "shared" in launch["kernel"] and launch["cluster"] == row_cluster * groups
    assert launch["grid"] % launch["cluster"] == 0


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_row_cluster_groups_deterministic_and_batch_invariant(kind):
    # Rows over a cluster of 2 blocks, in clusters of 4 such groups: row 5 alone (one group), in batches of 6 and 13
    # (the emulated device holds one cluster: its groups walk 2 and 4 rows each, the last walk partly idle), dx
    # bitwise the same; the batch of 13 again: every output bitwise the same.
    cols = BACKWARD_LONG_COLS[0]
    grads = 1 + (kind == "layer")
    x, weight, bias, dy = _inputs(13, cols, torch.float32, torch.float32, (True, kind == "layer"))
    with _backward_cluster_device(cols, torch.float32, 2, torch.float32, grads, max_cluster=8):
        alone, launch = _backward_kernel(kind, x[5:6].clone(), weight, bias, dy[5:6].clone(), check=False)
        assert launch["cluster"] == 2
        six, _ = _backward_kernel(kind, x[:6], weight, bias, dy[:6], check=False)
        thirteen, launch = _backward_kernel(kind, x, weight, bias, dy, check=False)
        assert launch["cluster"] == launch["grid"] == 8
        again, _ = _backward_kernel(kind, x, weight, bias, dy, check=False)
    assert torch.equal(six[1][5], alone[1][0]) and torch.equal(thirteen[1][5], alone[1][0])
    for a, b in zip(thirteen, again):
        assert a is None or torch.equal(a, b)


def test_backward_float64_without_partial_clusters():
    # float64 sums stay one partial row per block (partial_clusters_for): no registers to spare in those kernels.
    x, weight, bias, dy = _inputs(70, 512, torch.float64, torch.float64, (True, True))
    with _device(sms=4):
        _, launch = _backward_kernel("layer", x, weight, bias, dy)
        plan = ops.plan("bwd", 70, 512, 8, True, 0, 2)
    assert "norm_backward_kernel" in launch["kernel"] and plan[9] == launch["cluster"] == 1


def test_backward_partial_clusters_deterministic():
    # The same sums in the same order on every run: rows in slot order, then blocks in rank order.
    x, weight, bias, dy = _inputs(70, 1024, torch.float32, torch.float32, (True, True))
    runs = [_emulated("layer", x, weight, bias, dy, 1e-5)[0] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("cols", BACKWARD_LONG_COLS)
def test_backward_reread_with_weight_on_chip(kind, cols):
    # Room for the gradient sums and the weight, not the row: the row is read twice, the weight once per block.
    # Same layout of blocks and columns as with the row on chip, so the same results, bitwise.
    x, weight, bias, dy = _inputs(3, cols, torch.float32, torch.float32, (True, kind == "layer"))
    grads = 1 + (kind == "layer")
    with _device(cluster=1):  # without clusters, as the device that reads the row twice
        on_chip, launch = _backward_kernel(kind, x, weight, bias, dy)
    assert "shared" in launch["kernel"] and launch["cluster"] == 1
    with _reread_device(cols, torch.float32, grads, with_weight=True):
        reread, launch = _backward_kernel(kind, x, weight, bias, dy)
    assert "shared" in launch["kernel"] and cols * (4 * grads + 4) <= launch["dynamic_smem"] < cols * (4 * grads + 8)
    for a, b in zip(on_chip, reread):
        assert a is None or torch.equal(a, b)


# Where each backward path begins and ends. Registers: 16 float32 or bfloat16 values a thread x 512 threads (8192),
# 8 on the scalar path (4096). On a GPU without clusters (sm_80: 163 KB a block), float32 LayerNorm with weight and
# bias: x, dy, the weight and two gradient sums (20 bytes an element) plus the row sums' 128 bytes of scratch (a block
# alone has no cluster exchange) hold (166912 - 128) // 20 = 8339 -> 8336 elements (whole vectors); without the
# weight (16 bytes) 10424; the row read twice with the weight (12 bytes) 13896, without (8 bytes) 20848; then the
# multi-pass kernel.
# (dtype, D, device, kernel, (cluster, weight on chip, row on chip) of the plan)
BACKWARD_BOUNDARIES = [
    (torch.float32, 8192, {}, "norm_backward_kernel", None),  # the last D of the register path
    (torch.float32, 8196, {}, "shared", (1, True, True)),  # the first D of the shared-memory path
    (torch.bfloat16, 8192, {}, "norm_backward_kernel", None),
    (torch.bfloat16, 8200, {}, "shared", (1, True, True)),
    (torch.float32, 4095, {}, "norm_backward_kernel", None),  # odd D: the scalar path, registers up to 4096
    (torch.float32, 4099, {}, "shared", None),  # ... and shared memory beyond (4099: the scalar path, prime)
    (torch.float32, 8336, SM80, "shared", (1, True, True)),
    (torch.float32, 8340, SM80, "shared", (1, False, True)),
    (torch.float32, 10424, SM80, "shared", (1, False, True)),
    (torch.float32, 10428, SM80, "shared", (1, True, False)),
    (torch.float32, 13896, SM80, "shared", (1, True, False)),
    (torch.float32, 13900, SM80, "shared", (1, False, False)),
    (torch.float32, 20848, SM80, "shared", (1, False, False)),
    (torch.float32, 20852, SM80, "multipass", None),
]


@pytest.mark.parametrize("dtype,cols,device,kernel,staging", BACKWARD_BOUNDARIES)
def test_backward_path_boundaries(dtype, cols, device, kernel, staging):
    x, weight, bias, dy = _inputs(1, cols, dtype, dtype, (True, True))
    with _device(**device):
        plan = ops.plan("bwd", 1, cols, dtype.itemsize, cols * dtype.itemsize % 16 == 0, 0, 2)
        _, launch = _backward_kernel("layer", x, weight, bias, dy)
    assert kernel in launch["kernel"]
    assert staging is None or (plan[5], plan[7], plan[8]) == staging


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("path", ["shared", "cluster", "reread"])
def test_backward_long_rows_deterministic_and_batch_invariant(kind, path):
    # The shared-memory backward, a block or a cluster of 4 per row, or the row read twice: row 5 alone, in batches
    # of 6 and of 12 (the emulated device holds 8 blocks: the blocks walk rows), dx bitwise the same; the batch of
    # 12 again: every output bitwise the same.
    cols = BACKWARD_LONG_COLS[0]
    grads = 1 + (kind == "layer")
    devices = {
        "shared": _device,
        "cluster": lambda: _backward_cluster_device(cols, torch.float32, 4, torch.float32, grads),
        "reread": lambda: _reread_device(cols, torch.float32, grads),
    }
    x, weight, bias, dy = _inputs(12, cols, torch.float32, torch.float32, (True, kind == "layer"))
    with devices[path]():
        alone, launch = _backward_kernel(kind, x[5:6].clone(), weight, bias, dy[5:6].clone(), check=False)
        assert "shared" in launch["kernel"] and launch["cluster"] == (4 if path == "cluster" else 1)
        six, _ = _backward_kernel(kind, x[:6], weight, bias, dy[:6], check=False)
        twelve, launch = _backward_kernel(kind, x, weight, bias, dy, check=False)
        again, _ = _backward_kernel(kind, x, weight, bias, dy, check=False)
    assert launch["grid"] == 8
    assert torch.equal(six[1][5], alone[1][0]) and torch.equal(twelve[1][5], alone[1][0])
    for a, b in zip(twelve, again):
        assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cols", [64, 1024, 9000])
@pytest.mark.parametrize("unaligned", ["input", "weight"])
def test_unaligned_pointer(kind, dtype, cols, unaligned):
    # The tensor starts one element past an allocation: 16-byte vectors would be misaligned
    # (UBSan and the GPU would fault), so the scalar path must run.
    x, weight, bias, dy = _inputs(4, cols, dtype, dtype, (True, kind == "layer"), unaligned=(unaligned,))
    _check_against_torch(kind, x, weight, bias, dy)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("rows,cols", [(1500, 64), (600, 1000)])
def test_many_slots_of_partial_sums(kind, rows, cols):
    # On the 2-SM device the backward grid is capped at one wave (e.g. 64 slots for D=1000),
    # so each slot sums many rows and the final reduction adds many slots.
    x, weight, bias, dy = _inputs(rows, cols, torch.float32, torch.float32, (True, kind == "layer"))
    _check_against_torch(kind, x, weight, bias, dy)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,param_dtype,rows,cols",
    [
        (torch.float32, torch.float32, 40, 7),  # the scalar path, many rows per block
        (torch.bfloat16, torch.float32, 9, 1024),  # 32-byte parameter vectors, kept as two 16-byte pieces
        (torch.float32, torch.float32, 3, 12288),  # a block of 512 threads a row: 96 KB of LayerNorm parameters
    ],
)
def test_forward_parameters_without_room_in_shared_memory(kind, dtype, param_dtype, rows, cols):
    # Where the block's copy of the weight and bias does not fit the device's shared memory, or would lower the
    # occupancy (GPUs with less shared memory than sm_90), the rows read them from global memory: the same
    # results, bitwise. The emulated device with too little shared memory takes that path.
    x, weight, bias, _ = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    parameter_bytes = (1 + (kind == "layer")) * cols * param_dtype.itemsize
    (staged,), launch = _forward_kernel(kind, x, weight, bias)
    assert launch["dynamic_smem"] >= parameter_bytes
    with _device(shared=parameter_bytes - 1):
        (unstaged,), launch = _forward_kernel(kind, x, weight, bias)
    assert launch["dynamic_smem"] < parameter_bytes
    assert torch.equal(staged, unstaged)


@pytest.mark.parametrize("kind,affine", KIND_AFFINE[:3] + KIND_AFFINE[4:5])
@pytest.mark.parametrize(
    "dtype,param_dtype,cols",
    [
        (torch.float32, torch.float32, 16392),  # 16-byte vectors
        (torch.bfloat16, torch.float32, 16392),  # 32-byte parameter vectors, kept as two 16-byte pieces
        (torch.float32, torch.float32, 16411),  # the scalar path (prime D)
    ],
)
def test_forward_shared_row_parameters_without_room(kind, affine, dtype, param_dtype, cols):
    # The shared-memory path keeps its slice of the weight and bias beside the row where they fit (an sm_90 here);
    # on a device without clusters whose shared memory holds the row alone, it reads them from global memory, with
    # the same block per row: the same results, bitwise.
    x, weight, bias, _ = _inputs(3, cols, dtype, param_dtype, affine)
    row_bytes = cols * dtype.itemsize
    (staged,), launch = _forward_kernel(kind, x, weight, bias)
    assert "shared" in launch["kernel"] and launch["cluster"] == 1
    assert launch["dynamic_smem"] >= row_bytes + (weight is not None or bias is not None) * cols * param_dtype.itemsize
    with _device(shared=row_bytes + 1024, cluster=1):
        (unstaged,), launch = _forward_kernel(kind, x, weight, bias)
    assert "shared" in launch["kernel"] and launch["dynamic_smem"] < row_bytes + 1024
    assert torch.equal(staged, unstaged)
    _check_forward(kind, x, weight, bias, staged)


def _cluster_device(cols, dtype, cluster, param_bytes_per_elem=0, max_cluster=None):
    """A device whose blocks hold 1/cluster of a row of `cols` elements of `dtype` (and `param_bytes_per_elem` of
    weight and bias an element) and no more, with clusters of up to `max_cluster` blocks (None: sm_90's portable 8):
    the forward stages such rows over a cluster of `cluster` blocks. 1 KB covers the rounding, the partial sums and
    the row-sum scratch; half the cluster would need about twice."""
    return _device(shared=-(-cols // cluster) * (dtype.itemsize + param_bytes_per_elem) + 1024, cluster=max_cluster)


@pytest.mark.parametrize("cluster", [2, 4, 8, 16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,param_dtype,rows,cols",
    [
        (torch.float32, torch.float32, 3, 16392),  # 16-byte vectors
        (torch.bfloat16, torch.float32, 1, 16392),  # 32-byte parameter vectors; M = 1
        (torch.float32, torch.float32, 2, 16411),  # the scalar path (prime D): the last slice is shorter
        (torch.float64, torch.float64, 2, 16390),  # double sums through the cluster; 16-byte vectors of 2
        (torch.float16, torch.float16, 1, 16392),  # half rows kept in shared memory as half
    ],
)
def test_forward_cluster_sizes(cluster, kind, dtype, param_dtype, rows, cols):
    # Every cluster size, the blocks' slices of the weight and bias on chip; the row sums through distributed
    # shared memory.
    x, weight, bias, _ = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    param_bytes = (1 + (kind == "layer")) * param_dtype.itemsize
    # 16: sm_90's non-portable cluster size, on a device that allows it (as an H100/H200 where the kernel opts in).
    with _cluster_device(cols, dtype, cluster, param_bytes, max_cluster=16):
        (y,), launch = _forward_kernel(kind, x, weight, bias)
    assert "shared" in launch["kernel"] and launch["cluster"] == cluster
    _check_forward(kind, x, weight, bias, y)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_forward_cluster_without_room_for_parameters(kind):
    # A cluster of 8 holds the row but not the weight and bias beside it: they are read from global memory.
    x, weight, bias, _ = _inputs(2, 16392, torch.float32, torch.float32, (True, kind == "layer"))
    with _cluster_device(16392, torch.float32, 8):
        (y,), launch = _forward_kernel(kind, x, weight, bias)
    assert "shared" in launch["kernel"] and launch["cluster"] == 8
    assert launch["dynamic_smem"] < 16392 * 4 // 8 + 1024
    _check_forward(kind, x, weight, bias, y)


# Where each path begins and ends. Registers: 32 float32 or bfloat16 values a thread x 512 threads (16384), 8 on the
# scalar path (4096). One block's shared memory on a GPU without clusters (sm_80: 163 KB): the row rounded up to
# 16 bytes plus the row sums' 128 bytes of scratch (a block alone has no cluster exchange), so float32 rows up to
# (166912 - 128) // 4 = 41696 elements (exactly the limit).
BOUNDARIES = [
    (torch.float32, 16384, {}, "norm_forward_kernel"),  # the last D of the register path
    (torch.float32, 16388, {}, "shared"),  # the first D of the shared-memory path
    (torch.bfloat16, 16384, {}, "norm_forward_kernel"),
    (torch.bfloat16, 16392, {}, "shared"),
    (torch.float32, 4095, {}, "norm_forward_kernel"),  # odd D: the scalar path, registers up to 4096
    (torch.float32, 4099, {}, "shared"),  # ... and shared memory beyond (4099: the scalar path, prime)
    (torch.float32, 41696, SM80, "shared"),  # the longest float32 row in one block without clusters
    (torch.float32, 41700, SM80, "multipass"),  # ... one vector more: the multi-pass path
]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,cols,device,kernel", BOUNDARIES)
def test_forward_path_boundaries(kind, dtype, cols, device, kernel):
    x, weight, bias, _ = _inputs(1, cols, dtype, dtype, (True, kind == "layer"))
    with _device(**device):
        (y,), launch = _forward_kernel(kind, x, weight, bias)
    assert kernel in launch["kernel"]
    _check_forward(kind, x, weight, bias, y)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_forward_shared_row_unaligned(kind):
    # A row starting one element past its allocation: the shared-memory path's scalar kernel.
    x, weight, bias, _ = _inputs(2, 20000, torch.float32, torch.float32, (True, kind == "layer"), ("input",))
    (y,), launch = _forward_kernel(kind, x, weight, bias)
    assert "shared" in launch["kernel"] and "Li1E" in launch["kernel"]  # VEC = 1
    _check_forward(kind, x, weight, bias, y)


# The forward's long-row paths with a residual add, for every dtype pair whose normalized rows are float32 beside
# half/bfloat16 input (their own kernel instances): shared memory, a cluster of 4, multi-pass.
LONG_ROW_ADD_PATHS = {
    "shared": lambda cols, param_bytes: _device(),
    "cluster": lambda cols, param_bytes: _cluster_device(cols, torch.float32, 4, param_bytes),
    "multipass": lambda cols, param_bytes: _device(**FORWARD_LONG_PATHS["multipass"]),
}


@pytest.mark.parametrize("path", LONG_ROW_ADD_PATHS)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,param_dtype", DTYPES[2:])
@pytest.mark.parametrize("cols", FORWARD_LONG_COLS)
def test_forward_long_rows_residual_add(path, kind, dtype, param_dtype, cols):
    """residual_out (float32) bitwise torch's add; y within FLOOR of the emulated plain norm of residual_out on the
    same path, which differs only in rounding once instead of twice (as test_residual_add_reduced_precision)."""
    x, weight, bias, _ = _inputs(2, cols, dtype, param_dtype, (True, kind == "layer"))
    residual = torch.randn(2, cols, generator=torch.Generator().manual_seed(7), dtype=torch.float64).float()
    with LONG_ROW_ADD_PATHS[path](cols, (1 + (kind == "layer")) * param_dtype.itemsize):
        (y, h), launch = _forward_kernel(kind, x, weight, bias, residual, torch.float32)
        plain = _emulated_forward(kind, h, *(t.float() if t is not None else None for t in (weight, bias)), 1e-5)
    assert (path if path != "cluster" else "shared") in launch["kernel"]
    assert path != "cluster" or launch["cluster"] == 4
    assert torch.equal(h, x.float() + residual)
    torch.testing.assert_close(y, plain.to(dtype), atol=FLOOR[dtype], rtol=FLOOR[dtype])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_no_rows(kind):
    x, weight, bias, dy = _inputs(0, 16, torch.float32, torch.float32, (True, kind == "layer"))
    (y, dx, dw, db), _ = _emulated(kind, x, weight, bias, dy, 1e-5)
    assert y.shape == (0, 16) and dx.shape == (0, 16)
    assert torch.equal(dw, torch.zeros(16))
    assert db is None or torch.equal(db, torch.zeros(16))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_output_mask(kind):
    x, weight, bias, dy = _inputs(8, 64, torch.float32, torch.float32, (True, kind == "layer"))
    full, _ = _emulated(kind, x, weight, bias, dy, 1e-5)
    only_dx, _ = _emulated(kind, x, weight, bias, dy, 1e-5, mask=(True, False, False))
    only_dw, _ = _emulated(kind, x, weight, bias, dy, 1e-5, mask=(False, True, False))
    assert torch.equal(only_dx[1], full[1]) and only_dx[2].numel() == 0
    assert only_dw[1].numel() == 0 and torch.equal(only_dw[2], full[2])


def _rows_for(cols):
    """Enough rows for several grid-stride passes and slots, capped so long rows stay quick to emulate."""
    return min(300, 200_000 // cols)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("cols", [64, 1024, 9000])
def test_deterministic(kind, cols):
    x, weight, bias, dy = _inputs(_rows_for(cols), cols, torch.float32, torch.float32, (True, kind == "layer"))
    first, _ = _emulated(kind, x, weight, bias, dy, 1e-5)
    second, _ = _emulated(kind, x, weight, bias, dy, 1e-5)
    for a, b in zip(first, second):
        assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,cols,prefetches",
    [
        (torch.bfloat16, 4096, True),  # a block a row, 4 vectors a thread (64 bytes as stored): prefetches
        (torch.float32, 64, True),  # 4 rows a warp (8 threads each), 16 a block, 2 vectors a thread
        (torch.float32, 1024, False),  # 8 vectors a thread (128 bytes): too many registers to prefetch
        (torch.float32, 1001, True),  # the scalar path: 8 scalars a thread, 32 bytes
    ],
)
def test_forward_prefetch_walks_rows(kind, dtype, cols, prefetches):
    # Regression guard for the forward register kernel's prefetch (it issues the next tile's loads before this
    # tile's reductions): on a device that holds one block, which walks every tile, 37 rows (prime: where rows
    # share a block, the last tile is partly idle) come out bitwise as each row alone, and within the accuracy rule
    # against torch's.
    rows = 37
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan(
        "fwd", rows, cols, dtype.itemsize, cols * dtype.itemsize % 16 == 0
    )
    assert (items * vec * dtype.itemsize <= 64) == prefetches  # kPrefetchBytes (csrc/cuda/launch_plan.h)
    with _device(sms=1):
        ops.set_device(1, threads_per_row * rows_per_block)  # one block resident: the grid is one block
        (walked,), launch = _forward_kernel(kind, x, weight, bias)
        assert launch["grid"] == 1 and rows > rows_per_block
        for r in (0, 17, rows - 1):
            (alone,), _ = _forward_kernel(kind, x[r : r + 1].clone(), weight, bias)
            assert torch.equal(walked[r], alone[0]), f"row {r}"
    _check_against_torch(kind, x, weight, bias, dy)


# The shared-memory forward's bulk loads (SliceRing, csrc/cuda/shared_vectors.cuh; sm_90 only, every slice:
# launch_plan.h's bulk_loads): the slice in 4 chunks of whole rounds of the block's 512 threads, each refilled with the
# block's next row once read; a slice of at most 8 rounds (kept) is read once into registers and every chunk refilled
# right after. Devices: None, the default sm_90 (227 KB a block).
BULK_RING_CASES = [
    (torch.float32, 20000, True, None),  # kept: a cluster of 2, 2500 vectors a block (5 rounds), chunks of 1024
    (torch.bfloat16, 20000, True, None),  # kept: a block of 2500 8-element vectors; chunk 3 short, chunk 4 empty
    (torch.float64, 10000, True, None),  # kept: a cluster of 2, 2500 2-element vectors a block
    (torch.float32, 20000, False, 64 * 1024),  # kept: no weight; a cluster of 2 of 64 KB
    (torch.float32, 16392, True, None),  # a block: 4098 vectors, chunks of 1536, the last of the four empty
    (torch.float64, 8200, True, None),  # 2-element vectors: 4100 a block
    (torch.bfloat16, 36872, True, None),  # 8-element vectors: 4609 a block, chunks of 1536 (the third short)
    (torch.float32, 36000, False, 100 * 1024),  # no weight; a cluster of 2 of 100 KB: 4500 vectors a block
]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,cols,affine,shared,quantized",
    # float64 has no quantizing kernel instance (its quantized outputs come from the separate quantize kernel).
    [(*case, q) for case in BULK_RING_CASES for q in (False, True) if not (q and case[0] == torch.float64)],
)
def test_forward_bulk_ring_walks_rows(kind, dtype, cols, affine, shared, quantized):
    # Regression guard for the bulk loads: one cluster resident, which walks 11 rows (each chunk refilled with the
    # next row's once every thread has released it, at once where the slice is kept in registers; the quantized
    # epilogue refills the slice whole), comes out bitwise as each row alone (no refill) and, with a block a row, as a
    # device without bulk loads (no clusters: sm_80, the slice staged through registers), which takes 64 bytes less
    # shared memory (the 4 chunks' full and empty mbarriers).
    rows = 11
    x, weight, bias, _ = _inputs(rows, cols, dtype, dtype, (affine, affine and kind == "layer"))
    params = (2 if kind == "layer" else 1) if affine else 0
    with _device(shared=shared):
        *_, cluster = ops.plan("fwd", rows, cols, dtype.itemsize, True, 0, params)[:6]

    def forward(inputs):
        return _forward_quant(kind, inputs, weight, bias) if quantized else _forward_kernel(kind, inputs, weight, bias)

    with _device(shared=shared):
        ops.set_device(1, 512 * cluster, shared, 8)  # one cluster resident: its blocks walk every row
        walked, launch = forward(x)
        assert "shared" in launch["kernel"] and launch["grid"] == cluster and launch["cluster"] == cluster
        for r in (0, 5, rows - 1):
            alone, _ = forward(x[r : r + 1].clone())
            for w, a in zip(walked, alone):
                assert torch.equal(w[r], a[0]), f"row {r}"
    if cluster == 1:
        with _device(shared=shared, cluster=1):
            unbulked, plain = forward(x)
        assert "shared" in plain["kernel"] and launch["dynamic_smem"] - plain["dynamic_smem"] == 2 * 4 * 8
        for w, u in zip(walked, unbulked):
            assert torch.equal(w, u)
    _check_forward(kind, x, weight, bias, walked[0])


# The shared-memory backward's bulk loads (SliceRing; sm_90, slices of x and dy kept on chip: every such slice): x and
# dy in 4 chunks of whole rounds of the block's 512 threads on two mbarriers each, each refilled with the block's next
# row once the dx pass has read it (without dx: the whole slice, after one barrier). Devices: shared memory a block
# (None: the default sm_90's). Last: the gradients whose sums the held-sums instance holds in registers (launch_plan.h's
# held_gradients: LayerNorm's weight and bias up to 4 rounds, the weight's alone up to 8 for float32 rows; RMSNorm's
# weight up to 8) in the LayerNorm and the RMSNorm case, every gradient requested; 0: sums in shared memory.
BACKWARD_BULK_RING_CASES = [
    # A block: 2050 vectors (5 rounds), chunks of 1024, the fourth empty; LayerNorm's bias sums in shared memory beside
    # the weight's held ones.
    (torch.float32, 8200, True, None, (1, 1)),
    (torch.bfloat16, 8200, True, None, (2, 1)),  # 8-element vectors: 1025 a block (3 rounds), chunks of 512
    (torch.float64, 8200, True, None, (0, 0)),  # a cluster of 2 blocks of 2050 2-element vectors; float64 sums
    (torch.float32, 9000, False, None, (0, 0)),  # no weight: nothing staged beside the row, no gradient sums
    # A cluster of 2: 1025 vectors a block (3 rounds; a block's 5 rounds hold only the weight's sums in registers,
    # which leaves the bias' a room too many).
    (torch.float32, 8200, True, 100 * 1024, (2, 1)),
    (torch.bfloat16, 8200, True, 64 * 1024, (2, 1)),  # LayerNorm: a cluster of 2, 513 vectors a block (2 rounds)
]


def _held(kernel):
    """The HELD template argument of a shared-memory backward kernel's mangled name (0: its sums in shared memory)."""
    return int(re.search(r"norm_backward_shared_kernel.*?NormKindE\dELi\d+ELi(\d+)E", kernel).group(1))


def _held_over_row_bytes(kernel, dtype, cols, mask):
    """The shared memory a block's held-sums instance (a block a row) saves by storing its requested held sums over
    its slices of x and dy (held_sums_over_row: where they have the room), `mask` the outputs asked for."""
    held = _held(kernel)
    requested = int(mask[1]) + int(mask[2]) if held == 2 else int(mask[1]) if held == 1 else 0
    over_row = held * 4 <= 2 * dtype.itemsize
    vec = 16 // dtype.itemsize
    return requested * -(-cols // vec) * vec * 4 if over_row else 0


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("mask", [(True, True, True), (False, True, True), (True, False, False)])
@pytest.mark.parametrize("dtype,cols,affine,shared,held", BACKWARD_BULK_RING_CASES)
def test_backward_bulk_ring_walks_rows(kind, mask, dtype, cols, affine, shared, held):
    # Regression guard for the backward's bulk loads: two resident blocks (a cluster of 2: a row's, or two groups of
    # a block a row; or two blocks alone without parameter gradients) walk 11 rows, bitwise as each row alone (dx; no
    # refill) and, with a block a row, as a device without bulk loads (no clusters: sm_80, the slices staged through
    # registers; every gradient), which takes 64 bytes less shared memory (the mbarriers) and the rooms of the sums
    # the held-sums instances store over the row: for those (the held cases of a block a row) their gradient sums in
    # registers bitwise as those in shared memory.
    rows = 11
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, (affine, affine and kind == "layer"))

    def backward(rows_x, rows_dy):
        ops.set_counting(True)
        try:
            out, _ = _emulated(kind, rows_x, weight, bias, rows_dy, 1e-5, mask)
        finally:
            ops.set_counting(False)
        launch = next(r for r in json.loads(ops.take_launch_log()) if "norm_backward" in r["kernel"])
        return out[1:], launch

    with _device(shared=shared):
        ops.set_device(1, 1024, shared, 2)  # two blocks resident: they walk every row
        *_, cluster, _, _, on_chip, _, planned_held, _ = ops.plan(
            "bwd", rows, cols, dtype.itemsize, True, 0, (2 if kind == "layer" else 1) if affine else 0
        )
        assert on_chip, "the row on chip (with every gradient's sums): the bulk loads' slices"
        walked, launch = backward(x, dy)
        assert "shared" in launch["kernel"] and launch["grid"] == 2
        if mask == (True, True, True):
            assert _held(launch["kernel"]) == planned_held == held[kind == "rms"]
        for r in (0, 5, rows - 1):
            alone, _ = backward(x[r : r + 1].clone(), dy[r : r + 1].clone())
            assert torch.equal(walked[0][r : r + 1], alone[0]), f"dx of row {r}"
    if cluster == 1:
        with _device(cluster=1):
            ops.set_device(1, 1024, None, 1)
            unbulked, plain = backward(x, dy)
        # The bulk loads' mbarriers, less the rooms of held sums stored over the row.
        saved = _held_over_row_bytes(launch["kernel"], dtype, cols, mask)
        assert "shared" in plain["kernel"] and launch["dynamic_smem"] - plain["dynamic_smem"] == 2 * 4 * 8 - saved
        for w, u in zip(walked, unbulked):
            assert (w is None and u is None) or torch.equal(w, u)
    if mask == (True, True, True):
        with _device(shared=shared):
            ops.set_device(1, 1024, shared, 2)
            _check_against_torch(kind, x, weight, bias, dy)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,param_dtype",
    # The held-sums instances test_backward_bulk_ring_walks_rows does not launch (its weights are in x's dtype).
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)],
)
def test_backward_held_sums_every_parameter_dtype(kind, dtype, param_dtype):
    # The held-sums instances for 16-bit rows with each weight dtype, within tolerance of torch: blocks of 64 KB hold
    # the row of 8200 within 2-3 rounds of 512 threads (LayerNorm: both gradients' sums held, over a cluster of 2;
    # RMSNorm: its sums stored over the row, a block or two by the weight's size).
    rows, cols = 11, 8200
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    with _device(shared=64 * 1024):
        ops.set_device(1, 1024, 64 * 1024, 2)
        _, launch = _backward_launch_of(lambda: _emulated(kind, x, weight, bias, dy, 1e-5))
        assert _held(launch["kernel"]) == (2 if kind == "layer" else 1)
        _check_against_torch(kind, x, weight, bias, dy)


@pytest.mark.parametrize("mask", [(True, True, True), (False, True, True)])
# 20480: 2560 vectors a block, 5 rounds for every thread; 20000: 2500, 5 rounds for threads 0-451 and 4 for the rest
# (each thread's ring wraps at its own count).
@pytest.mark.parametrize("cols", [20480, 20000])
def test_backward_weight_ring(mask, cols):
    # The held-sums instance holding LayerNorm's weight sums alone, where its block has no room for its slice of the
    # weight (a cluster of 2 blocks of 4-5 rounds of 512 threads; on the H200, float32 D=262144 over 16), takes the
    # weight through a ring of 3 stages, 2, or none (read from global memory as used) by the room the block has left:
    # dx and the gradients bitwise the same each way, each row as the row alone, and within tolerance of torch. The
    # mask without dx: no second pass, so the ring turns once a row.
    rows = 11
    x, weight, bias, dy = _inputs(rows, cols, torch.float32, torch.float32, (True, True))

    def backward(rows_x, rows_dy):
        (out, _), launch = _backward_launch_of(lambda: _emulated("layer", rows_x, weight, bias, rows_dy, 1e-5, mask))
        return out[1:], launch

    by_stages = {}
    for stages, shared in ((3, 150 * 1024), (2, 140 * 1024), (0, 130 * 1024)):
        with _device(shared=shared, cluster=2, sms=1, threads=1024):  # one cluster resident: it walks every row
            *_, cluster, smem, sliced, on_chip, _, held, weight_stages = ops.plan("bwd", rows, cols, 4, True, 0, 2)
            assert (cluster, sliced, on_chip, held, weight_stages) == (2, 0, 1, 1, stages)
            by_stages[stages], launch = backward(x, dy)
            assert _held(launch["kernel"]) == 1 and launch["grid"] == 2 and launch["dynamic_smem"] == smem
            if stages == 3:
                for r in (0, 5, rows - 1):
                    alone, _ = backward(x[r : r + 1].clone(), dy[r : r + 1].clone())
                    assert mask[0] is False or torch.equal(by_stages[3][0][r : r + 1], alone[0]), f"dx of row {r}"
                if mask == (True, True, True):
                    _check_against_torch("layer", x, weight, bias, dy)
    for stages in (2, 0):
        for ringed, unringed in zip(by_stages[3], by_stages[stages]):
            assert (ringed is None and unringed is None) or torch.equal(ringed, unringed), f"{stages} stages"


# The register backward's prefetch of its next tile (TilePrefetch): tiles of each shape the register kernels take.
BACKWARD_PREFETCH_CASES = [
    (torch.float32, 1024),  # 4-element vectors: tiles of 8 rows of 64 threads, 4 vectors a thread
    (torch.bfloat16, 4096),  # 8-element vectors: tiles of 2 rows of 256 threads, 2 vectors a thread
    (torch.float16, 200),  # short rows: 25 vectors over 16 threads a row, 7 of their 32 slots beyond the row (zeros)
    (torch.float32, 4100),  # 1025 vectors over 512 threads of 4: most slots beyond the row
]


def _backward_launch_of(run):
    """run()'s outputs and its backward row kernel's launch record."""
    ops.set_counting(True)
    try:
        out = run()
    finally:
        ops.set_counting(False)
    return out, next(r for r in json.loads(ops.take_launch_log()) if "norm_backward" in r["kernel"])


def _by_prefetch_stages(launch_of, kernel, threads, stage_bytes):
    """{stages: outputs} of launch_of() (its outputs and its row kernel's launch record) on a device where one block
    of `threads` threads runs `kernel` over every tile (no clusters): with the register kernel's prefetch ring as deep
    as the device's shared memory holds, then each time on a device one byte short of the last launch's (one stage
    fewer, or no ring: it takes 2 at least). `stage_bytes`: a stage's bytes."""
    outputs, launches = [], []
    with _device(sms=1):
        budget = None
        for _ in range(3):  # 3 stages, 2, none
            ops.set_device(1, threads, budget, 1)
            out, launch = launch_of()
            assert kernel in launch["kernel"] and launch["grid"] == 1
            outputs.append(out)
            launches.append(launch)
            budget = launch["dynamic_smem"] - 1
            if len(launches) > 1 and launches[-2]["dynamic_smem"] - launch["dynamic_smem"] > stage_bytes:
                break  # the ring is gone (it had 2 stages)
    # The ring after the rest, 16-byte aligned: whole stages over the last launch's shared memory.
    plain = launches[-1]["dynamic_smem"]
    stages = [(launch["dynamic_smem"] - plain) // stage_bytes for launch in launches]
    for launch, n in zip(launches, stages):
        assert 0 <= launch["dynamic_smem"] - plain - n * stage_bytes < 16 and n in (0, 2, 3)
    assert stages[-1] == 0 and len(set(stages)) == len(stages)
    return dict(zip(stages, outputs))


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("dtype,cols", BACKWARD_PREFETCH_CASES)
def test_backward_prefetch_walks_tiles(kind, mask, dtype, cols):
    # Regression guard for the register backward's prefetch: one block walks 3 tiles and a partial fourth, each
    # thread reading its row's statistics and vectors of x and dy from the copies it made tiles ahead. Every output
    # bitwise as without the
    # prefetch (a device with no room for the ring) and as with fewer stages, dx of a row bitwise as the row alone,
    # within the accuracy rule. bfloat16 rows take 3 stages on an sm_90's 227 KB, float32's 4-vector tier 2.
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("bwd", 1, cols, dtype.itemsize, True, 0, 2)
    rows = 3 * rows_per_block + 3
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    stage = threads_per_row * rows_per_block * (items * vec * 2 * dtype.itemsize + 2 * 4)

    def backward(rows_x=x, rows_dy=dy):
        return _emulated(kind, rows_x, weight, bias, rows_dy, 1e-5, mask)[0][1:]

    by_stages = _by_prefetch_stages(lambda: _backward_launch_of(backward), "norm_backward_kernel", 512, stage)
    assert set(by_stages) == ({0, 2} if (dtype, cols) == (torch.float32, 1024) else {0, 2, 3})
    prefetched = by_stages[max(by_stages)]
    for outputs in by_stages.values():
        for p, u in zip(prefetched, outputs):
            assert (p is None and u is None) or torch.equal(p, u)
    with _device(sms=1):
        ops.set_device(1, 512, None, 1)
        for r in (0, rows_per_block, rows - 1):
            alone = backward(x[r : r + 1].clone(), dy[r : r + 1].clone())
            assert (prefetched[0] is None and alone[0] is None) or torch.equal(prefetched[0][r : r + 1], alone[0])
        if mask == (True, True, True):
            _check_against_torch(kind, x, weight, bias, dy)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,cols", [(torch.bfloat16, 4096), (torch.float32, 1024)])
def test_backward_prefetch_residual_stream(kind, dtype, cols):
    # The fused add's backward prefetches its x, the residual stream (float32 beside bfloat16 inputs: 32-byte
    # vectors, two cp.async pieces each), bitwise as without the prefetch.
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("bwd", 1, cols, dtype.itemsize, True, 0, 2)
    rows = 3 * rows_per_block + 3
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    residual = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)).to(dtype)
    dh_out = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4)).to(torch.float32)
    stage = threads_per_row * rows_per_block * (items * vec * (4 + dtype.itemsize) + 2 * 4)

    def add_backward():
        return _emulated_add(kind, x, residual, weight, bias, dy, dh_out, 1e-5, torch.float32)[2:]

    by_stages = _by_prefetch_stages(lambda: _backward_launch_of(add_backward), "norm_backward_kernel", 512, stage)
    for outputs in by_stages.values():
        for p, u in zip(by_stages[max(by_stages)], outputs):
            assert (p is None and u is None) or torch.equal(p, u)


# The register forward's prefetch ring (ThreadRing: each thread's vectors of x for the tiles ahead): the tiers of its
# kernels on the default device (blocks of 128 or 256 threads).
# (forward_ring_wanted: where the register prefetch cannot serve, and rows of a warp or less.)
FORWARD_PREFETCH_CASES = [
    (torch.float32, 512),  # 4 warp rows a block, 4 of a thread's 8 vector slots in the row (no register prefetch)
    (torch.bfloat16, 512),  # warp rows of 2 vectors a thread: the register prefetch's tier, the ring instead
    (torch.float16, 200),  # short rows: 25 vectors over 16 threads a row, 7 of their 32 slots beyond the row
    (torch.float32, 4100),  # 1025 vectors over 256 threads of 8 slots: most beyond the row
]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("affine,quantized", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("dtype,cols", FORWARD_PREFETCH_CASES)
def test_forward_prefetch_walks_tiles(kind, affine, quantized, dtype, cols):
    # Regression guard for the register forward's prefetch ring: one block walks 3 tiles and a partial fourth, each
    # thread reading its vectors of x from the copies it made tiles ahead. Every output bitwise as with fewer stages
    # and as without the ring (a device with no room for it), each row bitwise as the row alone, within the
    # accuracy rule. With the quantized epilogue too (its own kernel instances).
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("fwd", 1, cols, dtype.itemsize, True, 0, 2)
    threads = threads_per_row * rows_per_block
    rows = 3 * rows_per_block + 3
    x, weight, bias, _ = _inputs(rows, cols, dtype, dtype, (affine, affine and kind == "layer"))

    def forward(inputs=x):
        return _forward_quant(kind, inputs, weight, bias) if quantized else _forward_kernel(kind, inputs, weight, bias)

    by_stages = _by_prefetch_stages(forward, "norm_forward_kernel", threads, threads * items * vec * dtype.itemsize)
    assert set(by_stages) == {0, 2, 3}
    prefetched = by_stages[3]
    for outputs in by_stages.values():
        for p, u in zip(prefetched, outputs):
            assert torch.equal(p, u)
    with _device(sms=1):
        ops.set_device(1, threads, None, 1)
        for r in (0, rows_per_block, rows - 1):
            alone, _ = forward(x[r : r + 1].clone())
            for p, a in zip(prefetched, alone):
                assert torch.equal(p[r : r + 1], a[:1]), f"row {r}"
    _check_forward(kind, x, weight, bias, prefetched[0])


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize(
    "dtype,cols,residual_dtype",
    [
        (torch.bfloat16, 512, torch.float32),  # warp rows; a float32 residual stream: 32-byte vectors, two pieces
        (torch.float32, 4096, torch.float32),  # block rows of 128 bytes a thread
        (torch.bfloat16, 4096, torch.bfloat16),  # block rows the register prefetch serves: the ring for the residual
    ],
)
def test_forward_prefetch_residual_stream(kind, dtype, cols, residual_dtype):
    # Regression guard for the fused add's forward prefetch: its ring copies the residual beside x (RowPrefetch) and
    # reads both back, with 3 stages (the sm_90 default), 2 (a byte short of 3) and none (too short for 2 of x alone:
    # the residual then read vector by vector as it is added), every output bitwise the same: y and residual_out; each
    # row bitwise as the row alone; residual_out as torch adds.
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("fwd", 1, cols, dtype.itemsize, True, 0, 2)
    threads = threads_per_row * rows_per_block
    rows = 3 * rows_per_block + 3
    x, weight, bias, _ = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    residual = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)).to(residual_dtype)

    def add_forward(inputs=x, residuals=residual):
        return _forward_kernel(kind, inputs, weight, bias, residuals, residual_dtype)

    x_stage = threads * items * vec * dtype.itemsize
    stage = threads * items * vec * (dtype.itemsize + residual_dtype.itemsize)  # both streams
    params = 2 if kind == "layer" else 1  # the weight and bias copy
    rest = params * cols * dtype.itemsize + _row_sums_bytes(threads_per_row, threads)
    with _device(sms=1):
        ops.set_device(1, threads, None, 1)
        prefetched, launch = add_forward()
        ring_at = launch["dynamic_smem"] - 3 * stage
        assert 0 <= ring_at - rest < 16
        for budget, ring in ((ring_at + 3 * stage - 1, 2 * stage), (ring_at + 2 * x_stage - 1, 0)):
            ops.set_device(1, threads, budget, 1)
            outputs, launch = add_forward()
            assert launch["dynamic_smem"] == (ring_at + ring if ring else rest)
            for p, u in zip(prefetched, outputs):
                assert torch.equal(p, u)
        ops.set_device(1, threads, None, 1)
        for r in (0, rows_per_block, rows - 1):
            alone, _ = add_forward(x[r : r + 1].clone(), residual[r : r + 1].clone())
            for p, a in zip(prefetched, alone):
                assert torch.equal(p[r : r + 1], a[:1]), f"row {r}"
    assert torch.equal(prefetched[1], (x.to(residual_dtype) + residual).to(residual_dtype))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_forward_prefetch_residual_falls_back_to_x(kind):
    # Where a block's shared memory holds no ring of both streams but one of x's vectors (float32 D=4096: 3 stages of
    # x take 3/4 of 2 of both), the fused add's ring holds x alone and its residual is read as it is added: every
    # output bitwise as with the ring of both.
    dtype, cols = torch.float32, 4096
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("fwd", 1, cols, dtype.itemsize, True, 0, 2)
    threads = threads_per_row * rows_per_block
    rows = 3 * rows_per_block + 3
    x, weight, bias, _ = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    residual = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)).to(dtype)
    stage = threads * items * vec * dtype.itemsize  # a stage of x's vectors (the residual's as many)

    def add_forward():
        return _forward_kernel(kind, x, weight, bias, residual, dtype)

    with _device(sms=1):
        ops.set_device(1, threads, None, 1)
        both, launch = add_forward()
        rest = (2 if kind == "layer" else 1) * cols * dtype.itemsize + _row_sums_bytes(threads_per_row, threads)
        assert 0 <= launch["dynamic_smem"] - 3 * 2 * stage - rest < 16  # 3 stages of both streams
        ring_at = launch["dynamic_smem"] - 3 * 2 * stage
        ops.set_device(1, threads, ring_at + 2 * 2 * stage - 1, 1)  # one byte short of 2 stages of both
        x_alone, launch = add_forward()
    assert launch["dynamic_smem"] == ring_at + 3 * stage
    for b, a in zip(both, x_alone):
        assert torch.equal(b, a)


def _row_sums_bytes(threads_per_row, threads):
    """The forward register kernel's room for its row sums (two floats a warp), for rows over a warp; none else."""
    return 2 * 4 * (threads // 32) if threads_per_row > 32 else 0


def _forward_ring_at(threads_per_row, threads, params, cols, itemsize):
    """Where the forward register kernel's ring starts: after the row sums and the copy of its `params` parameter
    vectors (weight, bias), rounded up to 16 bytes."""
    return -(-(_row_sums_bytes(threads_per_row, threads) + params * cols * itemsize) // 16) * 16


@pytest.mark.parametrize(
    "dtype,cols,ring",
    [
        (torch.bfloat16, 4096, False),  # block rows the register prefetch serves (64 bytes a thread): no ring
        (torch.bfloat16, 512, True),  # warp rows
        (torch.float32, 4096, True),  # block rows of 128 bytes a thread: no register prefetch
    ],
)
@pytest.mark.parametrize("residual", [False, True])
def test_forward_ring_where_wanted(dtype, cols, ring, residual):
    # forward_ring_wanted, on the default (sm_90) device: the launch's shared memory beyond the weight and bias copy
    # and the row sums' room (two floats a warp) is a ring of 3 stages or nothing; with a residual add (in x's dtype)
    # always a ring, of both streams.
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("fwd", 1, cols, dtype.itemsize, True, 0, 2)
    threads = threads_per_row * rows_per_block
    x, weight, bias, _ = _inputs(2 * rows_per_block, cols, dtype, dtype, (True, True))
    with _device():
        _, launch = _forward_kernel("layer", x, weight, bias, *((x.flip(0), dtype) if residual else ()))
    assert "norm_forward_kernel" in launch["kernel"]
    rest = 2 * cols * dtype.itemsize + _row_sums_bytes(threads_per_row, threads)
    ring_bytes = launch["dynamic_smem"] - rest
    streams = 2 if residual else 1 if ring else 0
    assert 0 <= ring_bytes - 3 * streams * threads * items * vec * dtype.itemsize < 16


# The forward register kernel's occupancy rules (forward_launch.h): the weight and bias copy, then the prefetch ring of
# 3 stages or else 2, each only where the SM's shared memory still keeps as many blocks as its threads allow (here 4).
# Float32 D=4096: block rows of 128 bytes a thread, which the ring serves. Each case's SM holds exactly what it names.
FORWARD_RESIDENCY_CASES = ["copy and 3 stages", "copy and 2 stages", "copy alone", "neither"]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("holds", FORWARD_RESIDENCY_CASES)
def test_forward_shared_memory_keeps_residency(kind, holds):
    dtype, cols, blocks = torch.float32, 4096, 4
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("fwd", 1, cols, dtype.itemsize, True, 0, 2)
    threads = threads_per_row * rows_per_block
    scratch = _row_sums_bytes(threads_per_row, threads)
    params = 2 if kind == "layer" else 1
    copy = params * cols * dtype.itemsize
    stage = threads * items * vec * dtype.itemsize
    ring_at = _forward_ring_at(threads_per_row, threads, params, cols, dtype.itemsize)
    launched = {
        "copy and 3 stages": ring_at + 3 * stage,
        "copy and 2 stages": ring_at + 2 * stage,
        "copy alone": scratch + copy,
        "neither": scratch,
    }[holds]
    # One byte short of the next rule's bytes for `blocks` blocks, each with the hardware's 1 KB reserve.
    shared_per_sm = blocks * (launched + 1024) if holds != "neither" else blocks * (scratch + copy + 1024) - 1
    rows = 3 * blocks * rows_per_block
    x, weight, bias, _ = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    bias = bias if kind == "layer" else None
    with _device(sms=1, threads=blocks * threads, shared_per_sm=shared_per_sm):
        (y,), launch = _forward_kernel(kind, x, weight, bias)
    with _device(sms=1, threads=blocks * threads):
        (roomy,), roomy_launch = _forward_kernel(kind, x, weight, bias)
    assert "norm_forward_kernel" in launch["kernel"]
    assert launch["dynamic_smem"] == launched and roomy_launch["dynamic_smem"] == ring_at + 3 * stage
    assert launch["grid"] == blocks  # every rule kept the 4 blocks the threads allow
    assert torch.equal(y, roomy)
    _check_forward(kind, x, weight, bias, y)


# The forward launcher's larger blocks for a ring (forward_launch.h): float32 LayerNorm D=4096, whose blocks of 128
# threads (4 an SM by registers on an sm_90) each copy the weight and bias (32 KB) and leave no room for a ring.
# case: (an SM's threads, its shared memory from the bytes a block of 256 threads with 2 stages takes (1 KB reserve
# included); the block's threads and ring stages launched).
FORWARD_GROWN_CASES = {
    # an sm_90's 228 KB: 2 blocks of 256 threads (2 rows each) keep the SM's threads and hold 2 stages each
    "256 threads": (512, lambda grown: 228 * 1024, 256, 2),
    # a byte short of 2 such blocks: 256 threads hold no ring; one block of 512 holds 2 stages
    "512 threads": (512, lambda grown: 2 * grown - 1, 512, 2),
    # 3 blocks of 128 an SM: one of 256 would hold 3 stages but keep fewer threads, one of 512 exceeds its threads
    "fewer threads": (384, lambda grown: 150000, 128, 0),
}


@pytest.mark.parametrize("case", list(FORWARD_GROWN_CASES))
@pytest.mark.parametrize("residual", [False, True])
def test_forward_rows_grow_for_ring(case, residual):
    # The fused add's ring holds x alone at every size here (no room for both streams). Every output bitwise as with
    # blocks of 128 threads and room for their ring, within the accuracy rule.
    dtype, cols = torch.float32, 4096
    vec, items, threads_per_row, rows_per_block, *_ = ops.plan("fwd", 1, cols, dtype.itemsize, True, 0, 2)
    assert threads_per_row * rows_per_block == 128
    sm_threads, shared_per_sm, threads, stages = FORWARD_GROWN_CASES[case]

    def launched(threads, stages):  # the block's shared memory: row sums, the weight and bias copy, a ring of x
        ring_at = _forward_ring_at(threads_per_row, threads, 2, cols, dtype.itemsize)
        return ring_at + stages * threads * items * vec * dtype.itemsize

    rows = 3 * 4 * rows_per_block + 1
    x, weight, bias, _ = _inputs(rows, cols, dtype, dtype, (True, True))
    extra = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)), dtype) if residual else ()
    with _device(sms=1, threads=sm_threads, shared_per_sm=shared_per_sm(launched(256, 2) + 1024)):
        outputs, launch = _forward_kernel("layer", x, weight, bias, *extra)
    with _device(sms=1, threads=sm_threads):  # room for 3 stages of both streams at 128 threads
        roomy, roomy_launch = _forward_kernel("layer", x, weight, bias, *extra)
    assert roomy_launch["block_threads"] == 128
    assert launch["block_threads"] == threads and launch["dynamic_smem"] == launched(threads, stages)
    assert launch["grid"] == sm_threads // threads
    for o, r in zip(outputs, roomy):
        assert torch.equal(o, r)
    if not residual:
        _check_forward("layer", x, weight, bias, outputs[0])


# Regression test (host cost a launch): the launchers asked the occupancy API (a driver query of about a microsecond
# on a GPU) at every launch, up to a dozen times for float32 D=4096's grown blocks, more than a decode step's few rows
# take. They now remember each answer per kernel, plan and device (remembered, launch_common.h). case: kind, D, the
# fused add, the backward, and what the launch takes there: register rows, the grown blocks (float32 D=4096 on an
# SM of 512 threads and an sm_90's 228 KB, as test_forward_rows_grow_for_ring's), the shared-memory forward's
# clusters (D=16392 float32, too long for registers) and the backward's grid.
REMEMBERED_CASES = {
    "register rows": ("rms", 1024, False, False),
    "grown rows": ("layer", 4096, False, False),
    "fused add": ("layer", 4096, True, False),
    "shared row": ("layer", 16392, False, False),
    "backward": ("layer", 1024, False, True),
}


@pytest.mark.parametrize("case", list(REMEMBERED_CASES))
def test_launch_set_up_is_remembered(case):
    kind, cols, fused, backward = REMEMBERED_CASES[case]
    index = list(REMEMBERED_CASES).index(case)

    def launch(rows):  # the row kernel's launch record, its outputs checked
        x, weight, bias, dy = _inputs(rows, cols, torch.float32, torch.float32, (True, kind == "layer"))
        bias = bias if kind == "layer" else None
        if backward:
            return _backward_kernel(kind, x, weight, bias, dy)[1]
        extra = (x.flip(0), torch.float32) if fused else ()
        outputs, launched = _forward_kernel(kind, x, weight, bias, *extra)
        if not fused:
            _check_forward(kind, x, weight, bias, outputs[0])
        return launched

    # A device no other test takes (its SMs: 7 and up), so that its first launch has nothing remembered.
    device = {"sms": 7 + index, "threads": 512, "shared_per_sm": 228 * 1024}
    with _device(**device):
        # A set-up is a function of D, dtype and the device, not of the rows: 64 and 96 fill the backward's partial
        # clusters (partial_cluster_blocks: 8 blocks where the rows fill them), which fewer rows would shrink.
        first, again = launch(64), launch(96)
    with _device(**{**device, "shared_per_sm": None}):  # another device: asked again
        other = launch(64)
    assert first["occupancy_queries"] > 0 and other["occupancy_queries"] > 0
    assert again["occupancy_queries"] == 0
    assert (again["kernel"], again["block_threads"], again["dynamic_smem"], again["cluster"]) == (
        first["kernel"],
        first["block_threads"],
        first["dynamic_smem"],
        first["cluster"],
    )
    if case == "grown rows":
        assert first["block_threads"] == 256


def test_shared_memory_bounds_the_grid():
    # The register grid: one wave of the blocks each SM keeps, here 2 by shared memory (the row sums' room and the
    # reserve; no room for the weight's copy or a ring then) though 16 by threads.
    cols = 2048
    _, _, threads_per_row, rows_per_block, *_ = ops.plan("fwd", 1, cols, 4, True, 0, 2)
    threads = threads_per_row * rows_per_block
    assert threads_per_row > 32  # block rows: the kernel has row sums' room
    scratch = _row_sums_bytes(threads_per_row, threads)
    x, weight, bias, _ = _inputs(64 * rows_per_block, cols, torch.float32, torch.float32, (True, True))
    with _device(sms=2, threads=16 * threads, shared_per_sm=3 * (scratch + 1024) - 1):
        (y,), launch = _forward_kernel("layer", x, weight, bias)
    assert launch["dynamic_smem"] == scratch and launch["grid"] == 2 * 2
    _check_forward("layer", x, weight, bias, y)
    # The shared-memory kernel on an sm_90's 228 KB an SM: one block of a 16392-wide float32 row and its copy of the
    # weight and bias (about 200 KB) an SM.
    cols = 16392
    x, weight, bias, _ = _inputs(8, cols, torch.float32, torch.float32, (True, True))
    with _device(sms=2, shared_per_sm=228 * 1024):
        (y,), launch = _forward_kernel("layer", x, weight, bias)
    assert "shared" in launch["kernel"] and launch["cluster"] == 1
    assert 228 * 1024 // (launch["dynamic_smem"] + 1024) == 1 and launch["grid"] == 2
    _check_forward("layer", x, weight, bias, y)


# Shared-memory plans of a bfloat16 row of D=32768 with its weight and bias on chip: the forward's, a block of an
# sm_90's and a cluster of 2 of 163 KB blocks; the backward's (and the gradient sums), a cluster of 2 of an sm_90's
# (in 2 groups) and a cluster of 8 of 64 KB blocks.
PLANNED_SMEM_CASES = [("fwd", None, None), ("fwd", 163 * 1024, 8), ("bwd", None, None), ("bwd", 64 * 1024, 8)]


@pytest.mark.parametrize("mode,shared,cluster", PLANNED_SMEM_CASES)
def test_plan_shared_memory_is_the_launch(mode, shared, cluster):
    # Regression test: plan() (the kernel model's view of the launchers) passed its layout the vector width as the
    # cluster size, so its shared-memory figure for the shared-memory path was not the launch's (a bfloat16 backward
    # of D=32768: 8 "blocks" of 1-element vectors).
    cols = 32768
    x, weight, bias, dy = _inputs(2, cols, torch.bfloat16, torch.bfloat16, (True, True))
    with _device(shared=shared, cluster=cluster):
        *_, planned_cluster, smem, _, _, _, _, _ = ops.plan(mode, 2, cols, 2, True, 0, 2)
        if mode == "fwd":
            _, launch = _forward_kernel("layer", x, weight, bias)
        else:
            _, launch = _backward_launch_of(lambda: _emulated("layer", x, weight, bias, dy, 1e-5))
    assert "shared" in launch["kernel"] and planned_cluster > 0 and launch["cluster"] >= planned_cluster
    assert smem == launch["dynamic_smem"]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("cols", [7, 64, 2048, 9000])
def test_batch_invariant(kind, cols):
    # Row 5 alone, and inside batches of 6 rows and of many (other grids, other slots).
    rows = _rows_for(cols)
    x, weight, bias, dy = _inputs(rows, cols, torch.float32, torch.float32, (True, kind == "layer"))
    alone, _ = _emulated(kind, x[5:6].clone(), weight, bias, dy[5:6].clone(), 1e-5)
    for batch_rows in (6, rows):
        batch, _ = _emulated(kind, x[:batch_rows], weight, bias, dy[:batch_rows], 1e-5)
        assert torch.equal(batch[0][5], alone[0][0]), "forward"
        assert torch.equal(batch[1][5], alone[1][0]), "dx"


@pytest.mark.parametrize("rows,cols", [(16, 1024), (2, 16392)])  # registers; shared memory
def test_large_mean_small_spread(rows, cols):
    # float32 rows with mean 1e3 and std 1e-1: E[x^2] - E[x]^2 would lose every digit.
    g = torch.Generator().manual_seed(1)
    x = (1e3 + 1e-1 * torch.randn(rows, cols, generator=g, dtype=torch.float64)).float()
    y = ops.layer_norm_fwd(x, [cols], None, None, 1e-5)[0]
    exact = F.layer_norm(x.double(), [cols], eps=1e-5)
    err_torch = (F.layer_norm(x, [cols], eps=1e-5).double() - exact).abs().max().item()
    assert (y.double() - exact).abs().max().item() <= 2 * err_torch + 1e-6


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("cluster", [1, 4])
def test_forward_long_rows_deterministic_and_batch_invariant(kind, cluster):
    # The shared-memory path, a block or a cluster of 4 per row: row 5 alone, in batches of 6 and of 12 (other
    # grids: the emulated device holds 8 blocks), and the batch of 12 again: bitwise the same.
    cols = 16392
    x, weight, bias, _ = _inputs(12, cols, torch.float32, torch.float32, (True, kind == "layer"))
    with _cluster_device(cols, torch.float32, 4, 8) if cluster == 4 else _device():
        (alone,), launch = _forward_kernel(kind, x[5:6].clone(), weight, bias)
        assert "shared" in launch["kernel"] and launch["cluster"] == cluster
        (six,), _ = _forward_kernel(kind, x[:6], weight, bias)
        (twelve,), launch = _forward_kernel(kind, x, weight, bias)
        (again,), _ = _forward_kernel(kind, x, weight, bias)
    assert launch["grid"] == 8  # every block walks rows
    assert torch.equal(six[5], alone[0]) and torch.equal(twelve[5], alone[0]) and torch.equal(twelve, again)


def _emulated_add(kind, x, residual, weight, bias, dy, dh_out, eps, residual_dtype=None, **rounding):
    """The fused residual add + norm through the emulated kernels: y, residual_out, d(residual_out), dw, db.
    `rounding`: as _emulated's."""
    shape = [x.shape[-1]]
    if kind == "layer":
        y, h, mean, rstd = ops.add_layer_norm_fwd(x, residual, shape, weight, bias, eps, residual_dtype, **rounding)
        mask = [True, True, True]
        dh, dw, db = ops.add_layer_norm_bwd(dy, dh_out, h, shape, mean, rstd, weight, bias, mask, **rounding)
        return y, h, dh, dw, db
    y, h, rstd = ops.add_rms_norm_fwd(x, residual, shape, weight, eps, residual_dtype, **rounding)
    dh, dw = ops.add_rms_norm_bwd(dy, dh_out, h, shape, rstd, weight, [True, True], **rounding)
    return y, h, dh, dw, None


# The fused residual add over the same plans as the plain kernels: the scalar path (odd D), short rows, a warp per
# row, a block per row, and the multi-pass kernels (forward from 33001/40000, backward from 9000/9001).
ADD_CASES = [(5, 7), (33, 64), (6, 1024), (2, 4096), (2, 9001), (1, 33001), (2, 40000)]


# The rounding options of the fused ops (the plain norms'): LayerNorm's offset (zero-centred weights), RMSNorm's
# offset and Llama's rounding.
ADD_ROUNDING = [
    pytest.param("layer", {}, id="layer"),
    pytest.param("rms", {}, id="rms"),
    pytest.param("layer", {"weight_offset": 1.0}, id="layer-weight_offset"),
    pytest.param("rms", {"weight_offset": 1.0, "round_normalized": True}, id="rms-both"),
]


@pytest.mark.parametrize("kind,rounding", ADD_ROUNDING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,cols", ADD_CASES)
def test_residual_add_is_the_plain_norm_of_the_sum(kind, rounding, dtype, rows, cols):
    """Bitwise: residual_out is torch's x + residual, y the plain emulated norm of it (with the same rounding
    options), and d(residual_out) the plain emulated dx plus the incoming gradient of residual_out (in
    float32/float64 both round that sum once)."""
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    g = torch.Generator().manual_seed(7)
    residual = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(dtype)
    dh_out = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(dtype)
    y, h, dh, dw, db = _emulated_add(kind, x, residual, weight, bias, dy, dh_out, 1e-5, **rounding)
    plain, _ = _emulated(kind, x + residual, weight, bias, dy, 1e-5, **rounding)
    assert torch.equal(h, x + residual)
    assert torch.equal(y, plain[0])
    assert torch.equal(dh, plain[1] + dh_out)
    assert torch.equal(dw, plain[2])
    assert db is None or torch.equal(db, plain[3])


# Every kernel tier of the float32 residual stream under half/bfloat16 input, each parameter dtype: the scalar path
# in a warp (7) and in registers (1021, prime), 16-byte vectors in a warp (64) and in a block (1024), the backward's
# multi-pass path (16384, and 4099 on the scalar path, also the forward's) and the forward's (40000).
FLOAT32_STREAM_SHAPES = [(5, 7), (3, 64), (2, 1021), (6, 1024), (2, 4099), (2, 16384), (1, 40000)]
REDUCED_PRECISION_ADD_CASES = [
    *(
        (dtype, param_dtype, None, rows, cols)
        for dtype, param_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]
        for rows, cols in [(5, 7), (6, 1024), (2, 16384), (1, 40000)]
    ),
    *(
        (dtype, param_dtype, torch.float32, rows, cols)
        for dtype, param_dtype in DTYPES[2:]
        for rows, cols in FLOAT32_STREAM_SHAPES
    ),
]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,param_dtype,residual_dtype,rows,cols", REDUCED_PRECISION_ADD_CASES)
def test_residual_add_reduced_precision(kind, dtype, param_dtype, residual_dtype, rows, cols):
    """half/bfloat16 input, residual_out in the input's dtype or float32 (float32 vectors of 8 elements: 32-byte
    accesses): residual_out bitwise torch's add; y, d(residual_out) and the parameter gradients within FLOOR of the
    emulated plain norm of residual_out, which differs only in rounding them once instead of twice."""
    _check_residual_add_reduced_precision(kind, dtype, param_dtype, residual_dtype, rows, cols)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("path", ["cluster", "reread"])
def test_backward_long_rows_residual_add(kind, path):
    # The backward's cluster and read-twice paths with a float32 residual stream beside bfloat16 input (x as
    # float32, dy as bfloat16 on chip) and its incoming gradient added to dx.
    cols, grads = BACKWARD_LONG_COLS[0], 1 + (kind == "layer")
    devices = {
        "cluster": lambda: _device(shared=-(-cols // 4) * (4 + 2 + 2 + 4 * grads) + 1024, cluster=4),
        "reread": lambda: _reread_device(cols, torch.float32, grads),
    }
    with devices[path]():
        launch = _residual_add_backward_launch(kind, torch.bfloat16, torch.bfloat16, 2, cols)
    assert "shared" in launch["kernel"] and launch["cluster"] == (4 if path == "cluster" else 1)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,param_dtype", DTYPES[2:])
def test_backward_shared_row_partial_clusters_residual_add(kind, dtype, param_dtype):
    # Blocks that each hold a whole row, their gradient sums added over a cluster of 8 (as
    # test_backward_shared_row_partial_clusters), with a float32 residual stream: x as float32 on chip, its own
    # kernel instances.
    cols, grads = 8200, 1 + (kind == "layer")
    per_elem = 4 + dtype.itemsize + param_dtype.itemsize + 4 * grads  # x, dy, the weight, the sums
    with _device(shared=cols * per_elem + 1024, cluster=8, sms=4):
        launch = _residual_add_backward_launch(kind, dtype, param_dtype, 20, cols)
    assert "shared" in launch["kernel"] and launch["cluster"] == 8
    assert launch["grid"] % 8 == 0 and launch["grid"] > 8


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype,param_dtype", DTYPES[2:])
@pytest.mark.parametrize("cols", BACKWARD_LONG_COLS)
def test_backward_multipass_residual_add(kind, dtype, param_dtype, cols):
    # The multi-pass backward (a device without room for even the gradient sums: GPUs before sm_90 at long rows)
    # with a float32 residual stream beside half/bfloat16 input: its own kernel instances.
    with _device(shared=1024, cluster=1):
        launch = _residual_add_backward_launch(kind, dtype, param_dtype, 2, cols)
    assert "multipass" in launch["kernel"]


def _residual_add_backward_launch(kind, dtype, param_dtype, rows, cols):
    """_check_residual_add_reduced_precision with a float32 residual stream; the backward row kernel's launch."""
    ops.set_counting(True)
    try:
        _check_residual_add_reduced_precision(kind, dtype, param_dtype, torch.float32, rows, cols)
    finally:
        ops.set_counting(False)
    return next(launch for launch in json.loads(ops.take_launch_log()) if "norm_backward" in launch["kernel"])


def _check_residual_add_reduced_precision(kind, dtype, param_dtype, residual_dtype, rows, cols):
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, (True, kind == "layer"))
    g = torch.Generator().manual_seed(7)
    stream = residual_dtype or dtype
    residual = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(stream)
    dh_out = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(stream)
    y, h, dh, dw, db = _emulated_add(kind, x, residual, weight, bias, dy, dh_out, 1e-5, residual_dtype)
    assert torch.equal(h, x.to(stream) + residual) and y.dtype == dtype and dh.dtype == stream
    as_stream = [t.to(stream) if t is not None else None for t in (weight, bias)]
    plain, _ = _emulated(kind, h, *as_stream, dy.to(stream), 1e-5)
    torch.testing.assert_close(y, plain[0].to(dtype), atol=FLOOR[dtype], rtol=FLOOR[dtype])
    torch.testing.assert_close(dh, plain[1] + dh_out, atol=2 * FLOOR[dtype], rtol=2 * FLOOR[dtype])
    # The same sums over the same rows: the parameter gradients differ by their final rounding, that of the coarser
    # of the two dtypes (the plain norm's come in the stream dtype: half an ulp of float16 with float32 parameters,
    # measured 4.9e-4 relative), and, where the plain norm's float32 rows are planned into other blocks and clusters,
    # by the order of the rows' float32 additions: an error that grows like sqrt(rows) (measured 4.4e-6 relative
    # at 20 rows in clusters of 8).
    for ours, theirs in ((dw, plain[2]), (db, plain[3])):
        if ours is not None:
            floor = max(FLOOR[ours.dtype], FLOOR[theirs.dtype]) * math.sqrt(rows)
            torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=floor, rtol=floor)


@pytest.mark.skipif(not os.environ.get("TORCH_LN_REQUIRE_SANITIZERS"), reason="only scripts/run.sh requires them")
def test_sanitizers_active():
    # scripts/run.sh sets TORCH_LN_REQUIRE_SANITIZERS and preloads ASan: without the
    # preload the build would silently be the plain one. It also sets TORCH_LN_RACECHECK: every launch of this run
    # checks its shared-memory accesses for races (csrc/emulated/simt_emulator.cpp).
    assert SANITIZED
    assert ops.racecheck_active()


# rms_norm's rounding options (RoundingOptions, csrc/norm.h): Llama's and Gemma's arithmetic.
ROUNDING = [
    pytest.param({"round_normalized": True}, id="round_normalized"),
    pytest.param({"weight_offset": 1.0}, id="weight_offset"),
    pytest.param({"weight_offset": 1.0, "round_normalized": True}, id="both"),
]


@pytest.mark.parametrize("rounding", ROUNDING)
@pytest.mark.parametrize("dtype,param_dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,cols",
    [(1, 1021), (33, 64), (6, 1024), (2, 16384)],  # M=1 prime scalar path; vectors; a warp per row; bwd multi-pass
)
def test_rms_norm_rounding_options(rounding, dtype, param_dtype, rows, cols):
    """The forward is the rounding model (torch_ln.reference.apply_weight on the kernel's own rstd) bit for bit;
    the backward is held to the accuracy rule against autograd of that model."""
    x, weight, _, dy = _inputs(rows, cols, dtype, param_dtype, (True, False))
    y, rstd = ops.rms_norm_fwd(x, [cols], weight, 1e-5, **rounding)
    assert torch.equal(y, reference.apply_weight(x, x.to(rstd.dtype) * rstd, weight, **rounding))
    _check_against_torch("rms", x, weight, None, dy, **rounding)


@pytest.mark.parametrize("affine", [(True, True), (True, False)])
@pytest.mark.parametrize("dtype,param_dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,cols",
    [(1, 1021), (33, 64), (6, 1024), (2, 16384), (1, 40000)],  # as above; the forward's shared-memory path
)
def test_layer_norm_weight_offset(affine, dtype, param_dtype, rows, cols):
    """LayerNorm with zero-centred weights (weight_offset=1) against autograd of torch_ln.reference (y = xhat *
    (weight + 1) + bias in the accumulation dtype), by the accuracy rule."""
    x, weight, bias, dy = _inputs(rows, cols, dtype, param_dtype, affine)
    _check_against_torch("layer", x, weight, bias, dy, weight_offset=1.0)


# Strided rows (issue 39 item 1): x read through a row stride. The register kernels (a warp a row: 1024; several
# rows a warp: 64), the forward's shared-memory kernel (40000) and the backward's multi-pass one (9000 float32).
STRIDED_CASES = [(9, 64), (6, 1024), (2, 9000), (2, 40000)]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("rows,cols", STRIDED_CASES)
def test_strided_rows(kind, dtype, aligned, rows, cols):
    """A column slice of a wider tensor: forward and backward bitwise those of a contiguous copy read the same way.
    A row stride of whole 16-byte vectors (the slice starting at 0) takes the contiguous input's kernel, vectors and
    all; an odd one the scalar path, as a contiguous input starting one element into its allocation does (whose
    summation order may differ from the vector path's: the reference is such an input)."""
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, (True, kind == "layer"))
    pad, start = (64, 0) if aligned else (13, 5)
    wide = torch.randn(rows, cols + pad, dtype=torch.float64).to(dtype)
    wide[:, start : start + cols] = x
    strided = wide[:, start : start + cols]
    assert not strided.is_contiguous()
    if not aligned:  # the same values, contiguous, one element into their allocation: the scalar path
        x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(rows, cols)
    _assert_read_as(kind, strided, x, weight, bias, dy)


def _assert_read_as(kind, strided, x, weight, bias, dy):
    """The strided input's forward (by the same kernel) and backward bitwise those of the contiguous x."""
    (y, *_), launch = _forward_kernel(kind, strided, weight, bias)
    (y_contiguous, *_), contiguous_launch = _forward_kernel(kind, x, weight, bias)
    assert torch.equal(y, y_contiguous)
    assert launch["kernel"] == contiguous_launch["kernel"]
    ours, _ = _emulated(kind, strided, weight, bias, dy, 1e-5)
    theirs, _ = _emulated(kind, x, weight, bias, dy, 1e-5)
    for a, b in zip(ours, theirs):
        assert (a is None and b is None) or torch.equal(a, b)


def _packed_heads(rows, cols, dtype, odd_width):
    """The first 2 heads of a packed [rows, 4 heads x cols] projection (one element more per token: odd_width)."""
    wide = torch.randn(rows, 4 * cols + int(odd_width), dtype=torch.float64).to(dtype)
    return wide[:, : 2 * cols].unflatten(-1, (2, cols))


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["packed_heads", "packed_heads_odd_width", "transposed"])
@pytest.mark.parametrize("rows,cols", STRIDED_CASES)
def test_rows_two_strides_deep(kind, dtype, layout, rows, cols):
    """Rows two strides deep (the heads of a packed QKV projection, transposed leading dims): forward and backward
    bitwise those of a contiguous copy. Every row start 16-byte aligned: the contiguous input's kernel, vectors and
    all; the packed projection one element wider: the scalar path, as a contiguous copy one element into its
    allocation takes."""
    if layout == "transposed":
        strided = torch.randn(rows, 2, cols, dtype=torch.float64).to(dtype).transpose(0, 1)
    else:
        strided = _packed_heads(rows, cols, dtype, layout == "packed_heads_odd_width")
    x = strided.contiguous()
    if layout == "packed_heads_odd_width":
        x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)
    _, weight, bias, dy = _inputs(2 * rows, cols, dtype, dtype, (True, kind == "layer"))
    _assert_read_as(kind, strided, x, weight, bias, dy.view(x.shape))


# memory_efficient's backward (issue 39 item 2): xhat recovered from y as y / (weight + offset), norms without bias.
# The register kernels (64, 1024; 1000: vector slots past the row), the backward's multi-pass kernel (9000 float32)
# and its shared-memory kernel (40000).
MEMORY_EFFICIENT_CASES = [(9, 64), (6, 1024), (5, 1000), (2, 9000), (2, 40000)]


@pytest.mark.parametrize("rows,cols", MEMORY_EFFICIENT_CASES)
@pytest.mark.parametrize(
    "kind,dtype,affine",
    [
        ("rms", torch.float32, (True, False)),
        ("rms", torch.bfloat16, (True, False)),
        ("rms", torch.float32, (False, False)),  # no weight: xhat = y
        ("layer", torch.float32, (True, False)),
        ("layer", torch.float64, (True, False)),
        ("layer", torch.bfloat16, (False, False)),
    ],
)
def test_backward_from_output(kind, dtype, affine, rows, cols):
    """The backward from y by the accuracy rule against torch's from x, with and without a weight offset."""
    x, weight, bias, dy = _inputs(rows, cols, dtype, dtype, affine)
    _check_against_torch(kind, x, weight, bias, dy, from_output=True)
    if weight is not None:
        # weight + 1 away from 0 (N(0, 1) draws hold -1 exactly in bfloat16: refused, test_memory_efficient.py)
        shifted = (weight.double().abs() - 0.5).to(dtype)
        _check_against_torch(kind, x, shifted, bias, dy, from_output=True, weight_offset=1.0)


@pytest.fixture
def _capturing():
    """The emulated stream records a CUDA graph (set_capturing) for the test."""
    ops.set_capturing(True)
    try:
        yield
    finally:
        ops.set_capturing(False)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_from_output_while_capturing(kind, _capturing):
    """While a CUDA graph records, the backward from y cannot count the weight's zeros on the host (a host
    synchronization, which capture forbids): it asserts on the device instead (at::_assert_async; on the CPU the
    assertion raises at once, a RuntimeError with the message, where the host check raises a ValueError). The
    gradients are the same as outside a capture."""
    x, weight, _, dy = _inputs(6, 1024, torch.float32, torch.float32, (True, False))
    captured, _ = _emulated(kind, x, weight, None, dy, 1e-5, from_output=True)
    ops.set_capturing(False)
    eager, _ = _emulated(kind, x, weight, None, dy, 1e-5, from_output=True)
    for c, e in zip(captured, eager, strict=True):
        assert (c is None and e is None) or torch.equal(c, e)
    ops.set_capturing(True)
    zeroed = weight.clone()
    zeroed[7] = -1.0
    with pytest.raises(RuntimeError, match=r"memory_efficient=True needs every weight \+ weight_offset nonzero") as e:
        _emulated(kind, x, zeroed, None, dy, 1e-5, from_output=True, weight_offset=1.0)
    assert not isinstance(e.value, ValueError)  # the device-side form, not the host check
    # (The first C++ exception that an emulated test raises: under the preloaded ASan it aborted the worker until
    # scripts/run.sh preloaded libstdc++ beside it.)


# Quantized outputs (issue 37): the forward kernel writes y (a temporary unless return_unquantized), then the
# quantize kernel (csrc/cuda/quantize.cuh, a warp per scale group) writes the codes and scales. Bit for bit
# reference.quantize of the emulated y, in every dtype, format and scale mode. Groups of one element (odd D),
# several groups a row (384 / 128), per token over a row longer than a warp's pass (40000: the shared-memory
# forward), more groups than the emulated device's warps (600 rows).
QUANT_FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def _quant_modes(cols):
    group = next(g for g in (128, 8, 1) if cols % g == 0)
    static = torch.tensor([0.0173])
    return [
        ({"scale": static}, {"scale": static}),
        ({}, {}),
        ({"scale_ub": 0.25}, {"scale_ub": 0.25}),
        ({"group_size": group}, {"group_size": group}),
        (
            {"group_size": group, "scale_ue8m0": True, "scales_column_major": True},
            {"group_size": group, "scale_ue8m0": True},
        ),
    ]


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 7), (3, 384), (600, 64), (2, 40000)])
@pytest.mark.parametrize("kind", ["rms", "layer", "add_rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_quantized_output(kind, dtype, rows, cols):
    x, weight, bias, residual = _inputs(rows, cols, dtype, dtype, (True, True))
    modes = _quant_modes(cols)
    # Every format with every mode on small inputs; on the large ones (slow to emulate) each mode once, the formats
    # in turn.
    if rows * cols <= 2048:
        cases = [(out_dtype, mode) for out_dtype in QUANT_FORMATS for mode in modes]
    else:
        cases = [(QUANT_FORMATS[i % len(QUANT_FORMATS)], mode) for i, mode in enumerate(modes)]
    for out_dtype, (options, ref_options) in cases:
        quant = {"out_dtype": out_dtype, "return_unquantized": True, **options}
        if kind == "rms":
            q, scales, y = ops.rms_norm_quant(x, [cols], weight, None, **quant)
            y_plain = ops.rms_norm_fwd(x, [cols], weight, None)[0]
            q_only = ops.rms_norm_quant(x, [cols], weight, None, **{**quant, "return_unquantized": False})[0]
        elif kind == "layer":
            q, scales, y = ops.layer_norm_quant(x, [cols], weight, bias, 1e-5, **quant)
            y_plain = ops.layer_norm_fwd(x, [cols], weight, bias, 1e-5)[0]
            q_only = ops.layer_norm_quant(x, [cols], weight, bias, 1e-5, **{**quant, "return_unquantized": False})[0]
        else:
            q, scales, y, residual_out = ops.add_rms_norm_quant(x, residual, [cols], weight, None, None, **quant)
            y_plain, residual_plain, _ = ops.add_rms_norm_fwd(x, residual, [cols], weight, None, None)
            assert torch.equal(residual_out, residual_plain)
            q_only = ops.add_rms_norm_quant(
                x, residual, [cols], weight, None, None, **{**quant, "return_unquantized": False}
            )[0]
        assert torch.equal(y, y_plain)
        q_ref, scales_ref = reference.quantize(y_plain, 1, out_dtype, **ref_options)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (out_dtype, options)
        assert torch.equal(q_only.view(torch.uint8), q_ref.view(torch.uint8))
        if "scale" not in options:
            assert torch.equal(scales.view(torch.int32), scales_ref.contiguous().view(torch.int32))


# The forward kernels' quantizing instances, by path, and the emulated device that takes each (None: the default
# sm_90): the register kernels' two tiers with 16-byte vectors and on the scalar path (prime D), the shared-memory
# kernel (a block, and a cluster of 4 whose slices hold whole 128-element groups), the multi-pass kernel.
QUANT_KERNEL_PATHS = [
    ("registers", 256, None),  # short rows: a warp or less per row, 128-element groups in 16 or 32 lanes
    ("registers", 4096, None),  # the large register tier
    ("registers", 61, None),  # the scalar path, short rows (prime D: groups of 1 element)
    ("registers", 257, None),  # the scalar path, large tier
    ("shared", 16512, None),  # past the registers (129 groups of 128), one block a row
    ("shared", 16411, None),  # the scalar path
    ("shared", 16896, 4),  # a cluster of 4: 132 groups, 33 in each block's slice
    ("shared", 16512, "row only"),  # shared memory for the row but not the weight: the weight read from global memory
    ("multipass", 16512, "multipass"),
    ("multipass", 16411, "multipass"),
]


# The mangled names' part that tells the paths' kernels apart.
QUANT_KERNEL_NAMES = {
    "registers": "norm_forward_kernelI",
    "shared": "norm_forward_shared_kernelI",
    "multipass": "norm_forward_multipass_kernelI",
}


def _quant_device(cols, dtype, device, param_bytes=0):
    """The emulated device of a QUANT_KERNEL_PATHS case (param_bytes: of weight and bias an element, for the
    cluster)."""
    if device is None:
        return _device()
    if device == "multipass":
        return _device(**FORWARD_LONG_PATHS["multipass"])
    if device == "row only":
        return _device(shared=cols * dtype.itemsize + 1024, cluster=1)
    return _cluster_device(cols, dtype, device, param_bytes)


def _quantized_launches(kind, x, weight, bias, residual, **quant):
    """The *_quant op's outputs (q, scales, y[, residual_out]) and its kernel launches."""
    cols = x.shape[-1]
    ops.set_counting(True)
    try:
        if kind == "add_rms":
            out = ops.add_rms_norm_quant(x, residual, [cols], weight, None, None, **quant)
        elif kind == "layer":
            out = ops.layer_norm_quant(x, [cols], weight, bias, 1e-5, **quant)
        else:
            out = ops.rms_norm_quant(x, [cols], weight, None, **quant)
    finally:
        ops.set_counting(False)
    return out, json.loads(ops.take_launch_log())


@pytest.mark.parametrize("path,cols,device", QUANT_KERNEL_PATHS)
@pytest.mark.parametrize("kind", ["rms", "layer", "add_rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_output_fused(path, cols, device, kind, dtype):
    """The serving dtypes quantize in the forward kernel's epilogue on every path (one launch; y not written where
    not asked for: the stores are q, the scales and the statistics alone), bitwise as reference.quantize of the plain
    op's y: static, per-token and per-group scales."""
    x, weight, bias, residual = _inputs(2, cols, dtype, dtype, (True, True))
    group = 128 if cols % 128 == 0 else 1
    per_group = {"group_size": group, "scale_ue8m0": True, "scales_column_major": True}
    modes = [{"scale": torch.tensor([0.0173])}, {"scale_ub": 0.5}, per_group]
    with _quant_device(cols, dtype, device, (1 + (kind == "layer")) * dtype.itemsize):
        for out_dtype, options in zip(QUANT_FORMATS, modes):
            (q, scales, *rest), launches = _quantized_launches(
                kind, x, weight, bias, residual, out_dtype=out_dtype, **options
            )
            kernels = [launch["kernel"] for launch in launches]
            assert len(kernels) == 1 and QUANT_KERNEL_NAMES[path] in kernels[0], kernels
            groups = 0 if "scale" in options else cols // options.get("group_size", cols)
            statistics = 4 * (1 + (kind == "layer"))
            residual_bytes = cols * dtype.itemsize if kind == "add_rms" else 0
            assert launches[0]["store_bytes"] == 2 * (cols + 4 * groups + statistics + residual_bytes)
            if kind == "add_rms":
                y_plain, residual_plain, _ = ops.add_rms_norm_fwd(x, residual, [cols], weight, None, None)
                assert torch.equal(rest[1], residual_plain)
            else:
                y_plain = _emulated_forward(kind, x, weight, bias, None if kind == "rms" else 1e-5)
            layout_free = {k: v for k, v in options.items() if k != "scales_column_major"}
            q_ref, scales_ref = reference.quantize(y_plain, 1, out_dtype, **layout_free)
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (out_dtype, options)
            if "scale" not in options:
                assert torch.equal(scales.view(torch.int32), scales_ref.view(torch.int32))


# Where the forward kernel does not quantize, a second kernel quantizes y: the dtype combinations without quantizing
# kernel instances, and per-group scales whose groups do not lie in a warp's lanes in the kernel's layout.
QUANT_SECOND_KERNEL_CASES = [
    (torch.float64, torch.float64, None, 256, 128, None),  # float64: no quantizing instance
    (torch.bfloat16, torch.float32, None, 256, 128, None),  # mixed parameters
    (torch.float16, torch.float16, torch.float32, 256, 128, None),  # a float32 residual stream
    (torch.bfloat16, torch.bfloat16, None, 256, 4, None),  # groups of half a 16-byte vector
    (torch.float32, torch.float32, None, 4096, 256, None),  # 64 lanes: more than a warp's
    (torch.float16, torch.float16, None, 16512, 128, 4),  # cluster slices of 516 vectors: groups across two
]


@pytest.mark.parametrize("dtype,param_dtype,residual_dtype,cols,group,device", QUANT_SECOND_KERNEL_CASES)
def test_quantized_output_second_kernel(dtype, param_dtype, residual_dtype, cols, group, device):
    x, weight, _, residual = _inputs(3, cols, dtype, param_dtype, (True, False))
    quant = {"out_dtype": torch.float8_e4m3fn, "group_size": group}
    with _quant_device(cols, dtype, device):
        ops.set_counting(True)
        try:
            q, scales, _, residual_out = ops.add_rms_norm_quant(
                x, residual, [cols], weight, None, residual_dtype, **quant
            )
        finally:
            ops.set_counting(False)
        launches = json.loads(ops.take_launch_log())
        y_plain, residual_plain, _ = ops.add_rms_norm_fwd(x, residual, [cols], weight, None, residual_dtype)
    assert [("quantize_rows" in launch["kernel"]) for launch in launches] == [False, True]
    assert torch.equal(residual_out, residual_plain)
    q_ref, scales_ref = reference.quantize(y_plain, 1, torch.float8_e4m3fn, group_size=group)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scales.view(torch.int32), scales_ref.view(torch.int32))


@pytest.mark.parametrize("out_dtype", QUANT_FORMATS)
def test_quantized_output_nan_zero_and_saturated_rows(out_dtype):
    """A NaN row (NaN scale; NaN codes in float8, 0 in int8), an all-zero row (the floor scale), a row that
    saturates under a small static scale: as reference.quantize."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(11))
    x[0, 3] = float("nan")
    x[1] = 0
    for options in ({}, {"group_size": 128}, {"scale": torch.tensor([1e-4])}):
        q, scales, y = ops.rms_norm_quant(x, [256], None, None, out_dtype=out_dtype, return_unquantized=True, **options)
        q_ref, scales_ref = reference.quantize(y, 1, out_dtype, **options)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        if "scale" not in options:
            assert torch.equal(scales.view(torch.int32), scales_ref.view(torch.int32))
