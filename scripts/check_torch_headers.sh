#!/usr/bin/env bash
# Checks that the C++ sources compile against the headers of older torch releases that pyproject.toml allows,
# without installing them: downloads each wheel (no dependencies), extracts its include/ and runs
# g++ -fsyntax-only on csrc/*.cpp and csrc/cpu/*.cpp. Needs the package index (530 MB a wheel); not part of CI.
#   bash scripts/check_torch_headers.sh 2.11.0 2.12.0
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
python_include=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
status=0
for version in "$@"; do
  dir=$(mktemp -d "/tmp/torch-$version.XXXX")
  "$PYTHON" -m pip download --quiet --no-deps "torch==$version" -d "$dir"
  (cd "$dir" && unzip -q -o torch-*.whl 'torch/include/*')
  include="$dir/torch/include"
  for source in csrc/*.cpp csrc/cpu/*.cpp; do
    if g++ -std=c++20 -fsyntax-only -w -fopenmp -I torch_ln/include -I csrc -I "$include" \
      -I "$include/torch/csrc/api/include" -I "$python_include" -DTORCH_EXTENSION_NAME=libtorch_ln \
      -DTORCH_API_INCLUDE_EXTENSION_H "$source"; then
      echo "torch $version: $source ok"
    else
      echo "torch $version: $source FAILED"
      status=1
    fi
  done
  rm -rf "$dir"
done
exit $status
