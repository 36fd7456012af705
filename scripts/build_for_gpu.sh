#!/usr/bin/env bash
# Makes, on this CPU machine, the build that the lent GPU machine runs, so that a GPU session spends no device time
# compiling (the build took 194 s of the H200's lease on 2026-12-04). The GPU machine has torch 2.11.0+cu130,
# Python 3.12, nvcc 13.0, an H200 (sm_90) and no network; this builds for exactly that:
#   - a venv of python3.12 with torch==2.11.0 (PyPI's Linux build of 2.11.0 is the cu130 one) + ninja, setuptools,
#     packaging, made once and reused while its requirements stay the same ($HOME/.cache/torch_ln/gpu-venv-...);
#   - the working tree's files (tracked, and untracked ones git does not ignore: what the device tool copies), synced
#     into a scratch source tree ($GPU_BUILD_SCRATCH) that is kept, so a rebuild compiles only what changed;
#   - TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-2} python setup.py build_ext --inplace, against /usr/local/cuda
#     (nvcc 13.0; the headers it lacks, cuBLAS and friends, come from the nvidia-* wheels beside torch: setup.py);
#   - the two shared libraries stripped of debug sections, into gpu_build/ (git-ignored):
#       gpu_build/torch_ln/lib/libtorch_ln.so  gpu_build/torch_ln/_C.cpython-312-x86_64-linux-gnu.so
#       gpu_build/torch_ln/_build_info.py      gpu_build/SOURCES.sha256 (what it was built from)  gpu_build/BUILD.txt
#   - a check that the result loads in that venv (no GPU needed): torch.ops.load_library, then import torch_ln and a
#     CPU call, from a copy of the package away from the sources.
# Why the working tree and not the committed one: the device run copies the working tree, and the build must be of
# the sources that travel with it. SOURCES.sha256 (setup.py, csrc/ but the emulator, torch_ln/include/) lets
# `gpu_check.sh carried` refuse a build that does not match the tree it lands in: build right before the GPU run,
# after the last edit of those files.
#   nice -n 10 bash scripts/build_for_gpu.sh
#   nice -n 10 bash scripts/build_for_gpu.sh --experiment   # the same with scripts/experiment_overrides.diff applied
#     (the TLN_X_* switches that ../shared/gpu-perf/sweep.py times), into gpu_build_experiment/: carry it beside
#     gpu_build/ and copy its torch_ln/ over the package before gpu_profile.sh, as gpu_check.sh's header says
#     (gpu_check.sh's `carried` refuses it: its sources are not the tree's)
# 13.5 minutes from scratch on the 2-core machine (2026-12-04; build_ext 815 s); seconds when nothing compiled changed.
# Then: device run, carry ["gpu_build", ".whl"], command `bash scripts/gpu_check.sh carried tests sanitizer bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3.12}
TORCH_VERSION=2.11.0
EXPECTED_TORCH=2.11.0+cu130 # torch.__version__ on the GPU machine: _build_info.py must name exactly this
ARCH=9.0
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
REQUIREMENTS="torch==$TORCH_VERSION ninja setuptools>=70.1 packaging"
KEY=cp312-torch$TORCH_VERSION
VENV=${GPU_BUILD_VENV:-$HOME/.cache/torch_ln/gpu-venv-$KEY}
SCRATCH=${GPU_BUILD_SCRATCH:-/tmp/torch_ln-gpu-build-$KEY-sm${ARCH/./}}
SRC=$SCRATCH/src
DEST=$ROOT/gpu_build
EXPERIMENT=
if [[ ${1:-} == --experiment ]]; then
  EXPERIMENT=$ROOT/scripts/experiment_overrides.diff
  DEST=$ROOT/gpu_build_experiment
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--experiment]" >&2
  exit 2
fi
CARRY_LIMIT=$((64 * 1024 * 1024)) # what the device tool carries at most, all carried paths together
start=$SECONDS

# The files that make the compiled artifacts: the same list is hashed again by gpu_check.sh on the device.
source_manifest() {
  (cd "$1" && find setup.py csrc torch_ln/include -type f ! -path 'csrc/emulated/*' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum)
}

echo "=== venv: $VENV"
if [[ -x $VENV/bin/python && "$(cat "$VENV/.torch_ln_requirements" 2> /dev/null)" == "$REQUIREMENTS" ]]; then
  echo "reused"
