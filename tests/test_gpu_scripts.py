"""The prepared GPU run's scripts stay usable between GPU sessions (a lent GPU is rare: a script found broken there
costs its lease).

scripts/experiment_overrides.diff (the TLN_X_* switches that ../shared/gpu-perf/sweep.py times) must apply to the
sources as they are: `bash scripts/build_for_gpu.sh --experiment` applies it to a copy of them. It was found not to
apply after the gated norm's kernels changed the launchers (2026-12-05); this catches the next such change here,
on the CPU, instead of on the GPU machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIFF = ROOT / "scripts" / "experiment_overrides.diff"


def test_experiment_overrides_apply_to_the_sources(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed: `git apply --check` is the check")
    text = DIFF.read_text()
    body = text[text.index("diff --git ") :]  # the prose above the first file header is the diff's description
    patch = tmp_path / "body.diff"
    patch.write_text(body)
    result = subprocess.run(
        ["git", "apply", "--check", str(patch)], check=False, cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, f"{DIFF.name} no longer applies to csrc/: port it\n{result.stderr}"
    assert "TLN_X_PREFETCH" in body and "TLN_X_NO_WAVE_CAP" in body  # the switches sweep.py times


def test_gpu_check_scores_committed_predictions():
    # The bench phase scores the run against predictions written before it: the file it names must be committed.
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    named = [w for w in script.split() if w.endswith("predictions.csv")]
    assert named and all((ROOT / w).is_file() for w in named), named


def test_gpu_check_ab_switches_exist_in_the_experiment_build():
    # The ab phase times the experiment build under TLN_X_* switches: each must be one the diff defines (a misspelt
    # or retired switch would time main's kernels twice under two names).
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    switches = set(re.findall(r"\b(TLN_X_[A-Z_]+)=", script))
    assert {"TLN_X_RING_STAGES", "TLN_X_NO_PREFETCH", "TLN_X_NO_BULK"} <= switches, switches
    body = DIFF.read_text().split("diff --git ", 1)[1]
    missing = sorted(s for s in switches if f'getenv("{s}")' not in body)
    assert not missing, f"gpu_check.sh's ab phase sets switches {DIFF.name} does not read: {missing}"
