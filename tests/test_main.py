"""`python -m torch_ln`: the self-check exits 0 and prints its model check and timing table.

It times real shapes, so this runs it once (about a minute and a half on a 2-core CPU) and
checks everything on that one output.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torch_ln.__main__ as self_check


@pytest.fixture(scope="module")
def result():
    return subprocess.run(
        [sys.executable, "-m", "torch_ln"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
        check=False,
    )


def test_exits_zero_and_passes(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.rstrip().splitlines()[-1].startswith("PASS: torch_ln's results agree")


def test_model_check_line(result):
    lines = [line for line in result.stdout.splitlines() if line.startswith("model check:")]
    assert len(lines) == 1, result.stdout
    assert "7/7 norms replaced" in lines[0]
    assert lines[0].endswith("-> PASS")


def test_hf_llama_check_line(result):
    pytest.importorskip("transformers", reason="the HF Llama check needs transformers (pip install)")
    lines = [line for line in result.stdout.splitlines() if line.startswith("HF Llama check")]
    assert len(lines) == 1, result.stdout
    assert "5/5 LlamaRMSNorm replaced" in lines[0]  # 2 layers x 2 norms + the final norm
    assert lines[0].endswith("-> PASS")


def test_timing_table(result):
    lines = result.stdout.splitlines()
    headers = [line for line in lines if line.split()[:3] == ["dtype", "mode", "D"]]
    assert len(headers) == 2, result.stdout  # one table per op
    for op in ("layer_norm:", "rms_norm:"):
        assert op in lines
    # dtype mode D M torch_ln-ms torch-ms speedup check [SLOWER than torch]
    rows = [line.split() for line in lines if line.split()[:1] in (["float32"], ["bfloat16"])]
    # 2 ops x 2 dtypes x (fwd, fwd+bwd) x the shapes
    assert len(rows) == 2 * 2 * 2 * len(self_check.SHAPES), result.stdout
    for row in rows:
        assert row[7] == "ok", f"torch_ln row not ok: {' '.join(row)}"
        assert float(row[4]) > 0 and float(row[5]) > 0  # times in ms
    # Rows where torch_ln was slower than torch are marked (the printed speedup has 2 decimals: 0.995-1.005 may go
    # either way), and the last line counts the marks.
    marked = [row for row in rows if row[8:] == ["SLOWER", "than", "torch"]]
    assert all(row[8:] in ([], ["SLOWER", "than", "torch"]) for row in rows)
    for row in rows:
        speedup = float(row[6].rstrip("x"))
        assert (row in marked) == (speedup < 1.0) or speedup == 1.0, " ".join(row)
    assert lines[-1].endswith(f"SLOWER than torch eager in {len(marked)} of {len(rows)} timed cases")
