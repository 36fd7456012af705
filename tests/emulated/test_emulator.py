"""The SIMT emulator's own checks (csrc/emulated/simt_emulator.cpp): barriers and shuffles give the right values,
a kernel that would hang a GPU (a barrier some threads never reach) or diverge at barriers fails at once with a
message instead of hanging, and a dependent launch that would read its predecessor's output too early fails."""

from __future__ import annotations

import os
import subprocess

import emulated_build as build
import pytest


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    program = tmp_path_factory.mktemp("emulator") / "emulator_checks"
    emulator = build.ROOT / "csrc" / "emulated"
    source = build.ROOT / "tests" / "emulated" / "emulator_checks.cpp"
    compile_ = ["g++", "-std=c++20", "-O1", f"-I{emulator}", str(source), str(emulator / "simt_emulator.cpp")]
    subprocess.run([*compile_, "-o", str(program)], check=True, env=_without_preload())
    return program


def _without_preload():
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _run(program, check):
    return subprocess.run(
        [str(program), check], check=False, capture_output=True, text=True, timeout=60, env=_without_preload()
    )


def test_barriers_and_shuffles(checks):
    result = _run(checks, "values")
    assert result.returncode == 0, result.stderr
    # Every block: the sum of 0..63 (pairs swapped, nothing lost or repeated); 6 blocks.
    assert result.stdout.split() == ["sum", str(6 * 63 * 64 // 2)]


@pytest.mark.parametrize(
    "check,message",
    [
        ("deadlock", "deadlock: threads wait at a barrier that not every thread of the block reaches"),
        ("divergent", "divergent barrier: some threads reached 'cluster barrier', others 'block end'"),
        # On a GPU the read could see the kernel before it still writing (programmatic dependent launch).
        ("dependent", "a dependent launch touched global memory before wait_for_prior_grid"),
    ],
)
def test_hang_fails_with_a_message(checks, check, message):
    result = _run(checks, check)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_dependent_launch_reads_after_waiting(checks):
    result = _run(checks, "dependent_waits")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["read"]
