"""The kernel model (benchmarks/kernel_model.py): its calibration reproduces the measured H200 cells it was fitted on,
its constants are the ones that calibration gives, and the per-row structure it counts from the kernels' code is
what the emulator counts for the same kernels.

The calibration test needs neither ptxas nor the emulator: the features of the calibration cells are stored with
the fit (benchmarks/results/2026-12-04-kernel-model-predictions/calibration.json) and the measured times are read
from the run's CSVs. The structure test runs the emulated kernels on a few rows (no ptxas).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_model

RUN = ROOT / "benchmarks" / "results" / "2026-12-04-h200-torch2.11"
CALIBRATION = ROOT / "benchmarks" / "results" / "2026-12-04-kernel-model-predictions" / "calibration.json"
CSVS = [RUN / "layer_norm_cuda.csv", RUN / "add_layer_norm_cuda.csv", RUN / "add_rms_norm_cuda.csv"]
TOLERANCE = 0.15  # issue 36: the calibrated model reproduces the 16 measured LayerNorm cells within +-15%


def _stored_rows() -> tuple[list[dict], list[dict]]:
    """The stored features of the calibration cells, with the measured times read afresh from the run's CSVs."""
    stored = json.loads(CALIBRATION.read_text())
    measured = {
        (c["op"], c["fused"], c["mode"], c["dtype"], c["D"], c["M"]): c["measured_us"]
        for c in kernel_model.measured_cells(CSVS, providers=("torch_ln", "fused"))
    }
    out = []
    for rows in (stored["cells"], stored["fused_cells"]):
        out.append([])
        for r in rows:
            key = (r["op"], r["fused"], r["mode"], r["dtype"], r["D"], r["M"])
            fields = ("features", "steps", "fixed_us", "copy_bound_us", "op", "fused", "mode", "dtype", "D", "M")
            out[-1].append({**{k: r[k] for k in fields}, "measured_us": measured.pop(key)})
    assert not measured, f"measured cells without stored features: {sorted(measured)}"
    return out[0], out[1]


def test_calibration_reproduces_the_measured_cells():
    plain, fused = _stored_rows()
    assert len(plain) == 16 and all(r["op"] == "layer_norm" for r in plain)
    assert len(fused) == 16
    names = [k for k in kernel_model.FEATURES if k != "lone_dram"]
    us_per, _ = kernel_model.fit_constants(plain, names, {"lone_dram": 0.0})
    us_per, _ = kernel_model.fit_constants(fused, ["lone_dram"], us_per)
    # The script's constants are this fit's (rerun --calibrate and paste them after a new fit).
    for k, v in us_per.items():
        assert kernel_model.CALIBRATION["us_per"][k] == pytest.approx(v, rel=1e-3, abs=1e-6), k
    # Well below one constant per cell.
    assert len(kernel_model.FEATURES) <= 7
    for r in plain + fused:
        ratio = r["measured_us"] / kernel_model.predicted_us(r, kernel_model.CALIBRATION["us_per"])
        assert abs(ratio - 1) <= TOLERANCE, (
            f"{r['op']} {r['mode']} {r['dtype']} D={r['D']}: measured / model {ratio:.3f}"
        )


def test_leave_one_out_stays_within_a_quarter():
    """Fitted on 15 LayerNorm cells, the model predicts the 16th within 25% (it does within 12.2% today): a guard
    against a change of features that fits the calibration cells but predicts nothing."""
    plain, _ = _stored_rows()
    names = [k for k in kernel_model.FEATURES if k != "lone_dram"]
    for i, r in enumerate(plain):
        us_per, _ = kernel_model.fit_constants(plain[:i] + plain[i + 1 :], names, {"lone_dram": 0.0})
        ratio = r["measured_us"] / kernel_model.predicted_us(r, us_per)
        assert abs(ratio - 1) <= 0.25, f"{r['mode']} {r['dtype']} D={r['D']}: leave-one-out ratio {ratio:.3f}"


def test_nnls():
    np = pytest.importorskip("numpy")
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = kernel_model.nnls(a, np.array([1.0, -1.0, 0.5]))  # unconstrained: x2 < 0
    assert x[1] == 0.0 and x[0] == pytest.approx(0.75)
    assert kernel_model.nnls(a, a @ np.array([2.0, 3.0])) == pytest.approx([2.0, 3.0])


# Every path and unit kind the model distinguishes, both ops and dtypes, plain and fused.
STRUCTURE_CASES = [
    ("layer_norm", "fwd", "float32", 256, False),  # rows of 16 threads: two rows a warp
    ("layer_norm", "fwd", "bfloat16", 512, False),  # a warp a row
    ("rms_norm", "fwd", "float32", 4096, True),  # a block a row, the residual add
    ("layer_norm", "fwd", "float32", 32768, False),  # a cluster of 2 per row
    ("rms_norm", "fwd", "bfloat16", 32768, False),  # a block's shared memory per row
    ("layer_norm", "bwd", "float32", 512, True),  # a warp a row, the residual's gradient
    ("rms_norm", "bwd", "bfloat16", 4096, False),  # two rows a block
    ("layer_norm", "bwd", "bfloat16", 16384, False),  # a block's shared memory, in clusters of 8 such blocks
    ("rms_norm", "bwd", "float32", 32768, False),  # clusters of 4 per row, 4 rows to a cluster of 16
]


@pytest.mark.emulated
@pytest.mark.parametrize("op,mode,dtype,D,fused", STRUCTURE_CASES)
def test_structure_is_the_emulators(op, mode, dtype, D, fused):
    """The shared-memory requests and barriers per row that the model counts from the kernels' code are those the
    emulator counts running them: a kernel change the model does not know of fails here."""
    assert kernel_model.check_structure(op, mode, dtype, D, fused) == "ok"
