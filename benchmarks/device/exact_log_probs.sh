#!/bin/bash
# One device command for rollout.exact_log_probs (issue 50): the GPU tests of the exact mode (the static decoder's
# exact mode under CUDA graphs against the training forward, one prompt alone and in a batch of 128, GRPO steps),
# then the fixed workload's GRPO step back to back, the default and the exact mode (whose old-log-prob pass is
# skipped), each with its `training/rollout_probs_diff_max` per step. Each stage has its own time limit and writes
# its JSON to $OUT as it ends; STAGES picks some of them ("twenty": 20 GRPO steps in exact mode of the 0.5B shape and of
# a tiny Qwen3-MoE, each step's gap recorded):
#   PYTHONPATH=. STAGES="tests steps twenty" bash benchmarks/device/exact_log_probs.sh
set -u
mkdir -p "$OUT/logs"
STAGES=${STAGES:-tests steps}
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 3 "$OUT/logs/$name.log"; }
if [[ $STAGES == *tests* ]]; then
    stage gpu_tests 240 python3 -m pytest tests/gpu/test_invariant_kernels_gpu.py tests/gpu/test_exact_log_probs_gpu.py -q \
        -p no:cacheprovider
fi
if [[ $STAGES == *twenty* ]]; then  # the gap at each of 20 steps: the 0.5B shape, a tiny Qwen3-MoE (warmed up first)
    stage twenty_0.5b 150 python3 benchmarks/rl_step.py --variant grpo --warmup 0 --steps 20 \
        --set rollout.exact_log_probs=true --out "$OUT/grpo_exact_20_steps.json"
    stage twenty_moe 240 python3 benchmarks/moe_replay_learning.py --device cuda --steps 20 --replay off \
        --set rollout.exact_log_probs=true model.dtype=bfloat16 --out "$OUT/moe_exact_20_steps.json"
fi
if [[ $STAGES == *steps* ]]; then
    run="python3 benchmarks/rl_step.py --variant grpo --warmup 2 --steps 5"
    stage default 150 $run --out "$OUT/grpo_fixed_default.json"
    stage exact 200 $run --set rollout.exact_log_probs=true --out "$OUT/grpo_fixed_exact.json"
    # without the recomputation exact mode turns on (needed by the CPU's attention walk, not by the GPU's kernels)
    stage exact_no_recompute 200 $run --set rollout.exact_log_probs=true model.gradient_checkpointing=false \
        --out "$OUT/grpo_fixed_exact_no_recompute.json"
fi
