#!/bin/bash
# One device command for rollout.exact_log_probs (issue 50): the GPU tests of the exact mode (the static decoder's
# exact mode under CUDA graphs against the training forward, one prompt alone and in a batch of 128, GRPO steps),
# then the fixed workload's GRPO step back to back, the default and the exact mode (whose old-log-prob pass is
# skipped), each with its `training/rollout_probs_diff_max` per step. Each stage has its own time limit and writes
# its JSON to $OUT as it ends; STAGES picks some of them:
#   PYTHONPATH=. STAGES="tests steps" bash benchmarks/device/exact_log_probs.sh
set -u
mkdir -p "$OUT/logs"
STAGES=${STAGES:-tests steps}
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 3 "$OUT/logs/$name.log"; }
if [[ $STAGES == *tests* ]]; then
    stage gpu_tests 200 python3 -m pytest tests/gpu/test_exact_log_probs_gpu.py -q -p no:cacheprovider
fi
if [[ $STAGES == *steps* ]]; then
    run="python3 benchmarks/rl_step.py --variant grpo --warmup 2 --steps 5"
    stage default 150 $run --out "$OUT/grpo_fixed_default.json"
    stage exact 200 $run --set rollout.exact_log_probs=true --out "$OUT/grpo_fixed_exact.json"
fi
