"""Builds one torch_ln wheel per supported torch release, into dist/: each in a fresh virtual environment holding that
torch (a binary torch_ln works with the torch it was built against only), from a clean copy of the committed tree.

    python scripts/build_wheels.py                  # the newest patch release of every torch minor in the range
    python scripts/build_wheels.py 2.11.0 2.14.1    # these releases
    TORCH_LN_FORCE_CPU=1 python scripts/build_wheels.py 2.13.0

The supported range is pyproject.toml's build requirement (setup.py's supported_torch). Each wheel's version has a
local label naming its torch and CUDA (0.1.0+pt211cu130; +pt211cpu for a CPU-only build) and requires exactly that
torch, so wheels for every release can share one folder or index: `pip install torch_ln==0.1.0+pt212cu130`, or
`pip install torch_ln "torch==2.12.*" --find-links dist`, where pip's resolver keeps the wheel whose torch fits.
GPU code: TORCH_CUDA_ARCH_LIST if set, else setup.py's default (sm_80, sm_90, sm_100, sm_120 and PTX for later GPUs).
Each build is a full one (about 15 minutes of a 2-core machine for the CPU kernels and four GPU architectures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch_range import supported_torch

ROOT = Path(__file__).resolve().parents[1]


def supported_range() -> SpecifierSet:
    return SpecifierSet(supported_torch())


def newest_per_minor(python: str) -> list[str]:
    """The newest patch release of each torch minor that the range admits, as the package index lists them."""
    out = subprocess.run(
        [python, "-m", "pip", "index", "versions", "torch", "--json"], capture_output=True, text=True, check=True
    ).stdout
    versions = [Version(v) for v in json.loads(out)["versions"] if v in supported_range()]
    newest: dict[tuple, Version] = {}
    for v in versions:
        if not v.is_prerelease and v > newest.get((v.major, v.minor), Version("0")):
            newest[(v.major, v.minor)] = v
    return [str(v) for _, v in sorted(newest.items())]


def build(version: str, dist: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix=f"torch_ln-wheel-{version}-") as scratch:
        scratch = Path(scratch)
        venv = scratch / "venv"
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        python = str(venv / "bin" / "python")
        pip = [python, "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"torch=={version}", "ninja", "setuptools>=70.1", "build==1.2.2.post1"], check=True)
        source = scratch / "src"
        source.mkdir()
        # The committed tree only: no build outputs of this checkout.
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
        env = {**os.environ, "TORCH_LN_LOCAL_VERSION": "1"}
        subprocess.run(
            [python, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)], cwd=source, env=env, check=True
        )
        (wheel,) = sorted(dist.glob("torch_ln-*.whl"), key=lambda p: p.stat().st_mtime)[-1:]
        # The wheel installs beside its torch and loads: a quick smoke test away from the source tree.
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
        check = "import torch, torch_ln; x = torch.randn(3, 8); assert torch_ln.layer_norm(x, (8,)).shape == x.shape"
        subprocess.run([python, "-c", check], cwd=scratch, check=True)
        return wheel


def main(argv: list[str]) -> int:
    dist = ROOT / "dist"
    dist.mkdir(exist_ok=True)
    versions = argv or newest_per_minor(sys.executable)
    outside = [v for v in versions if v not in supported_range()]
    if outside:
        print(f"torch {', '.join(outside)} outside the supported range torch{supported_range()}", file=sys.stderr)
        return 2
    for version in versions:
        print(f"torch {version}: building", flush=True)
        print(f"torch {version}: {build(version, dist)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
