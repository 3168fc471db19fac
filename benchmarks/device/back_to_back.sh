#!/bin/bash
# One device command: the TRL peer, then ketch GRPO on one GPU (fixed and variable workload, profiled), then on
# two GPUs through Ray (strong scaling: 16 prompts; weak scaling: 32 prompts). Results go to $OUT.
# Run from the repository root with PYTHONPATH set; the peer script path is the first argument.
set -u
peer=${1:-}
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 3 "$OUT/$name.log"; }
if [ -n "$peer" ]; then stage trl 240 python3 "$peer" limits trl; fi
one="--variant grpo --warmup 2 --steps 3"
CUDA_VISIBLE_DEVICES=0 stage ketch_1gpu 200 python3 benchmarks/rl_step.py $one --profile "$OUT/profile_1gpu.txt" --out "$OUT/ketch_grpo_1gpu.json"
CUDA_VISIBLE_DEVICES=0 stage ketch_1gpu_var 150 python3 benchmarks/rl_step.py $one --workload variable --out "$OUT/ketch_grpo_1gpu_variable.json"
stage ketch_2gpu 200 python3 benchmarks/rl_step.py $one --set trainer.n_gpus_per_node=2 --out "$OUT/ketch_grpo_2gpu_16.json"
stage ketch_2gpu_weak 200 python3 benchmarks/rl_step.py $one --set trainer.n_gpus_per_node=2 data.train_batch_size=32 --out "$OUT/ketch_grpo_2gpu_32.json"
