#!/usr/bin/env bash
# The GPU check, for a session lent an H200 (torch 2.11.0+cu130, Python 3.12, nvcc 13.0, no network): the build
# (carried, or made there for sm_90), CUDA tests, compute-sanitizer, benchmarks, the C++ example.
#
# The prepared call (issue 36, item 4): make the build here first, right after the last edit of setup.py, csrc/ or
# torch_ln/include/ (the carried phase refuses a build of other sources: gpu_build/SOURCES.sha256),
#   nice -n 10 bash scripts/build_for_gpu.sh        (here, no GPU: 13.5 min from scratch on 2 cores, seconds after)
# then, carrying it and the wheels, every call starting with the phase `carried`:
#   device run, carry ["gpu_build", ".whl"]: bash scripts/gpu_check.sh carried tests sanitizer bench   (timeout_s 590)
# Phase `carried` (instead of `build`) checks gpu_build/SOURCES.sha256 against this tree, copies gpu_build/torch_ln/*
# into torch_ln/ and checks that torch_ln imports with its CUDA kernels: seconds instead of the build's 194. The
# repository is on PYTHONPATH (no pip install needed). It touches the copied libraries, so torch_ln's check that they
# are newer than csrc/ holds whatever mtimes the copy gave the tree; should it still refuse them (a clock ahead
# here), TORCH_LN_ALLOW_STALE=1 is set for the rest of the run, the contents having matched already.
#
# Seen on 2026-12-04: machine start ~50 s, build 194 s, CUDA tests 54 s (1505), memcheck under 60 s, racecheck
# over 120 s, the benchmarks ~300 s with rms_norm's cut short. Each step has its own timeout:
#   carried ~10 s; tests 240; sanitizer 240 + 240; bench 90 + 90 (latency fwd) + 30 (latency fwd+bwd) + 150 + 60
#   + 120, kernel model 90
# From the figures seen, one call takes ~11-13 minutes (10 + 54 + 60 + 120..240 + 300 + up to 120 s of latency),
# over the ~8 minutes a session's 15 minutes of device time allow with the start: until racecheck's case and the
# benchmarks' cases are cut to fit, a 590 s call ends inside the bench phase (results.tgz keeps every finished step),
# or split it, each call while the machine is warm, each starting with `carried`:
#   device run: bash scripts/gpu_check.sh carried tests sanitizer   (timeout_s ~ 400)
#   device run: bash scripts/gpu_check.sh carried bench             (timeout_s ~ 560)
# Without a carried build, build there, then the rest while the machine is still warm (the build stays):
#   device run: bash scripts/gpu_check.sh build tests sanitizer     (timeout_s ~ 590)
#   device run: bash scripts/gpu_check.sh bench                     (timeout_s ~ 500)
# No phase named: build tests sanitizer bench cpp, cpp last (it builds an AOTInductor package: minutes).
# Phase `ab` (named only, after bench; carry gpu_build_experiment too): torch_ln's forward and backward under each A/B
# switch of scripts/experiment_overrides.diff (the prefetch rings' stages, the bulk loads, the held sums and the
# backward's weight ring, the forward's rows a block, its weight copy, the fused add's ring of both streams in one
# block an SM), ~6 min (9 at most).
# The profiling kit (../shared/gpu-perf, until the kernels reach bandwidth) times its TLN_X_* variants on a build with
# scripts/experiment_overrides.diff (its own diff no longer applies to these kernels; tests/test_gpu_scripts.py checks
# that this one does): make it here as well,
#   nice -n 10 bash scripts/build_for_gpu.sh --experiment     (-> gpu_build_experiment/)
# carry it beside gpu_build, and after gpu_check.sh, in the same warm machine:
#   cp -r gpu_build_experiment/torch_ln/. torch_ln/ && cp shared/gpu-perf/{sweep,ncu_cases}.py . &&
#     TORCH_LN_ALLOW_STALE=1 bash shared/gpu-perf/gpu_profile.sh env sweep overview source
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

