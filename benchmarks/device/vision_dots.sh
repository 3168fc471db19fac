#!/bin/bash
# One device command for the built-in visual task on a GPU (issue 51). On an H100 on 2026-12-07 its run from an empty
# cache took 411 s (the warm-up 347 s, against 41 s on a 2-core CPU) and GRPO did not learn (greedy accuracy 0.245
# to 0.26): that machine's transformers (5.17) ignored the images in the packed training forwards, which now train
# padded there (benchmarks/results/2026-12-07_h100_vision_dots.md). The stages check that on the GPU and tell its
# parts apart; each writes its JSON and its run's metrics (flat, `$OUT/<stage>_metrics.jsonl`):
#   rl           GRPO on cuda from the model warmed up on the CPU (carried: KETCH_CACHE_DIR=.carry/cache)
#   rl_plain     the same with padded training forwards and `generate` (no packing, no static decoder)
#   empty        the whole run from an empty cache, the warm-up's validations printed
# From the repository root, with .carry/cache carried:
#   PYTHONPATH=. STAGES="rl rl_plain empty" bash benchmarks/device/vision_dots.sh
set -u
mkdir -p "$OUT/logs"
STAGES=${STAGES:-rl rl_plain empty}
stage() {
    local name=$1 limit=$2; shift 2
    echo "=== $name $(date -u +%T)"
    TMPDIR=$(mktemp -d) timeout "$limit" python3 benchmarks/default_run.py --config-path examples/vision.yaml \
        --out "$OUT/vision_$name.json" trainer.device=cuda "$@" >"$OUT/logs/$name.log" 2>&1
    echo "rc=$? $(date -u +%T)"
    grep -E "warm-up|validations" "$OUT/logs/$name.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['val_acc'], d['rl_wall_s'])" \
        "$OUT/vision_$name.json" 2>/dev/null
    find /tmp -newer "$OUT/logs" -name metrics.jsonl -path "*vision-dots*" -exec cp {} "$OUT/${name}_metrics.jsonl" \;
}
if [[ $STAGES == *rl* ]]; then
    export KETCH_CACHE_DIR=$PWD/.carry/cache
    [[ " $STAGES " == *" rl "* ]] && stage rl 150
    [[ $STAGES == *rl_plain* ]] && stage rl_plain 200 model.use_remove_padding=false rollout.hf_decoding=generate
    unset KETCH_CACHE_DIR
fi
if [[ $STAGES == *empty* ]]; then
    stage empty 480 --empty-cache
fi
