#!/bin/bash
# Does inductor's pool of compile workers slow a second run? Run 1 fills a fresh ketch cache; then second runs
# alternate TORCHINDUCTOR_COMPILE_THREADS=1 (no pool) and the default. Prints each run's first step, warm
# step, stages and whole-process time; JSON and logs go to $OUT (or ./compile_threads_out). Since ketch loads
# saved forms with one compile thread, the two kinds of second run should agree. Run from the repository root
# with PYTHONPATH set.
set -u
out=${OUT:-compile_threads_out}
mkdir -p "$out"
export KETCH_CACHE_DIR=$(mktemp -d /tmp/ketch-threads.XXXX) PYTHONPYCACHEPREFIX=/tmp/pyc-threads
for run in 1 2t 2 2t2 2b; do
  case $run in 2t*) export TORCHINDUCTOR_COMPILE_THREADS=1 ;; *) unset TORCHINDUCTOR_COMPILE_THREADS ;; esac
  echo "=== run $run $(date -u +%T)"
  start=$(date +%s.%N)
  timeout 300 python3 benchmarks/rl_step.py --variant grpo --warmup 1 --steps 3 --out "$out/run$run.json" >"$out/run$run.log" 2>&1
  echo "rc=$? whole $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$start" "$(date +%s.%N)") s"
  grep -hE "ketch\.(rollout|engine|compiled)" "$out/run$run.log" | cut -c1-220 | head -20
  python3 - "$out/run$run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
f = {k: round(v, 3) for k, v in r["first_step_seconds"].items()}
w = {k: round(v, 3) for k, v in r["seconds"].items()}
print(f"first {r['first_step_s']:.2f} warm {r['step_s']:.3f} ratio {r['first_step_over_warm_step']:.2f} mfu {r['update_mfu']:.3f} decode {r['decode_tokens_per_s']:.0f}")
print("  first", f); print("  warm ", w)
PY
done
rm -rf "$KETCH_CACHE_DIR"
