#!/bin/bash
# The GPU architecture matrix (tests/gpu/test_architectures_gpu.py, every family with the defaults) in SHARDS pytest
# processes side by side on one GPU: the tiny models leave it idle, and most of a family's time is compilation on the
# CPU's cores. Each shard's log goes to $OUT/logs; the summary lines are printed. From the repository root:
#   PYTHONPATH=. SHARDS=4 bash benchmarks/device/architecture_matrix.sh [pytest -k expression]
set -u
mkdir -p "$OUT/logs"
SHARDS=${SHARDS:-4}
mapfile -t ids < <(python3 -m pytest tests/gpu/test_architectures_gpu.py --collect-only -q -p no:cacheprovider \
    ${1:+-k "$1"} | grep "::")
for ((shard = 0; shard < SHARDS; shard++)); do
    mine=()
    for ((i = shard; i < ${#ids[@]}; i += SHARDS)); do mine+=("${ids[$i]}"); done
    ((${#mine[@]})) || continue
    KETCH_CACHE_DIR=/tmp/ketch-cache-$shard TORCHINDUCTOR_COMPILE_THREADS=4 python3 -m pytest -q -p no:cacheprovider -s "${mine[@]}" \
        >"$OUT/logs/matrix_$shard.log" 2>&1 &
done
wait
grep -h "^FAILED\|passed\|failed" "$OUT/logs"/matrix_*.log
grep -h "^matrix" "$OUT/logs"/matrix_*.log >"$OUT/matrix_lines.txt"
