#!/bin/bash
# Every measurement that waits for the two-GPU machine (nvidia-h200-x2), in stages that each fit one device
# command (at most 600 s; the timeouts of a stage's steps add up to 560 s at most); run them in this order:
#   megatron   tests/gpu but Qwen3's (first update: FSDP 1 GPU against Megatron TP=1, TP=2, TP=2+SP+recompute,
#              PP=2; tiny `ketch train` runs with TP=2 and with two data ranks and the distributed optimizer)
#   qwen3      tests/gpu's Qwen3 cases: the Qwen3-0.6B shape's first update, Megatron TP=1 and TP=2 against FSDP
#   grpo30     3 GRPO steps with Megatron TP=2 (the grad_norm check), then 30 GRPO steps, FSDP on one GPU
#              against Megatron TP=2, with the greedy export check
#   7b         the Qwen2.5-7B shape: Megatron TP=2 against FSDP2 on two GPUs (recomputation on), then the
#              7B-shaped hf rollout at TP=1 and TP=2
#   scaling    ketch GRPO on one GPU (16 prompts, and 8: one GPU's half of the strong-scaling run) and on two
#              (16 and 32 prompts), then the weight hand-off at 1 and 2 processes
#   standalone ketch GRPO, 16 prompts, on one GPU, then with the rollout on the second GPU (rollout.placement=
#              standalone): one step ahead (staleness 1) with 16 prompts (strong scaling) and 32 (weak), from the
#              newest weights (staleness 0) with 16; then the NCCL bridge test
# Results (JSON) go to $OUT, each stage's logs to $OUT/logs_STAGE.tgz. Set-up first (megatron-core from .whl/,
# Ray from .carry/):
#   mkdir -p /tmp/site && tar xJf .carry/ray-py312.txz -C /tmp/site && python3 -m pip install -q --no-index \
#     --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
#   bash benchmarks/device/two_gpu.sh STAGE
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/logs"
date=$(date -u +%F)
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; grep -hE "^step|passed|skipped|failed|error" "$OUT/logs/$name.log" | tail -8; }
mega="python3 benchmarks/megatron_vs_fsdp.py"
step="python3 benchmarks/rl_step.py --variant grpo --warmup 1 --steps 3"
case ${1:?stage: megatron, qwen3, grpo30, 7b, scaling or standalone} in
megatron)
  KETCH_GPU_RESULTS=$OUT stage tests_gpu 560 python3 -m pytest tests/gpu -q -p no:cacheprovider -k "not qwen3" ;;
qwen3)
  KETCH_GPU_RESULTS=$OUT stage tests_gpu_qwen3 400 python3 -m pytest tests/gpu -q -p no:cacheprovider -k qwen3 ;;
grpo30)
  stage tp2_check 150 $mega --steps 3 --runs megatron_tp2 --no-greedy --set actor.use_dynamic_bsz=false \
    --out "$OUT/${date}_h200x2_megatron_tp2_grad_norm_check.json"
  stage grpo30 400 $mega --steps 30 --runs fsdp_1gpu megatron_tp2 --set actor.use_dynamic_bsz=false \
    --out "$OUT/${date}_h200x2_megatron_vs_fsdp_grpo30.json" ;;
7b)
  for run in megatron_tp2 fsdp_2gpu; do
    stage "7b_$run" 230 $mega --scale 7b --steps 4 --runs $run --no-greedy --set model.gradient_checkpointing=true \
      --out "$OUT/${date}_h200x2_7b_$run.json"
  done
  stage tp_rollout 100 python3 benchmarks/tp_rollout.py --tp 1 2 --out "$OUT/${date}_h200x2_tp_rollout_7b_static.json" ;;
scaling)
  CUDA_VISIBLE_DEVICES=0 stage grpo_1gpu 100 $step --out "$OUT/${date}_h200x2_ketch_grpo_1gpu.json"
  # half the workload on one GPU: what each GPU of the 16-prompt two-GPU run has to do, without communication
  CUDA_VISIBLE_DEVICES=0 stage grpo_1gpu_8 90 $step --prompts 8 --out "$OUT/${date}_h200x2_ketch_grpo_1gpu_8prompts.json"
  stage grpo_2gpu_16 120 $step --set trainer.n_gpus_per_node=2 --out "$OUT/${date}_h200x2_ketch_grpo_2gpu_16prompts.json"
  stage grpo_2gpu_32 120 $step --prompts 32 --set trainer.n_gpus_per_node=2 \
    --out "$OUT/${date}_h200x2_ketch_grpo_2gpu_32prompts.json"
  stage handoff 60 python3 benchmarks/weight_handoff.py --scale 0.5b --world 1 2 --out "$OUT/${date}_h200x2_weight_handoff.json" ;;
standalone)
  CUDA_VISIBLE_DEVICES=0 stage grpo_1gpu 100 $step --out "$OUT/${date}_h200x2_ketch_grpo_1gpu.json"
  for run in "1 16 130" "1 32 140" "0 16 130"; do
    read -r staleness prompts limit <<< "$run"
    stage "standalone_${staleness}_$prompts" $limit $step --prompts $prompts --set rollout.placement=standalone \
      rollout.staleness=$staleness --out "$OUT/${date}_h200x2_ketch_grpo_standalone_staleness${staleness}_${prompts}prompts.json"
  done
  stage bridge 60 python3 -m pytest tests/gpu/test_weight_bridge_gpu.py -q -p no:cacheprovider ;;
*) echo "unknown stage $1"; exit 2 ;;
esac
tar czf "$OUT/logs_$1.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
