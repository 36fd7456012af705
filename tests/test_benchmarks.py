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


def test_latency_benchmark(tmp_path):
    # benchmarks/bench_latency.py on the CPU (eager only: CUDA graphs need a GPU), torch_ln and torch eager.
    Ms, Ds, steps = ("1", "8"), ("1000", "4096"), ("fwd", "fwd+bwd")
    args = ["--device", "cpu", "--quick", "--providers", "torch_ln", "torch", "--M", *Ms, "--D", *Ds]
    rows = _run("bench_latency.py", [*args, "--dtypes", *DTYPES, "--steps", *steps], tmp_path)
    cases = {(r["op"], r["dtype"], r["step"], r["M"], r["D"]) for r in rows}
    ops = ("layer_norm", "rms_norm")
    assert cases == {
        (op, dtype, step, M, D) for op in ops for dtype in DTYPES for step in steps for M in Ms for D in Ds
    }
    assert {(r["provider"], r["mode"], r["device"]) for r in rows} == {
        ("torch_ln", "eager", "cpu"),
        ("torch", "eager", "cpu"),
    }
    assert len(rows) == 2 * len(cases)
    for row in rows:
        assert float(row["us_per_call"]) > 0, row
        if row["provider"] == "torch_ln":
            assert row["check"] == "ok", row


def test_compile_pass_benchmark(tmp_path):
    # benchmarks/bench_compile_pass.py at a tiny size with the aot_eager inner backend (Inductor's code generation
    # would take minutes here): every case, step and provider, and the pass's output bitwise the swapped model's.
    args = ["--device", "cpu", "--quick", "--hidden", "64", "--seq", "16", "--layers", "2", "--inner", "aot_eager"]
    rows = _run("bench_compile_pass.py", args, tmp_path)
    assert {(r["case"], r["step"], r["provider"]) for r in rows} == {
        (case, step, provider)
        for case in ("block", "model")
        for step in ("fwd", "fwd+bwd")
        for provider in ("compile", "pass", "swapped")
    }
    assert len(rows) == 12
    for row in rows:
        assert float(row["ms"]) > 0, row
        assert row["check"] == ("bitwise" if row["provider"] == "pass" else ""), row


def test_memory_efficient_benchmark(tmp_path):
    # benchmarks/bench_memory_efficient.py at a tiny size: both norms and options, and the option saves less (the
    # norms' inputs, two [batch x seq, hidden] rows per block, no longer held).
    args = ["--device", "cpu", "--quick", "--hidden", "64", "--seq", "16", "--layers", "2"]
    rows = _run("bench_memory_efficient.py", args, tmp_path)
    assert {(r["norm"], r["option"]) for r in rows} == {
        (norm, option) for norm in ("rms", "layer") for option in ("saves x", "memory_efficient")
    }
    for row in rows:
        assert float(row["step_ms"]) > 0 and float(row["norm_bwd_ms"]) > 0, row
        if row["option"] == "memory_efficient":
            assert float(row["saved_vs_plain"]) < 1, row


def test_quant_benchmark(tmp_path):
    # benchmarks/bench_quant.py at a tiny size: every op and scale mode, the fused op's codes at most one step from
    # the two-step's (its y is torch's, rounded otherwise).
    args = [
        "--device",
        "cpu",
        "--quick",
        "--rows",
        "8",
        "--cols",
        "256",
        "--dtypes",
        "float32",
        "--providers",
        "torch_ln",
    ]
    rows = _run("bench_quant.py", args, tmp_path)
    assert {(r["op"], r["mode"], r["provider"]) for r in rows} == {
        (op, mode, provider)
        for op in ("rms_norm", "add_rms_norm", "layer_norm")
        for mode in ("static", "per_token", "per_group_128")
        for provider in ("torch_ln", "torch")
    }
    for row in rows:
        assert float(row["ms"]) > 0 and int(row["codes_apart_vs_torch"]) <= 1, row


def test_gated_benchmark(tmp_path):
    # benchmarks/bench_gated.py at a tiny size: both forms and modes, torch_ln's outputs and gradients within bfloat16's
    # rounding (2^-8 relative, and a flip propagated through the gradient's mean terms) of the torch-ops form's.
    args = ["--quick", "--rows", "8", "--cols", "256", "1000", "--dtypes", "bfloat16", "--providers", "torch_ln"]
    rows = _run("bench_gated.py", args, tmp_path)
    assert {(r["form"], r["mode"], r["D"], r["provider"]) for r in rows} == {
        (form, mode, D, provider)
        for form in ("mamba2", "qwen3_next")
        for mode in MODES
        for D in ("256", "1000")
        for provider in ("torch_ln", "torch")
    }
    for row in rows:
        assert float(row["ms"]) > 0 and float(row["difference_vs_torch"]) <= 3e-2, row
