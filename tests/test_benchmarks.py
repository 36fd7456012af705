"""The benchmark scripts run end to end on the CPU and write a CSV of what they measured.

A smoke run at a tiny size: it checks that each script runs, covers the cases it was asked for, and that
torch_ln's (or the fused op's) results pass the script's own accuracy check. Speed is not judged here (the scripts'
exit status includes their speed bar, which a loaded CI machine may miss): only the CSV is read.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")
SIZES = ("256", "1000")  # 1000: rows that end in a partial vector step
MODES = ("fwd", "fwd+bwd")
TINY = ["--device", "cpu", "--quick", "--bytes", "64KiB", "--D", *SIZES, "--dtypes", *DTYPES, "--modes", *MODES]


def _run(script: str, args: list[str], out: Path) -> list[dict[str, str]]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]  # 1: a speed bar missed
    (csv_path,) = out.glob("*.csv")
    with csv_path.open() as file:
        return list(csv.DictReader(file))


def _check_rows(rows: list[dict[str, str]], checked: str, providers: set[str]) -> None:
    # Every (dtype, mode, D) asked for, once per provider.
    cases = {(r["dtype"], r["mode"], r["D"]) for r in rows}
    assert cases == {(dtype, mode, D) for dtype in DTYPES for mode in MODES for D in SIZES}
    assert {r["provider"] for r in rows} == providers
    assert len(rows) == len(cases) * len(providers)
    for row in rows:
        assert float(row["ms"]) > 0 and math.isfinite(float(row["gbps"])), row
        if row["provider"] == checked:
            assert row["check"] == "ok", row


@pytest.mark.parametrize("script, op", [("bench_layer_norm.py", "layer_norm"), ("bench_rms_norm.py", "rms_norm")])
def test_norm_benchmark(tmp_path, script, op):
    rows = _run(script, [*TINY, "--providers", "torch_ln", "torch"], tmp_path)
    assert {r["op"] for r in rows} == {op}
    _check_rows(rows, "torch_ln", {"torch_ln", "torch"})


def test_add_norm_benchmark(tmp_path):
    # Without the compiled pair: torch.compile would take minutes here (its own tests are in test_compile.py).
    args = [*TINY, "--op", "layer_norm", "--providers", "fused", "torch_ln_pair"]
    rows = _run("bench_add_norm.py", args, tmp_path)
    assert {r["op"] for r in rows} == {"add_layer_norm"}
    _check_rows(rows, "fused", {"torch", "fused", "torch_ln_pair"})


def test_environment_ab_times_each_setting_under_its_value(monkeypatch):
    from torch_ln import benchmark as harness

    monkeypatch.setenv("TLN_TEST_SETTING", "before")  # restored (removed) after the test
    seen = []
    settings = {"old": "0", "new": "1"}
    times = harness.environment_ab(
        lambda: seen.append(os.environ["TLN_TEST_SETTING"]), "TLN_TEST_SETTING", settings, 3, 4
    )
    # Each round: 5 warm-up and 4 timed calls under "0", then the same under "1".
    assert seen == (["0"] * 9 + ["1"] * 9) * 3
    assert {name: len(t) for name, t in times.items()} == {"old": 3, "new": 3}
    assert all(t > 0 for ts in times.values() for t in ts)
    assert harness.paired_ratios({"old": [2.0, 4.0], "new": [1.0, 4.0]}, "old", "new") == (
        "old median 3.0 us, new 2.5 us, paired ratio median 0.750 min 0.500 max 1.000"
    )
