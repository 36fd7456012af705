#!/usr/bin/env bash
# Builds the wheel, installs it into a fresh venv that shares this environment's torch, and runs a smoke test
# there with no compiler on the PATH (so nothing can be built on the fly):
#   bash scripts/wheel_check.sh            (TORCH_LN_FORCE_CPU=1 for a CPU-only wheel; MAX_JOBS as for setup.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install --quiet "build==1.2.2.post1"
rm -rf dist
"$PYTHON" -m build --wheel --no-isolation
wheel=$(ls dist/torch_ln-*.whl)
unzip -p "$wheel" '*/METADATA' | grep '^Requires-Dist: torch=='

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
venv=$scratch/venv
# --system-site-packages: the same torch (a binary torch_ln works with the torch it was built against only).
"$PYTHON" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-deps "$wheel"
cd "$venv"  # away from the source tree, so `import torch_ln` finds the installed one
env -i PATH="$venv/bin" HOME="$HOME" "$venv/bin/python" - <<'PY'
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_ln

assert not any(shutil.which(c) for c in ("cc", "gcc", "c++", "g++", "nvcc")), "a compiler is on the PATH"
assert "/venv/" in torch_ln.__file__, f"not the installed torch_ln: {torch_ln.__file__}"
print("torch_ln from", torch_ln.__file__, "with torch", torch.__version__)
x = torch.randn(6, 257, requires_grad=True)
w = torch.randn(257, requires_grad=True)
y = torch_ln.layer_norm(x, (257,), w)
torch.testing.assert_close(y, F.layer_norm(x, (257,), w))
torch.testing.assert_close(torch_ln.rms_norm(x, (257,), w), F.rms_norm(x, (257,), w))
y.sum().backward()
assert x.grad is not None and w.grad is not None
prefix = Path(torch_ln.cmake_prefix_path())
assert (prefix / "torch_ln" / "torch_lnConfig.cmake").is_file()
assert (prefix.parent.parent / "include" / "torch_ln" / "torch_ln.h").is_file()
print("wheel smoke test passed")
PY
