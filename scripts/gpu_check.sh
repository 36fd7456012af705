#!/usr/bin/env bash
# The GPU check, for a session lent an H200 (torch 2.11.0+cu130, Python 3.12, nvcc 13.0, no
# network): build for sm_90, CUDA tests, compute-sanitizer, a short benchmark. Everything it
# prints and writes lands in $OUT (default ./gpu_out). Budget: under 8 minutes.
#   device run: bash scripts/gpu_check.sh        (timeout_s ~ 540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "=== $1 ($(date +%T))" | tee -a "$OUT/summary.txt"; }

step "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; nvcc --version | tail -1; } 2>&1 | tee "$OUT/env.txt"

step "build for sm_90"
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 NVCC_THREADS=4 python3 -m pip install --no-build-isolation --no-deps -e . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "BUILD FAILED" | tee -a "$OUT/summary.txt"; exit 1; }
python3 -c "import torch_ln, torch_ln._extension as e; assert e.cuda_compiled(), 'no CUDA kernels in this build'" 2>&1 | tee -a "$OUT/summary.txt"

step "CUDA tests (parity, gradcheck, opcheck, compile, determinism, batch invariance)"
timeout 240 python3 -m pytest tests --ignore=tests/emulated -k cuda -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"

step "C++ example: the C++ API on CUDA tensors, an AOTInductor CUDA package run from C++"
MAX_JOBS=16 timeout 300 python3 -m pytest tests/test_cpp_example.py -q -p no:cacheprovider 2>&1 | tee "$OUT/cpp_example.log" | tail -5
echo "C++ example exit: ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"

step "compute-sanitizer memcheck and racecheck"
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 3 python3 scripts/sanitizer_case.py \
    > "$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool exit: $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitizer_$tool.log") clean summaries)" | tee -a "$OUT/summary.txt"
done

step "benchmark"
timeout 150 python3 benchmarks/bench_layer_norm.py --device cuda --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench_layer_norm.txt" | tail -40
timeout 60 python3 benchmarks/bench_rms_norm.py --device cuda --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench_rms_norm.txt" | tail -20
step "kernel model: measured beside predicted (the benchmark's cases)"
timeout 120 python3 benchmarks/kernel_model.py --compare "$OUT"/bench/*_cuda.csv 2>"$OUT/model.log" | tee "$OUT/model_vs_measured.txt"
step "done"
