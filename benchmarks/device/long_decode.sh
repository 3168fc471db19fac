#!/bin/bash
# One device command for the long-response decode (issue 49): the GPU decode tests, `rl_step.py` GRPO steps of the
# 0.5B shape with responses up to each length given (default 32768; 16 prompts x 4 samples, the variable workload,
# one warm-up step, one timed), the same at the first length with partial rollouts (5 timed steps), decode attention
# against the memory floor with a captured step at 32k of context, then the fixed workload. Each stage has its own
# time limit and writes its JSON to $OUT as it ends; STAGES picks some of them, PARTIAL adds settings to the partial
# stage (e.g. "rollout.partial.over_sample=2 rollout.partial.max_staleness=3").
# From the repository root:
#   PYTHONPATH=. STAGES="tests grpo partial floor fixed" bash benchmarks/device/long_decode.sh 32768 16384
set -u
mkdir -p "$OUT/logs"
STAGES=${STAGES:-tests grpo partial floor fixed}
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 3 "$OUT/logs/$name.log"; }
if [[ $STAGES == *tests* ]]; then
    stage gpu_tests 150 python3 -m pytest tests/gpu/test_decode_kernel_gpu.py -q -p no:cacheprovider
    grep -q " failed\| error" "$OUT/logs/gpu_tests.log" && exit 1
fi
if [[ $STAGES == *grpo* ]]; then
    for length in "${@:-32768}"; do
        stage "grpo_$length" 330 python3 benchmarks/rl_step.py --variant grpo --prompts 16 --n 4 --workload variable \
            --response-length "$length" --warmup 1 --steps 1 --set model.gradient_checkpointing=true \
            --out "$OUT/ketch_grpo_0.5b_response$length.json"
    done
fi
if [[ $STAGES == *partial* ]]; then
    length=${1:-32768}
    stage "partial_$length" 330 python3 benchmarks/rl_step.py --variant grpo --prompts 16 --n 4 --workload variable \
        --response-length "$length" --warmup 1 --steps 5 --set model.gradient_checkpointing=true \
        rollout.partial.enable=true actor.rollout_is=token ${PARTIAL:-} --out "$OUT/ketch_grpo_0.5b_partial$length.json"
fi
if [[ $STAGES == *floor* ]]; then
    stage floor 150 python3 benchmarks/decode_step.py --rows 1 4 --skip-generation --floor --long-step 32768 \
        --profile "$OUT/profiles" --out "$OUT/decode_floor.json"
fi
if [[ $STAGES == *fixed* ]]; then
    stage fixed 150 python3 benchmarks/rl_step.py --variant grpo --warmup 2 --steps 5 --out "$OUT/ketch_grpo_fixed.json"
fi