# torch_ln from this tree, whether pip-installed here (build) or copied in (carried): scripts/ and benchmarks/ too.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

environment() {
  step "environment"
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
    nvcc --version | tail -1; nproc; } 2>&1 | tee "$WORK/env.txt"
}

# The files a build is made of; scripts/build_for_gpu.sh writes the same list, hashed, to gpu_build/SOURCES.sha256.
source_manifest() {
  find setup.py csrc torch_ln/include -type f ! -path 'csrc/emulated/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
}

if wants carried; then
  environment
  step "carried build (gpu_build/, made by scripts/build_for_gpu.sh)"
  if [[ ! -f gpu_build/SOURCES.sha256 || ! -f gpu_build/torch_ln/lib/libtorch_ln.so ]]; then
    note "NO CARRIED BUILD: run scripts/build_for_gpu.sh, then carry gpu_build (or run the build phase)"; pack; exit 1
  fi
  tee -a "$OUT/summary.txt" < gpu_build/BUILD.txt
  if ! source_manifest | diff gpu_build/SOURCES.sha256 - > "$WORK/carried_sources.diff"; then
    head -20 "$WORK/carried_sources.diff"
    note "CARRIED BUILD IS STALE: made from other sources than these; rerun scripts/build_for_gpu.sh"; pack; exit 1
  fi
  mkdir -p torch_ln/lib
  cp gpu_build/torch_ln/lib/libtorch_ln.so torch_ln/lib/
  cp gpu_build/torch_ln/_C.*.so gpu_build/torch_ln/_build_info.py torch_ln/
  touch torch_ln/lib/libtorch_ln.so torch_ln/_C.*.so # newer than the sources just matched against SOURCES.sha256
  loads() {
    python3 -c "import torch_ln, torch_ln._extension as e; assert e.cuda_compiled(), 'no CUDA kernels in this build'
import torch; print('torch_ln loads, CUDA kernels in,', torch.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else '(no GPU visible)')"
  }
  if ! loads > "$WORK/carried.log" 2>&1; then
    if grep -q "older than their sources" "$WORK/carried.log"; then
      export TORCH_LN_ALLOW_STALE=1
      note "mtimes say stale, contents match: TORCH_LN_ALLOW_STALE=1 for this run"
      loads > "$WORK/carried.log" 2>&1
    fi
  fi
  tee -a "$OUT/summary.txt" < "$WORK/carried.log"
  grep -q "^torch_ln loads" "$WORK/carried.log" || { note "CARRIED BUILD DOES NOT LOAD"; pack; exit 1; }
  pack
fi