else
  if ! "$PYTHON" --version > /dev/null 2>&1; then # a pyenv shim of a version not selected: take it from pyenv
    pyenv_python=$(ls -d "$(pyenv root 2> /dev/null)"/versions/3.12*/bin/python3.12 2> /dev/null | tail -1)
    [[ -n $pyenv_python ]] || { echo "no working $PYTHON (set PYTHON to a Python 3.12)" >&2; exit 1; }
    PYTHON=$pyenv_python
  fi
  echo "creating it with $PYTHON ($("$PYTHON" --version))"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  # shellcheck disable=SC2086 # the requirements are separate words
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $REQUIREMENTS
  echo "$REQUIREMENTS" > "$VENV/.torch_ln_requirements"
fi
export PATH=$VENV/bin:$PATH # ninja
found=$("$VENV/bin/python" -c "import sys, torch; print('%d.%d' % sys.version_info[:2], torch.__version__)")
if [[ $found != "3.12 $EXPECTED_TORCH" ]]; then
  echo "the venv has Python/torch $found, not 3.12 $EXPECTED_TORCH" >&2
  exit 1
fi
nvcc_version=$("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*')
echo "Python 3.12, torch $EXPECTED_TORCH, nvcc $nvcc_version ($CUDA_HOME)"
[[ $nvcc_version == "release 13.0" ]] || echo "warning: the GPU machine has nvcc 13.0"

echo "=== sources: the working tree -> $SRC"
mkdir -p "$SRC"
# Copies the files whose content differs (they get a new mtime, so ninja recompiles what depends on them), removes
# those gone from the tree, and keeps the build outputs (build/, the .so files, _build_info.py) for ninja.
git ls-files -co --exclude-standard -z > "$SCRATCH/files"
"$VENV/bin/python" - "$ROOT" "$SRC" "$SCRATCH/files" << 'PY'
import shutil, sys
from pathlib import Path

root, src = Path(sys.argv[1]), Path(sys.argv[2])
names = {n for n in Path(sys.argv[3]).read_text().split("\0") if n and (root / n).is_file()}
copied = 0
for name in sorted(names):
    here, there = root / name, src / name
    if not there.is_file() or there.read_bytes() != here.read_bytes():
        there.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(here, there)
        copied += 1
outputs = ("build/", "torch_ln/lib/", "torch_ln/_build_info.py")
removed = 0
for path in src.rglob("*"):
    name = path.relative_to(src).as_posix()
    if path.is_file() and name not in names and not name.startswith(outputs) and not name.endswith(".so"):
        if "__pycache__" not in name and ".egg-info" not in name:
            path.unlink()
            removed += 1
print(f"{len(names)} files: {copied} copied (new or changed), {removed} removed")
PY
git -C "$ROOT" describe --always --dirty > "$SCRATCH/revision" 2> /dev/null || echo unknown > "$SCRATCH/revision"
if [[ -n $EXPERIMENT ]]; then # the next plain build's sync puts back the files it changes (their content differs)
  (cd "$SRC" && git apply "$EXPERIMENT")
  echo "+ $(basename "$EXPERIMENT")" >> "$SCRATCH/revision"
fi

echo "=== build: TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=${MAX_JOBS:-2} setup.py build_ext --inplace"
echo "(log: $SCRATCH/build.log)"
# Without the outputs setuptools always relinks (it does not see header changes); ninja recompiles what is stale.
rm -f "$SRC"/torch_ln/lib/libtorch_ln.so "$SRC"/torch_ln/_C.*.so "$SRC"/torch_ln/_build_info.py
build_start=$SECONDS
if ! (cd "$SRC" && TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=${MAX_JOBS:-2} TORCH_LN_FORCE_CPU=0 \
  "$VENV/bin/python" setup.py build_ext --inplace > "$SCRATCH/build.log" 2>&1); then
  tail -40 "$SCRATCH/build.log"
  echo "BUILD FAILED (log: $SCRATCH/build.log)" >&2
  exit 1
fi
build_seconds=$((SECONDS - build_start))
echo "built in $build_seconds s"
module=$(cd "$SRC/torch_ln" && ls _C.cpython-312-*.so)
"$VENV/bin/python" - "$SRC/torch_ln/_build_info.py" "$EXPECTED_TORCH" "$ARCH" << 'PY'
import runpy, sys

info = runpy.run_path(sys.argv[1])
want = {"TORCH_VERSION": sys.argv[2], "WITH_CUDA": True, "CUDA_ARCH_LIST": sys.argv[3]}
got = {k: info[k] for k in want}
assert got == want, f"_build_info.py says {got}, wanted {want}"
PY

echo "=== gpu_build/"
rm -rf "$DEST.new"
mkdir -p "$DEST.new/torch_ln/lib"
strip --strip-debug -o "$DEST.new/torch_ln/lib/libtorch_ln.so" "$SRC/torch_ln/lib/libtorch_ln.so"
strip --strip-debug -o "$DEST.new/torch_ln/$module" "$SRC/torch_ln/$module"
cp "$SRC/torch_ln/_build_info.py" "$DEST.new/torch_ln/"
source_manifest "$SRC" > "$DEST.new/SOURCES.sha256"
{
  echo "built $(date -u +%FT%TZ) on $(hostname) from the working tree at $(cat "$SCRATCH/revision")"
  echo "Python 3.12, torch $EXPECTED_TORCH, nvcc $nvcc_version, TORCH_CUDA_ARCH_LIST=$ARCH, stripped (--strip-debug)"
  echo "build_ext took $build_seconds s with MAX_JOBS=${MAX_JOBS:-2}"
} > "$DEST.new/BUILD.txt"
if [[ -x $CUDA_HOME/bin/cuobjdump ]]; then # not in every toolkit (not in this machine's)
  archs=$("$CUDA_HOME/bin/cuobjdump" --list-elf "$DEST.new/torch_ln/lib/libtorch_ln.so" |
    grep -o 'sm_[0-9]*' | sort -u | tr '\n' ' ')
  echo "device code: $archs" | tee -a "$DEST.new/BUILD.txt"
  [[ $archs == "sm_90 " ]] || { echo "expected sm_90 code only" >&2; exit 1; }
fi

echo "=== load check (no GPU needed), away from the sources"
check=$SCRATCH/check
rm -rf "$check"
mkdir -p "$check"
cp -r "$SRC/torch_ln" "$check/"
find "$check/torch_ln" -name '__pycache__' -prune -exec rm -rf {} +
cp -r "$DEST.new/torch_ln/." "$check/torch_ln/"
(cd "$check" && "$VENV/bin/python" - << 'PY')
import torch

torch.ops.load_library("torch_ln/lib/libtorch_ln.so")
assert hasattr(torch.ops.torch_ln, "layer_norm_fwd")
import torch_ln  # noqa: E402  (loads the library again, and _C)
import torch_ln._extension as extension  # noqa: E402

assert extension.cuda_compiled()
x = torch.randn(4, 1000)
w, b = torch.randn(1000), torch.randn(1000)
y = torch_ln.layer_norm(x, (1000,), w, b)
torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (1000,), w, b))
print(f"loads: torch {torch.__version__}, torch.ops.torch_ln.layer_norm_fwd, import torch_ln, a CPU layer_norm")
PY

rm -rf "$DEST"
mv "$DEST.new" "$DEST"
(cd "$ROOT" && find "$(basename "$DEST")" -type f -printf '%10s  %p\n' | sort -k2)
total=$(du -sb "$DEST" | cut -f1)
wheels=0
[[ -d $ROOT/.whl ]] && wheels=$(du -sb "$ROOT/.whl" | cut -f1)
unstripped=$(($(stat -c %s "$SRC/torch_ln/lib/libtorch_ln.so") + $(stat -c %s "$SRC/torch_ln/$module")))
echo "$(basename "$DEST"): $((total / 1024)) KiB (the two libraries unstripped: $((unstripped / 1024)) KiB);" \
  "with .whl/: $(((total + wheels) / 1024)) KiB of the $((CARRY_LIMIT / 1024)) KiB the device tool carries"
((total + wheels <= CARRY_LIMIT)) || { echo "too large to carry" >&2; exit 1; }
echo "done in $((SECONDS - start)) s"
echo "next: device run, carry [\"gpu_build\", \".whl\"]: bash scripts/gpu_check.sh carried tests sanitizer bench"
