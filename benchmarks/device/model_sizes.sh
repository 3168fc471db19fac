#!/bin/bash
# ketch GRPO on Qwen2.5's larger shapes on one GPU (random weights, the fixed workload of `rl_step.py`), with the
# TRL peer on the same shape in the same command where it fits. The peer is `.carry/trl_grpo_peer.py`, a copy of
# ../shared/device/trl_grpo_peer.py changed in three places: the model's hidden/intermediate sizes, layers and
# heads come from Qwen2.5's shape named by $SCALE (0.5b, 1.5b, 3b); GRPOConfig gets per_device_train_batch_size=
# $MICRO and gradient_accumulation_steps=128/$MICRO; a step's time is that between two optimizer steps' ends
# (on_step_end). Stages, each one device command (timeouts add up to 560 s at most):
#   1.5b   ketch and TRL on the 1.5B shape, then ketch on the 3B shape
#   7b     ketch on the 7B shape with activation recomputation, then TRL on the 3B shape
#   free   the static decoder's GPU tests, the 0.5B shape without and with rollout.free_memory_while_training=true
#          (the rollout's weights and KV cache dropped while the update runs), the 3B shape with it
#   7b_free  the 7B shape with it, recomputation and 4,096-token micro-batches (fits one H200)
#   offload  the offloaded optimizer's GPU test, then the 3B and 7B shapes with actor.optim.offload=true (AdamW's
#            moments in host memory) and rollout.free_memory_while_training=true; 7B with recomputation and the
#            default 16,384-token micro-batches
#   7b_offload  the 7B shape with both options: recomputation and 4,096-token micro-batches (the smallest
#            footprint), then no recomputation and 8,192-token micro-batches
#   capped   with both options, recomputation and 4,096-token micro-batches, the process's GPU memory capped
#            (rl_step.py --memory-cap-gib) at what an 80 GB GPU leaves beside the CUDA context (78.5 GiB) for
#            the 7B shape and at a 24 GB GPU's (22.5 GiB) for the 1.5B shape
# Results (JSON) go to $OUT, the logs to $OUT/logs_STAGE.tgz. Set-up first (TRL from .whl/), then
#   bash benchmarks/device/model_sizes.sh STAGE
set -u
mkdir -p "$OUT/logs"
date=$(date -u +%F)
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; grep -hE "^step|trl_grpo_step|Error|error" "$OUT/logs/$name.log" | tail -8; }
step="python3 benchmarks/rl_step.py --variant grpo --warmup 1 --steps 3"
peer() {  # peer SCALE MICRO TIMEOUT
  SCALE=$1 MICRO=$2 stage "trl_$1" "$3" python3 .carry/trl_grpo_peer.py trl
  mv "$OUT/peer_baseline.json" "$OUT/${date}_h200_trl_grpo_$1.json" 2>/dev/null
}
case ${1:?stage: 1.5b, 7b, free, 7b_free, offload, 7b_offload or capped} in
1.5b)
  stage ketch_1.5b 200 $step --scale 1.5b --out "$OUT/${date}_h200_ketch_grpo_1.5b.json"
  peer 1.5b 16 180
  stage ketch_3b 180 $step --scale 3b --out "$OUT/${date}_h200_ketch_grpo_3b.json" ;;
7b)
  stage ketch_7b 330 $step --scale 7b --set model.gradient_checkpointing=true --out "$OUT/${date}_h200_ketch_grpo_7b.json"
  peer 3b 8 230 ;;
free)
  stage tests_decode 100 python3 -m pytest tests/gpu/test_decode_kernel_gpu.py -q -p no:cacheprovider
  for free in false true; do
    stage "ketch_0.5b_free_$free" 80 $step --set rollout.free_memory_while_training=$free \
      --out "$OUT/${date}_h200_ketch_grpo_0.5b_free_memory_$free.json"
  done
  stage ketch_3b_free 130 $step --scale 3b --set rollout.free_memory_while_training=true \
    --out "$OUT/${date}_h200_ketch_grpo_3b_free_memory.json" ;;
7b_free)
  stage ketch_7b_free 250 $step --scale 7b --set model.gradient_checkpointing=true \
    rollout.free_memory_while_training=true actor.ppo_max_token_len_per_device=4096 \
    --out "$OUT/${date}_h200_ketch_grpo_7b_free_memory_4096tokens_no_expandable.json" ;;
offload)
  stage tests_offload 100 python3 -m pytest tests/gpu/test_optimizer_offload_gpu.py -q -p no:cacheprovider
  stage ketch_3b_offload 130 $step --scale 3b --set rollout.free_memory_while_training=true actor.optim.offload=true \
    --out "$OUT/${date}_h200_ketch_grpo_3b_offload.json"
  stage ketch_7b_offload 320 $step --scale 7b --set model.gradient_checkpointing=true \
    rollout.free_memory_while_training=true actor.optim.offload=true \
    --out "$OUT/${date}_h200_ketch_grpo_7b_offload_16384tokens.json" ;;
7b_offload)
  both="rollout.free_memory_while_training=true actor.optim.offload=true"
  stage ketch_7b_offload_4096 220 $step --scale 7b --set $both model.gradient_checkpointing=true \
    actor.ppo_max_token_len_per_device=4096 --out "$OUT/${date}_h200_ketch_grpo_7b_offload_4096tokens.json"
  stage ketch_7b_offload_8192_no_recompute 240 $step --scale 7b --set $both actor.ppo_max_token_len_per_device=8192 \
    --out "$OUT/${date}_h200_ketch_grpo_7b_offload_8192tokens_no_recompute.json" ;;
capped)
  small="rollout.free_memory_while_training=true actor.optim.offload=true model.gradient_checkpointing=true \
    actor.ppo_max_token_len_per_device=4096"
  stage ketch_7b_80gb 250 $step --scale 7b --memory-cap-gib 78.5 --set $small \
    --out "$OUT/${date}_h200_ketch_grpo_7b_capped_78.5gib.json"
  stage ketch_1.5b_24gb 150 $step --scale 1.5b --memory-cap-gib 22.5 --set $small \
    --out "$OUT/${date}_h200_ketch_grpo_1.5b_capped_22.5gib.json" ;;
*) echo "unknown stage $1"; exit 2 ;;
esac
tar czf "$OUT/logs_$1.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
