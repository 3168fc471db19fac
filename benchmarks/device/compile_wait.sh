#!/bin/bash
# The compile wait in one device command: ketch GRPO on one GPU (fixed workload) twice with a fresh ketch cache
# directory; the second run loads the first run's saved compiled functions (`ketch.compiled`) from there.
# Prints each run's first step against its warm step (`first_step_over_warm_step`, the goal: <= 2 in the second
# run), the whole process's time, and what compiled or loaded while it did (the `ketch.*` log lines, dynamo's
# compile_times); a third run profiles its first step's Python (`--profile-first-step`); then
# checks the CUDA-graph decode against eager decoding (`decode_compile.py`: tokens that agree, should be ~1.0).
# JSON results go to $OUT (or ./compile_wait_out), logs beside them. Run from the repository root with
# PYTHONPATH set. RUNS picks the timed runs (default "1 2 2-nopyc"); PROFILE=0 and CHECK=0 leave out run 3
# and the decode check.
set -u
out=${OUT:-compile_wait_out}
mkdir -p "$out"
export KETCH_CACHE_DIR=$(mktemp -d /tmp/ketch-compile-wait.XXXX)
# The GPU machine's torch is read-only and ships no bytecode, so every process compiles the source of the
# hundreds of torch modules it imports (seconds); an installed torch has its .pyc files. Runs 1 and 2 keep
# the bytecode under the cache directory, as an install would; run "2-nopyc" shows the machine as it is.
for run in ${RUNS:-1 2 2-nopyc}; do
  if [ "$run" = 2-nopyc ]; then unset PYTHONPYCACHEPREFIX; else export PYTHONPYCACHEPREFIX=$KETCH_CACHE_DIR/pycache; fi
  echo "=== run $run $(date -u +%T)"
  start=$(date +%s.%N)
  timeout 300 python3 benchmarks/rl_step.py --variant grpo --warmup 1 --steps 3 --out "$out/compile_wait_run$run.json" \
    >"$out/compile_wait_run$run.log" 2>&1
  echo "rc=$? (whole process $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$start" "$(date +%s.%N)") s)"
  grep -hE "ketch\.(rollout|engine|compiled)|^step" "$out/compile_wait_run$run.log"
  sed -n '/^compilation in the first step/,/^step 2/p' "$out/compile_wait_run$run.log" | grep -E "bytecode_tracing|compile_inner|inductor_load|call_user_compiler"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"first step {r['first_step_s']:.2f} s, warm step {r['step_s']:.3f} s: ratio {r['first_step_over_warm_step']:.2f}; first step stages {r['first_step_seconds']}; decode {r['decode_tokens_per_s']:.0f} tokens/s\")" "$out/compile_wait_run$run.json"
done
export PYTHONPYCACHEPREFIX=$KETCH_CACHE_DIR/pycache
if [ "${PROFILE:-1}" != 0 ]; then
echo "=== run 3 (caches warm), its first step profiled with cProfile (slower under the profiler: not the measurement) $(date -u +%T)"
timeout 300 python3 benchmarks/rl_step.py --variant grpo --warmup 1 --steps 1 --out "$out/compile_wait_run3_profiled.json" \
  --profile-first-step "$out/first_step_profile_run3.txt" >"$out/compile_wait_run3_profiled.log" 2>&1
echo "rc=$?"
head -n 60 "$out/first_step_profile_run3.txt"
fi
if [ "${CHECK:-1}" != 0 ]; then
echo "=== the captured decode step against eager decoding (float32, 16 rows x (64 + 64) tokens) $(date -u +%T)"
timeout 200 python3 benchmarks/decode_compile.py --rows 16 --prompt-len 64 --new-tokens 64 \
  --out "$out/decode_compile_check.json" >"$out/decode_compile_check.log" 2>&1
echo "rc=$?"
cat "$out/decode_compile_check.json"
fi
rm -rf "$KETCH_CACHE_DIR"
