"""Memory-traffic gates on the CUDA kernels, from the SIMT emulator's counters (csrc/emulated/simt_emulator.h).

- The 16-byte vector paths use every byte of every 32-byte sector their warp-wide requests touch (sector
  efficiency 1.0, as Nsight Compute counts it), in the row kernels and in the backward's reduce.
- The register-resident paths read x (and dy) exactly once and write y (dx) exactly once; besides those, the
  forward writes only the per-row statistics and the backward only one partial row per row-slot and gradient.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_model  # noqa: E402

ROWS = 5  # a partial tile of rows for every rows-per-block, several row-slots
# Short rows (tpr < 32), a warp per row, a block per row, and the multi-pass paths (forward beyond 16384
# float32/bfloat16 values, backward beyond 8192).
CASES = [256, 1024, 4096, 8192, 12288, 20480]


def _row_kernel(log):
    return log[0]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("mode", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", CASES)
def test_vector_paths_use_whole_sectors(op, mode, dtype, cols):
    log = kernel_model.emulate(op, mode, cols, ROWS, dtype, (2, 2048))
    for launch in log:
        assert launch["coalesced_sector_bytes"] > 0, launch["kernel"]
        efficiency = launch["coalesced_bytes"] / launch["coalesced_sector_bytes"]
        assert efficiency == 1.0, f"{launch['kernel']}: sector efficiency {efficiency:.3f}"
        assert launch["bank_conflicts"] == 0, launch["kernel"]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("mode", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [c for c in CASES if c <= 8192])
def test_register_paths_move_each_row_once(op, mode, dtype, cols):
    elem = dtype.itemsize
    ops = kernel_model.ops()
    vec, items, tpr, rpb, blocks = ops.plan(mode, ROWS, cols, elem, True)
    assert items > 0, "not a register-resident case"
    launch = _row_kernel(kernel_model.emulate(op, mode, cols, ROWS, dtype, (2, 2048)))
    row_bytes = ROWS * cols * elem
    regions = launch["regions"]
    assert regions["x"][0] == row_bytes, "x is read more than once"
    stats = 2 if op == "layer_norm" else 1  # float32 mean and rstd, or rstd alone
    if mode == "fwd":
        # Stores: y, then one float32 per row and statistic.
        assert launch["store_bytes"] == row_bytes + ROWS * 4 * stats
    else:
        assert regions["dy"][0] == row_bytes, "dy is read more than once"
        # Stores: dx, then the partial-sum allowance: a float32 partial row per row-slot and parameter gradient.
        slots = blocks * rpb
        assert launch["store_bytes"] == row_bytes + slots * cols * 4 * kernel_model.parameter_count(op)


def test_counters_see_a_rereading_path():
    # The counters can fail the check above: the forward's multi-pass path reads x more than once.
    launch = _row_kernel(kernel_model.emulate("rms_norm", "fwd", 20480, 2, torch.float32, (2, 2048)))
    assert launch["regions"]["x"][0] == 2 * 2 * 20480 * 4
