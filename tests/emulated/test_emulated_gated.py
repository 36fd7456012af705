"""The gated RMSNorm's CUDA kernels (their GATED instances), run on the CPU under the SIMT emulation (csrc/emulated),
forward and backward: against the CPU kernels by the tolerance table of tests/norm_cases.py (the same arithmetic in
another summation order; tests/test_gated_norm.py holds the CPU kernels to torch and to the classes), and by the
project's accuracy rule against float64, at most twice the error of the torch-ops arithmetic of
reference.gated_rms_norm (the classes' own) in the input's dtype. Not the table against that torch arithmetic
directly: with Llama-style rounding its float16 dx is itself ~50x the table's tolerance off float64 in places, and
two roundings of different inputs then differ by more than the table (as our float16 dx does, at the same error).

Which case covers which path (plans from csrc/cuda/launch_plan.h; a grouped norm's plan is its group's, each group a
row of the kernels, csrc/cuda/launch_common.h kernel_rows):
- every dtype pair the gate takes (float32, float64, float16/bfloat16 with their own or float32 weights) on each
  register tier and the multi-pass kernel, vectors and scalar: D = 64 (a few vectors a thread), 1024 (the large
  tier), 16392 (past the registers: multi-pass; a gated norm has no shared-memory path), and 7, 97, 4099 (scalar:
  odd D);
- the six forms of tests/test_gated_norm.py (gate before/after, silu/sigmoid, rounded or not), grouped and not,
  without a weight, without a gate (a grouped plain RMSNorm);
- more groups than the emulated device's blocks (each unit walks one group's rows);
- a strided input (its groups' rows a level below its own) and one the groups' rows cannot be read from in place
  (two levels deep: a contiguous copy);
- each gradient asked for alone (dx, dgate, dweight: the backward without dx still computes dh for dgate).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import emulated_build as build
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from norm_cases import GATED_FORMS, assert_accuracy, assert_close_to_torch, gated_inputs

from torch_ln import reference

build.load()
ops = torch.ops.torch_ln_emulated
EPS = 1e-6

# The gate's dtype pairs (input, weight): the GATED instances'.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.float16, torch.float16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
]
# The error table's name of each result (a gate's gradient is, like dx, a float32 value rounded once).
KINDS = {"y": "y", "dx": "dx", "dgate": "dx", "dweight": "dweight"}


def _kernels(library, x, z, w, dy, mask, position, activation, group_size, round_normalized):
    """The operators' {"y", "dx", "dgate", "dweight"} (those asked for by mask: dx, dgate, dweight) from `library`:
    the emulated CUDA kernels' or the CPU kernels'."""
    options = (position, activation, group_size, round_normalized)
    y, rstd = library.gated_rms_norm_fwd(x, z, [x.shape[-1]], w, EPS, *options)
    dx, dgate, dweight = library.gated_rms_norm_bwd(dy, x, z, [x.shape[-1]], rstd, w, mask, *options)
    out = {"y": y}
    for name, grad, wanted, given in zip(("dx", "dgate", "dweight"), (dx, dgate, dweight), mask, (x, z, w)):
        if wanted and given is not None:
            out[name] = grad
    return out


def _torch(x, z, w, dy, to, position, activation, group_size, round_normalized):
    """reference.gated_rms_norm and its autograd gradients, the leaves converted `to` a dtype first (None: as given)."""
    leaves = [None if t is None else t.detach().to(to or t.dtype).requires_grad_() for t in (x, z, w)]
    y = reference.gated_rms_norm(
        *leaves,
        EPS,
        gate_position=position,
        activation=activation,
        group_size=group_size,
        round_normalized=round_normalized,
    )
    y.backward(dy.to(y.dtype))
    out = {"y": y.detach()}
    out.update({name: t.grad for name, t in zip(("dx", "dgate", "dweight"), leaves) if t is not None})
    return out


def _check(x, z, w, dy, position, activation, group_size=None, round_normalized=False, mask=(True, True, True)):
    dtype, rows = x.dtype, x.shape[0] * (x.shape[-1] // (group_size or x.shape[-1]))
    options = (position, activation, group_size, round_normalized)
    got = _kernels(ops, x, z, w, dy, list(mask), *options)
    cpu = _kernels(torch.ops.torch_ln, x, z, w, dy, list(mask), *options)
    want, ref64 = _torch(x, z, w, dy, None, *options), _torch(x, z, w, dy, torch.float64, *options)
    assert got.keys() == cpu.keys()
    for name, value in got.items():
        assert value.dtype == want[name].dtype and value.shape == want[name].shape, name
        assert torch.isfinite(value).all(), name
        assert_close_to_torch(KINDS[name], value, cpu[name], dtype, rows)
        assert_accuracy(name, value, want[name], ref64[name], dtype, rows)
    return got


# Row lengths by kernel: vectors 64 (short rows: in groups of 16), 1024 (the large register tier), 16392
# (multi-pass); scalar (odd D) 7, 97, 4099. Each with a form of its own (rotating through GATED_FORMS). A grouped
# norm's kernel rows are its groups: the plan is the group's (1024 in groups of 256 would be short rows).
PATHS = [(64, 16), (1024, None), (16392, None), (7, None), (97, None), (4099, None)]


@pytest.mark.parametrize(("cols", "group_size"), PATHS)
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPE_PAIRS)
def test_every_gated_kernel(cols, group_size, dtype, weight_dtype):
    form = PATHS.index((cols, group_size)) + DTYPE_PAIRS.index((dtype, weight_dtype))
    position, activation, round_normalized = GATED_FORMS[form % len(GATED_FORMS)]
    if weight_dtype != dtype and position == "before" and round_normalized:
        round_normalized = False  # Mamba2's form with a float32 weight is its swap's promoted product (torch's)
    rows = 2 if cols > 4096 else 5
    x, z, w, dy = gated_inputs(rows, cols, dtype, weight_dtype, with_gate=True)
    _check(x, z, w, dy, position, activation, group_size, round_normalized)


# Each form with a weight of the input's dtype, a float32 weight, none, and no gate (a grouped plain RMSNorm). Not
# Mamba2's form with a float32 weight: the class's output is then float32 (a promoted product, which its swap leaves
# to torch, as tests/test_gated_norm.py says).
VARIANTS = [
    (variant, *form)
    for variant, form in itertools.product(["weight", "float32 weight", "no weight", "no gate"], GATED_FORMS)
    if not (variant == "float32 weight" and form[0] == "before" and form[2])
]


@pytest.mark.parametrize(("variant", "position", "activation", "round_normalized"), VARIANTS)
@pytest.mark.parametrize("group_size", [None, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_forms(variant, position, activation, round_normalized, group_size, dtype):
    """40 rows of 192: with groups, three to a row, whose units walk 40 rows each."""
    weight_dtype = {"weight": dtype, "float32 weight": torch.float32, "no weight": None, "no gate": dtype}[variant]
    x, z, w, dy = gated_inputs(40, 192, dtype, weight_dtype, with_gate=variant != "no gate")
    _check(x, z, w, dy, position, activation, group_size, round_normalized)


@pytest.mark.parametrize("with_weight", [True, False])
def test_grouped_multipass(with_weight):
    """Two groups of 8200 float32 a row: each group past the registers (2050 vectors; the gated register kernels hold
    2048 forward, 1024 backward), so the multi-pass kernels walk one group's rows a block, with the group's weight
    slice or none."""
    x, z, w, dy = gated_inputs(3, 16400, torch.float32, torch.float32 if with_weight else None, with_gate=True)
    _check(x, z, w, dy, "before", "silu", group_size=8200, round_normalized=True)


def test_more_groups_than_blocks():
    """64 groups of 8 a row: more groups than the emulated device holds blocks of (each unit walks one group)."""
    x, z, w, dy = gated_inputs(9, 512, torch.float32, torch.float32, with_gate=True)
    got = _check(x, z, w, dy, "before", "silu", group_size=8)
    assert got["y"].shape == x.shape


@pytest.mark.parametrize("layout", ["column slice", "two levels deep"])
def test_strided_input(layout):
    """A column slice is read in place (its groups' rows a level below its own); a view two levels deep cannot be
    (its groups' rows would be three): the operator copies it."""
    g = torch.Generator().manual_seed(3)
    if layout == "column slice":
        x = torch.randn(12, 256, generator=g)[:, 32:160]
    else:
        x = torch.randn(4, 3, 2, 128, generator=g).transpose(0, 1)[:, :, 1]
    z = torch.randn(x.shape, generator=g)
    w, dy = 1 + 0.5 * torch.randn(128, generator=g), torch.randn(x.shape, generator=g)
    _check(x, z, w, dy, "before", "silu", group_size=32)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (False, False, True)])
@pytest.mark.parametrize("position", ["before", "after"])
def test_each_gradient_alone(mask, position):
    x, z, w, dy = gated_inputs(6, 128, torch.float32, torch.float32, with_gate=True)
    got = _check(x, z, w, dy, position, "silu", group_size=32, mask=mask)
    assert set(got) == {"y"} | {name for name, wanted in zip(("dx", "dgate", "dweight"), mask) if wanted}
