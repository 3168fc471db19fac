#!/bin/bash
# One device command for the long-response decode (issue 49): the GPU decode tests, decode attention against the
# memory floor and a captured step at 32k of context, then `rl_step.py` GRPO steps of the 0.5B shape with responses
# up to each length given (default 32768; 16 prompts x 4 samples, the variable workload, one warm-up step whose
# compilation is reported apart, one timed step), then the fixed workload. Each stage has its own time limit, and
# writes its JSON to $OUT as it ends. Run from the repository root with PYTHONPATH set:
#   bash benchmarks/device/long_decode.sh 32768 16384
set -u
mkdir -p "$OUT/logs"
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 3 "$OUT/logs/$name.log"; }
stage gpu_tests 150 python3 -m pytest tests/gpu/test_decode_kernel_gpu.py -q -p no:cacheprovider
grep -q " failed\| error" "$OUT/logs/gpu_tests.log" && exit 1
stage floor 150 python3 benchmarks/decode_step.py --rows 1 4 --skip-generation --floor --long-step 32768 \
    --profile "$OUT/profiles" --out "$OUT/decode_floor.json"
for length in "${@:-32768}"; do
    stage "grpo_$length" 330 python3 benchmarks/rl_step.py --variant grpo --prompts 16 --n 4 --workload variable \
        --response-length "$length" --warmup 1 --steps 1 --set model.gradient_checkpointing=true \
        --out "$OUT/ketch_grpo_0.5b_response$length.json"
done
stage fixed 150 python3 benchmarks/rl_step.py --variant grpo --warmup 2 --steps 5 --out "$OUT/ketch_grpo_fixed.json"
