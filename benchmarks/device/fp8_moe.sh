#!/bin/bash
# One device command for FP8 rollout (issue 53) and MoE decoding under CUDA graphs (issue 52): the GPU tests of both
# (FP8 matmuls; the MoE families' matrix rows), then `decode_step.py` of the Qwen2.5-7B shape in bf16 against FP8
# (whole generations of 4 and 64 rows, one captured step of 4 rows at 8k of context; FP8 also with an FP8 KV cache),
# then Qwen3-30B-A3B's shape
# (LAYERS of its 48 layers) with fixed-shape experts in CUDA graphs against transformers' experts without graphs.
# Stage a3b: a GRPO step of that shape (LAYERS layers: the machine's 64 GB disk does not hold all 48 in bf16) with
# LoRA on the attention projections and routing replay (R3), the rollout reading the frozen experts in place.
# Stage matmul: `benchmarks/fp8_matmul.py`, each projection in bf16, `_scaled_mm` and the FP8 weight kernel.
# Stage steps: GRPO steps of the 0.5B, 1.5B and 7B shapes (7B with LoRA) on the fixed workload, bf16 and FP8.
# Each stage has its own time limit and writes its JSON to $OUT as it ends; STAGES picks some of them:
#   PYTHONPATH=. STAGES="tests matmul fp8 moe a3b" LAYERS=24 bash benchmarks/device/fp8_moe.sh
set -u
mkdir -p "$OUT/logs"
STAGES=${STAGES:-tests fp8 moe}
LAYERS=${LAYERS:-24}
stage() { local name=$1; shift; echo "=== $name $(date -u +%T)"; timeout "$@" >"$OUT/logs/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; tail -n 3 "$OUT/logs/$name.log"; }
if [[ $STAGES == *tests* ]]; then
    stage fp8_tests 120 python3 -m pytest tests/gpu/test_fp8_gpu.py -q -p no:cacheprovider  # 19 s on an H100
    stage moe_tests 360 python3 -m pytest tests/gpu/test_architectures_gpu.py -q -p no:cacheprovider \
        -k "qwen3_moe or mixtral or deepseek_v3 or olmoe"  # with the FP8 tests, past 240 s on an H100 (2026-12-07)
fi
if [[ $STAGES == *matmul* ]]; then  # each projection of the three shapes: bf16, _scaled_mm, the FP8 weight kernel
    stage fp8_matmul 150 python3 benchmarks/fp8_matmul.py --rows 1 4 16 64 128 256 --out "$OUT/fp8_matmul.json"
fi
if [[ $STAGES == *fp8* ]]; then
    for flag in "" --fp8 "--fp8 --kv-fp8"; do
        name=7b$(echo "$flag" | tr -d ' -' | sed 's/^./_&/')  # 7b, 7b_fp8, 7b_fp8kvfp8
        stage "$name" 240 python3 benchmarks/decode_step.py --model qwen2.5-7b --rows 4 64 --steps 2 \
            --long-step 8192 $flag --out "$OUT/decode_$name.json"
    done
fi
if [[ $STAGES == *steps* ]]; then  # GRPO steps on the fixed workload, bf16 against FP8 (the 7B shape with LoRA)
    for scale in full 1.5b 7b; do
        lora=$([[ $scale == 7b ]] && echo "--lora-rank 32")
        for fp8 in "" rollout.quantization=fp8; do
            name=step_${scale}${fp8:+_fp8}
            stage "$name" 200 python3 benchmarks/rl_step.py --variant grpo --scale "$scale" $lora --warmup 1 --steps 3 \
                --out "$OUT/$name.json" --set model.gradient_checkpointing=true $fp8
        done
    done
fi
if [[ $STAGES == *moe* ]]; then
    for flag in "" --moe-loops; do
        stage "moe$flag" 240 python3 benchmarks/decode_step.py --model qwen3-30b-a3b --layers "$LAYERS" --rows 4 64 \
            --steps 2 $flag --out "$OUT/decode_30b_a3b${flag/--/_}.json"
    done
fi
if [[ $STAGES == *a3b* ]]; then
    stage a3b_lora_r3 540 python3 benchmarks/rl_step.py --scale 30b-a3b --layers "$LAYERS" --lora-rank 32 --warmup 1 \
        --steps 3 --out "$OUT/grpo_30b_a3b_lora_r3.json" --set "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]" \
        actor.router_replay=rollout model.gradient_checkpointing=true
fi
