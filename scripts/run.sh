#!/usr/bin/env bash
# One command for each job, set-up included (Python >= 3.10 on PATH as python3, or $PYTHON):
#   bash scripts/run.sh main   installs, builds, and runs the self-check `python -m torch_ln`
#   bash scripts/run.sh test   installs, builds, and runs the test suite: the main suite, then
#                              the CUDA kernels under SIMT emulation with ASan, UBSan and the
#                              emulator's shared-memory race check, then
#                              under gcov, then the kernel gates (tests/gates; needs nvcc), then the
#                              main suite on the oldest supported torch (scripts/test_oldest_torch.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# torch first: the extension builds against the installed torch (--no-build-isolation), from the supported range
# that pyproject.toml's build requirement states.
"$PYTHON" -m pip install --quiet "$("$PYTHON" scripts/torch_range.py)" ninja pytest pytest-xdist numpy expecttest transformers==5.23.0 timm==1.0.31
# The GPU architectures the tests cover (sm_90: the gates; sm_80: the fallbacks); setup.py's default adds sm_100,
# sm_120 and PTX, at about twice the CUDA build time.
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0} "$PYTHON" -m pip install --quiet --no-build-isolation -e .

case "${1:-}" in
  main)
    "$PYTHON" -m torch_ln
    ;;
  test)
    "$PYTHON" -m pytest tests --ignore=tests/emulated --ignore=tests/gates
    # The emulated kernels under AddressSanitizer (its runtime has to be loaded first; libstdc++ right after it, or
    # ASan's __cxa_throw interceptor finds no real one and any C++ exception, torch's included, aborts the process)
    # and the emulator's shared-memory race check. A launch runs on one OS thread (its emulated threads are fibers):
    # one pytest worker per core.
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" ASAN_OPTIONS=detect_leaks=0 \
      TORCH_LN_RACECHECK=1 \
      TORCH_LN_REQUIRE_SANITIZERS=1 "$PYTHON" -m pytest tests/emulated -n auto
    # Again under gcov, then the gates: every sm_90 kernel instantiation (ptxas) free of spills,
    # launched by those tests, and every branch arm of the kernels taken.
    TORCH_LN_COVERAGE=1 "$PYTHON" -m pytest tests/emulated -q -n auto
    TORCH_LN_REQUIRE_GATES=1 "$PYTHON" -m pytest tests/gates
    # The main suite again on the oldest supported torch (its own venv, a CPU-only build in a copy of the tree).
    bash scripts/test_oldest_torch.sh
    ;;
  *)
    echo "usage: bash scripts/run.sh main|test" >&2
    exit 2
    ;;
esac
