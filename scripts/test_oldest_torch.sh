#!/usr/bin/env bash
# The main suite on the oldest torch release the supported range admits (scripts/torch_range.py --oldest), as
# scripts/run.sh test runs it after the suite on the installed torch: its own virtual environment (kept between runs
# in build/oldest-torch), and a CPU-only build of torch_ln in a copy of the working tree there (the checkout's own
# build belongs to the other torch). Extra arguments go to pytest.
#   bash scripts/test_oldest_torch.sh                      # the main suite, as CI runs it
#   bash scripts/test_oldest_torch.sh tests/test_ops.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
oldest=$("$PYTHON" scripts/torch_range.py --oldest)
work=$PWD/build/oldest-torch
venv=$work/venv-$oldest
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$oldest')" 2> /dev/null; then
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "torch==$oldest" ninja "setuptools>=70.1" packaging pytest pytest-xdist \
    numpy expecttest transformers==5.23.0 timm==1.0.31
fi
# The tracked files and the untracked ones git does not ignore (no build outputs), their times kept: the copy's
# build is redone only where a source changed.
src=$work/src
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' |
  tar --null -T - -cf - | tar -xf - -C "$src"
cd "$src"
echo "torch_ln against torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') (CPU-only build)"
TORCH_LN_FORCE_CPU=1 MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps -e .
"$venv/bin/python" -m pytest "${@:-tests}" --ignore=tests/emulated --ignore=tests/gates -q -n 2 -p no:cacheprovider
