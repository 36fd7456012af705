#!/usr/bin/env bash
# The GPU check, for a session lent an H200 (torch 2.11.0+cu130, Python 3.12, nvcc 13.0, no
# network): build for sm_90, CUDA tests, compute-sanitizer, benchmarks, the C++ example.
# Seen on 2026-12-04: machine start ~50 s, build 194 s, CUDA tests 54 s (1505), memcheck under 60 s, racecheck
# over 120 s, the benchmarks ~300 s with rms_norm's cut short. A lease's 15 minutes take it in two calls, the second
# while the machine is still warm (the build stays; once cold, carry a build made against torch 2.11.0 for cp312):
#   device run: bash scripts/gpu_check.sh build tests sanitizer     (timeout_s ~ 590)
#   device run: bash scripts/gpu_check.sh bench                     (timeout_s ~ 500)
# No phase named: all of them, cpp last (it builds an AOTInductor package: minutes).
# Wheels in .whl/ (carried: `carry: [".whl"]`) are installed first, for the benchmarks' other providers
# (Liger's is pure Python; QuACK's CUTLASS DSL is too large to carry).
# $OUT (default ./gpu_out) gets summary.txt and console.log as they grow, and results.tgz (every log,
# CSV and plot) after each phase: a run stopped at its limit still returns what the finished phases wrote.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
WORK=${WORK:-/tmp/gpu_check}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/console.log") 2>&1
export PYTHONUNBUFFERED=1
PHASES=" ${*:-build tests sanitizer bench cpp} "
step() { echo "=== $1 ($(date +%T))" | tee -a "$OUT/summary.txt"; }
note() { echo "$1" | tee -a "$OUT/summary.txt"; }
pack() { tar czf "$OUT/results.tgz" -C "$WORK" .; }
wants() { [[ "$PHASES" == *" $1 "* ]]; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if wants build; then
  step "environment"
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
    nvcc --version | tail -1; nproc; } 2>&1 | tee "$WORK/env.txt"
  step "build for sm_90"
  start=$SECONDS
  TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e . \
    > "$WORK/build.log" 2>&1 || { tail -60 "$WORK/build.log"; note "BUILD FAILED"; pack; exit 1; }
  note "build took $((SECONDS - start)) s"
  python3 -c "import torch_ln._extension as e; assert e.cuda_compiled(), 'no CUDA kernels in this build'" 2>&1 | tee -a "$OUT/summary.txt"
  pack
fi

if wants tests; then
  step "CUDA tests (parity, gradcheck, opcheck, compile, determinism, batch invariance, fused add)"
  timeout 240 python3 -m pytest tests --ignore=tests/emulated --ignore=tests/gates --ignore=tests/test_cpp_example.py \
    -k cuda -q -n 8 -rfE -p no:cacheprovider > "$WORK/tests.log" 2>&1
  note "tests exit: $? ($(tail -1 "$WORK/tests.log"))"
  grep -E "^(FAILED|ERROR)" "$WORK/tests.log" | head -40
  pack
fi

if wants sanitizer; then
  step "compute-sanitizer memcheck and racecheck"
  # racecheck: over 120 s on an H200 (2026-12-04), where memcheck took under 60.
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 3 python3 scripts/sanitizer_case.py \
      > "$WORK/sanitizer_$tool.log" 2>&1
    note "$tool exit: $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$WORK/sanitizer_$tool.log") clean summaries)"
    grep -m 20 -E "^========= (Invalid|Race|Error|Program hit)" "$WORK/sanitizer_$tool.log"
  done
  pack
fi

if wants bench; then
  # Trimmed to fit the lease: float32 and bfloat16, forward and backward; the fused add first (issue 14's figures).
  step "benchmarks (quick)"
  bench() {
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" python3 "$@" --device cuda --quick --dtypes float32 bfloat16 --modes fwd bwd \
      --out "$WORK/bench" > "$WORK/$name.txt" 2>&1
    note "$name exit: $?"
    pack
  }
  bench bench_add_rms_norm 90 benchmarks/bench_add_norm.py --op rms_norm --D 1024 4096 8192
  bench bench_layer_norm 150 benchmarks/bench_layer_norm.py
  bench bench_add_layer_norm 60 benchmarks/bench_add_norm.py --op layer_norm --D 4096
  bench bench_rms_norm 120 benchmarks/bench_rms_norm.py --D 4096 32768 262144
  step "kernel model: measured beside predicted (the benchmark's cases)"
  timeout 90 python3 benchmarks/kernel_model.py --compare "$WORK"/bench/{layer,rms}_norm_cuda.csv \
    > "$WORK/model_vs_measured.txt" 2> "$WORK/model.log"
  note "kernel model exit: $?"
  pack
fi

if wants cpp; then
  step "C++ example: the C++ API on CUDA tensors, an AOTInductor CUDA package run from C++"
  MAX_JOBS=16 timeout 300 python3 -m pytest tests/test_cpp_example.py -q -p no:cacheprovider > "$WORK/cpp_example.log" 2>&1
  note "C++ example exit: $? ($(tail -1 "$WORK/cpp_example.log"))"
  pack
fi
step "done"