if wants build; then
  environment
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
  # Small-batch latency (issue 36, item 5): M = 1, 8, 64 at D = 4096, 8192, eager and under a CUDA graph. The forward
  # against torch and torch.compile (one compile per case: most of the time); forward+backward, torch_ln and torch.
  step "small-batch latency (bench_latency.py --quick)"
  timeout 90 python3 benchmarks/bench_latency.py --device cuda --quick --steps fwd \
    --out "$WORK/bench/latency_fwd" > "$WORK/bench_latency_fwd.txt" 2>&1
  note "bench_latency fwd exit: $?"
  timeout 30 python3 benchmarks/bench_latency.py --device cuda --quick --steps fwd+bwd --providers torch_ln torch \
    --out "$WORK/bench/latency_fwd_bwd" > "$WORK/bench_latency_fwd_bwd.txt" 2>&1
  note "bench_latency fwd+bwd exit: $?"
  goals=$(grep -h "goal (" "$WORK"/bench_latency_*.txt | sort -u) # each case's line is printed twice
  note "latency: $(grep -c MISSED <<< "$goals") of $(grep -c . <<< "$goals") cases miss the goal"
  pack
  bench bench_layer_norm 150 benchmarks/bench_layer_norm.py
  bench bench_add_layer_norm 60 benchmarks/bench_add_norm.py --op layer_norm --D 4096
  bench bench_rms_norm 120 benchmarks/bench_rms_norm.py --D 4096 32768 262144
  # The compile pass (issue 41): a Llama decoder block's training step, compiled with and without torch_ln.compile.
  step "compile pass (bench_compile_pass.py: decoder block, fwd+bwd, bfloat16)"
  timeout 150 python3 benchmarks/bench_compile_pass.py --device cuda --dtype bfloat16 --quick --cases block \
    --steps fwd+bwd --batch 4 --seq 1024 --hidden 2048 --out "$WORK/bench/compile_pass" > "$WORK/bench_compile_pass.txt" 2>&1
  note "bench_compile_pass exit: $?"
  # memory_efficient (issue 39 item 2): peak memory (torch.cuda.max_memory_allocated) and time of a training step.
  step "memory-efficient backward (bench_memory_efficient.py, bfloat16)"
  timeout 60 python3 benchmarks/bench_memory_efficient.py --device cuda --dtype bfloat16 --quick --batch 8 \
    --seq 1024 --hidden 2048 --out "$WORK/bench/memory_efficient" > "$WORK/bench_memory_efficient.txt" 2>&1
  note "bench_memory_efficient exit: $?"
  # Quantized outputs (issue 37): the fused op against torch's norm + quantization, eager and compiled, and the
  # README's fp8 linear (torch._scaled_mm fed by add_rms_norm_quant) on the GPU.
  step "quantized-output norms (bench_quant.py, bfloat16 -> float8_e4m3fn; the _scaled_mm example)"
  timeout 90 python3 benchmarks/bench_quant.py --device cuda --dtypes bfloat16 --quick --rows 8192 --cols 4096 8192 \
    --out "$WORK/bench/quant" > "$WORK/bench_quant.txt" 2>&1
  note "bench_quant exit: $?"
  timeout 60 python3 -m pytest tests/test_quant.py -q -k "scaled_mm or scale_on_another_device" > "$WORK/quant_gpu.txt" 2>&1
  note "quant GPU tests exit: $?"
  pack
  # The predictions written before this run (CSV against CSV: no emulator, no ptxas, seconds).
  step "kernel model: measured against the predictions committed before the run (--score)"
  timeout 90 python3 benchmarks/kernel_model.py --score benchmarks/results/2026-12-07-kernel-model-grown-rows/predictions.csv \
    "$WORK"/bench/*_cuda.csv > "$WORK/model_vs_measured.txt" 2> "$WORK/model.log"
  note "kernel model exit: $?"
  pack
fi

if wants ab; then
  # The A/B of the kernels' switches (issue 36: keep each mechanism by measurement): the experiment build
  # (scripts/build_for_gpu.sh --experiment, carried as gpu_build_experiment/) from a copy of torch_ln, each variant in
  # its own process, torch_ln alone. Main's choice first, then each switch that undoes one mechanism.
  step "A/B of the experiment build's switches (bench_layer_norm.py, torch_ln only)"
  if [[ ! -f gpu_build_experiment/torch_ln/lib/libtorch_ln.so ]]; then
    note "NO EXPERIMENT BUILD: run scripts/build_for_gpu.sh --experiment, then carry gpu_build_experiment"
  else
    rm -rf "$WORK/experiment" && mkdir -p "$WORK/experiment" && cp -r torch_ln "$WORK/experiment/"
    cp -r gpu_build_experiment/torch_ln/. "$WORK/experiment/torch_ln/"
    ab() {
      local name=$1 seconds=$2 D=$3 modes=$4
      shift 4
      env "$@" TORCH_LN_ALLOW_STALE=1 PYTHONPATH="$WORK/experiment:$PYTHONPATH" timeout "$seconds" \
        python3 benchmarks/bench_layer_norm.py --device cuda --quick --providers torch_ln --dtypes float32 bfloat16 \
        --modes $modes --D $D --out "$WORK/ab/$name" > "$WORK/ab_$name.txt" 2>&1
      note "ab $name exit: $?"
    }
    # The same for the fused add + LayerNorm forward (bench_add_norm.py, the fused op alone).
    ab_add() {
      local name=$1 seconds=$2 D=$3
      shift 3
      env "$@" TORCH_LN_ALLOW_STALE=1 PYTHONPATH="$WORK/experiment:$PYTHONPATH" timeout "$seconds" \
        python3 benchmarks/bench_add_norm.py --op layer_norm --device cuda --quick --providers fused \
        --dtypes float32 bfloat16 --modes fwd --D $D --out "$WORK/ab/$name" > "$WORK/ab_$name.txt" 2>&1
      note "ab $name exit: $?"
    }
    # The register kernels' prefetch rings (ThreadRing): 3 stages where they fit, at most 2, none.
    ab ring_main 60 "512 1024 4096 8192" "fwd bwd"
    ab ring_2_stages 60 "512 1024 4096 8192" "fwd bwd" TLN_X_RING_STAGES=2
    ab ring_none 60 "512 1024 4096 8192" "fwd bwd" TLN_X_NO_PREFETCH=1
    # The fused add's residual in the forward's ring beside x (main) or read vector by vector as it is added.
    ab_add add_ring_main 30 "1024 4096"
    ab_add add_ring_x_alone 30 "1024 4096" TLN_X_NO_RESIDUAL_RING=1
    # The shared-memory kernels' bulk loads (SliceRing; the forward's slices kept in registers after one read).
    ab bulk_main 45 "32768 262144" "fwd bwd"
    ab bulk_none 45 "32768 262144" "fwd bwd" TLN_X_NO_BULK=1
    # The shared-memory backward's gradient sums in registers (main, bulk_main above) or in shared memory.
    ab held_none 30 "32768 262144" "bwd" TLN_X_NO_HELD=1
    # The weight of the held-sums instance holding LayerNorm's weight sums alone: through its ring (main, bulk_main
    # above; float32 D=262144) or read from global memory as used (bfloat16 takes neither: a control).
    ab weight_ring_none 20 "262144" "bwd" TLN_X_NO_WEIGHT_RING=1
    # The forward's register rows in plan_rows' blocks, not doubled where a wanted ring finds no room beside each
    # block's weight copy (main, ring_main and add_ring_main above: float32 D=4096 in 2 blocks of 256 threads with 2
    # stages, where these run 4 of 128 with no ring); in blocks of 512 threads everywhere (one weight copy an SM, a
    # ring beside it); and the ring without the copy.
    ab rows_no_grow 30 "4096 8192" "fwd" TLN_X_NO_GROW=1
    ab_add add_rows_no_grow 20 "4096" TLN_X_NO_GROW=1
    ab rows_512 40 "512 4096 8192" "fwd" TLN_X_ROWS_BLOCK_THREADS=512
    ab stage_none 40 "4096 8192" "fwd" TLN_X_NO_STAGE=1
    # The fused add float32 D=4096 in one block of 256 threads an SM with 3 stages of both x and the residual, against
    # main's 2 blocks with 2 stages of x alone (add_ring_main above): half the warps, more bytes in flight.
    ab_add add_one_block_both_streams 20 "4096" TLN_X_ROWS_BLOCK_THREADS=256 TLN_X_RING_FEWER_BLOCKS=1
  fi
  pack
fi

if wants cpp; then
  step "C++ example: the C++ API on CUDA tensors, an AOTInductor CUDA package run from C++"
  MAX_JOBS=16 timeout 300 python3 -m pytest tests/test_cpp_example.py -q -p no:cacheprovider > "$WORK/cpp_example.log" 2>&1
  note "C++ example exit: $? ($(tail -1 "$WORK/cpp_example.log"))"
  pack
fi
step "done"
