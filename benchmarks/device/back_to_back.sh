#!/bin/bash
# One device command: the TRL peer, then ketch GRPO on one GPU (fixed workload; the same again, whose first step
# finds the compiler caches of the first run; then the variable workload, two warm-up steps as the blocks compile
# once more for varying lengths), then on two GPUs through Ray (strong scaling: 16 prompts per step; weak scaling:
# 32). JSON results go to $OUT, the logs and the profile of one extra one-GPU actor update to $OUT/logs.tgz. Run from the repository root with PYTHONPATH set;
# the peer script's path is the first argument ("" or none: no peer); the second, `one` or `two` (default both),
# picks the one-GPU or the two-GPU stages.
set -u
peer=${1:-}
which=${2:-both}
mkdir -p "$OUT/logs"
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; grep -h "^step" "$OUT/logs/$name.log"; }
if [ "$which" != two ] && [ -n "$peer" ]; then CUDA_VISIBLE_DEVICES=0 stage trl 150 python3 "$peer" limits trl; cp "$OUT/peer_baseline.json" "$OUT/trl_peer.json" 2>/dev/null; rm -f "$OUT/peer_baseline.json"; fi
run="python3 benchmarks/rl_step.py --variant grpo --warmup 1 --steps 2"
if [ "$which" != two ]; then
CUDA_VISIBLE_DEVICES=0 stage ketch_1gpu 120 $run --profile "$OUT/logs/profile_update_1gpu.txt" --profile-stage update_actor --out "$OUT/ketch_grpo_1gpu.json"
CUDA_VISIBLE_DEVICES=0 stage ketch_1gpu_again 100 $run --out "$OUT/ketch_grpo_1gpu_second_run.json"
CUDA_VISIBLE_DEVICES=0 stage ketch_1gpu_var 100 $run --workload variable --warmup 2 --out "$OUT/ketch_grpo_1gpu_variable.json"
fi
if [ "$which" != one ]; then
stage ketch_2gpu 120 $run --set trainer.n_gpus_per_node=2 --out "$OUT/ketch_grpo_2gpu_16.json"
stage ketch_2gpu_weak 120 $run --prompts 32 --set trainer.n_gpus_per_node=2 --out "$OUT/ketch_grpo_2gpu_32.json"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
