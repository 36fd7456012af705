"""Memory-traffic gates on the CUDA kernels, from the SIMT emulator's counters (csrc/emulated/simt_emulator.h).

- The 16-byte vector paths use every byte of every 32-byte sector their warp-wide requests touch (sector
  efficiency 1.0, as Nsight Compute counts it), in the row kernels and in the backward's reduce.
- The register-resident paths, and the forward's shared-memory path (a block or a cluster per row), read x (and
  dy) exactly once and write y (dx) exactly once; besides those, the forward writes only the per-row statistics
  and the backward only one partial row per row-slot and gradient.
- The forward's register path reads the weight and bias once per block, whatever its rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_model

ROWS = 5  # a partial tile of rows for every rows-per-block, several row-slots
F32, BF16 = torch.float32, torch.bfloat16
# Each path once or twice, both ops and dtypes spread over them: short rows (tpr < 32), a warp per row, a block
# per row, the backward's shared-memory path (beyond 8192 values) with the forward in registers, the forward's
# shared-memory path (beyond 16384; a cluster of 2 for float32 LayerNorm, whose weight and bias take twice the
# row's bytes).
CASES = [
    ("layer_norm", "fwd", F32, 256),
    ("rms_norm", "fwd", BF16, 1024),
    ("layer_norm", "fwd", BF16, 4096),
    ("rms_norm", "fwd", F32, 12288),
    ("layer_norm", "fwd", F32, 20480),
    ("rms_norm", "fwd", BF16, 20480),
    ("layer_norm", "bwd", F32, 256),
    ("rms_norm", "bwd", BF16, 1024),
    ("layer_norm", "bwd", F32, 4096),
    ("rms_norm", "bwd", BF16, 4096),
    ("layer_norm", "bwd", BF16, 12288),
    ("rms_norm", "bwd", F32, 12288),
]


@pytest.mark.parametrize("op,mode,dtype,cols", CASES)
def test_traffic(op, mode, dtype, cols):
    log = kernel_model.emulate(op, mode, cols, ROWS, dtype, (2, 2048))
    # 16-byte vectors: whole sectors, in the row kernel and in the backward's reduce; no bank conflicts.
    for launch in log:
        assert launch["coalesced_sector_bytes"] > 0, launch["kernel"]
        efficiency = launch["coalesced_bytes"] / launch["coalesced_sector_bytes"]
        assert efficiency == 1.0, f"{launch['kernel']}: sector efficiency {efficiency:.3f}"
        assert launch["bank_conflicts"] == 0, launch["kernel"]
    # The backward's reduce is a programmatic dependent launch (its launch overlaps the row kernel's end); the row
    # kernel, which may follow anything, is not.
    assert [launch["dependent"] for launch in log] == [False] + [True] * (len(log) - 1)
    assert len(log) == (2 if mode == "bwd" else 1)
    elem = dtype.itemsize
    plan = kernel_model.ops().plan(mode, ROWS, cols, elem, True, 0, kernel_model.parameter_count(op))
    items, blocks, cluster, partial_cluster = plan[1], plan[4], plan[5], plan[9]
    if items == 0 and cluster == 0:
        return  # the multi-pass paths re-read rows by design (issue 10); the model reports by how much
    launch = log[0]
    row_bytes = ROWS * cols * elem
    regions = launch["regions"]
    assert regions["x"][0] == row_bytes, "x is read more than once"
    stats = 2 if op == "layer_norm" else 1  # float32 mean and rstd, or rstd alone
    if mode == "fwd":
        # Stores: y, then one float32 per row and statistic.
        assert launch["store_bytes"] == row_bytes + ROWS * 4 * stats
    else:
        assert regions["dy"][0] == row_bytes, "dy is read more than once"
        # Stores: dx, then the partial-sum allowance: a float32 partial row per block (per cluster: of
        # partial_cluster groups of a block, or of a row's cluster of the shared-memory path) and parameter gradient.
        slots = blocks // (max(1, cluster) * partial_cluster)
        assert launch["store_bytes"] == row_bytes + slots * cols * 4 * kernel_model.parameter_count(op)


def test_counters_see_a_rereading_path():
    # The counters can fail the check above: the forward's multi-pass path (a device whose shared memory does not
    # hold the row) reads x more than once.
    launch = kernel_model.emulate("rms_norm", "fwd", 20480, 2, F32, (2, 2048, 1024))[0]
    assert "multipass" in launch["kernel"]
    assert launch["regions"]["x"][0] == 2 * 2 * 20480 * 4


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_forward_shared_row_reads_parameters_once_per_block(op, dtype):
    # The shared-memory path keeps each block's slice of the weight and bias on chip: on a device of one block (a
    # cluster of 2 for float32 LayerNorm), all ROWS rows read them once.
    cols = 20480
    plan = kernel_model.ops().plan("fwd", ROWS, cols, dtype.itemsize, True, 0, kernel_model.parameter_count(op))
    threads, cluster, sliced = plan[2], plan[5], plan[7]
    assert sliced
    launch = kernel_model.emulate(op, "fwd", cols, ROWS, dtype, (cluster, threads))[0]
    assert launch["grid"] == cluster == launch["cluster"]
    for name in ["weight", "bias"][: kernel_model.parameter_count(op)]:
        assert launch["regions"][name][0] == cols * dtype.itemsize, f"{name} is read more than once"


# The forward's register-path cases above.
FORWARD_REGISTER_CASES = [c for c in CASES if c[1] == "fwd" and c[3] <= 16384]


@pytest.mark.parametrize("op,mode,dtype,cols", FORWARD_REGISTER_CASES)
def test_forward_reads_parameters_once_per_block(op, mode, dtype, cols):
    # A device that holds one block: it walks all ROWS rows (several tiles) and reads the weight and bias once,
    # into its shared copy; x once as well: where the kernel prefetches the next tile's row, the loads past the
    # last tile are predicated off.
    _, _, threads_per_row, rows_per_block, *_ = kernel_model.ops().plan(mode, ROWS, cols, dtype.itemsize, True)
    launch = kernel_model.emulate(op, mode, cols, ROWS, dtype, (1, threads_per_row * rows_per_block))[0]
    assert launch["grid"] == 1 and ROWS > rows_per_block
    assert launch["regions"]["x"][0] == ROWS * cols * dtype.itemsize, "x is read more than once"
    for name in ["weight", "bias"][: kernel_model.parameter_count(op)]:
        assert launch["regions"][name][0] == cols * dtype.itemsize, f"{name} is read more than once"
