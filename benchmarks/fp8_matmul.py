"""The decoder's projections at a few rows, bf16 against FP8 (one GPU): time per projection and against the floor.

For each projection of the Qwen2.5 0.5B, 1.5B and 7B shapes (the fused q/k/v and gate/up, o and down) and each
`--rows`: cuBLAS in bf16 (`F.linear`), `torch._scaled_mm` on activations quantized per token (FP8 rollout's matmul
for more than 16 rows), and the few-rows kernel of `ketch/rollout/few_rows_kernel.py` (up to 64 rows) on the FP8
weights (`kernel_us`, FP8 rollout's few-row steps) and on the bf16 ones (`kernel_bf16_us`, against cuBLAS), each
captured in a CUDA graph that cycles through enough copies of the weight that the L2 cache holds none of them. The
floor is the weight's bytes over the GPU's copy bandwidth. `--sweep` also times the kernel's launch settings at 4 rows.

    PYTHONPATH=. python3 benchmarks/fp8_matmul.py --rows 1 4 16 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from decode_step import cuda_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.rollout.few_rows_kernel import launch, weight_matmul
from ketch.rollout.fp8 import quantize_per_channel, scaled_mm_linear

SHAPES = {  # (hidden, intermediate, heads x head size, kv heads x head size)
    "qwen2.5-0.5b": (896, 4864, 896, 128),
    "qwen2.5-1.5b": (1536, 8960, 1536, 256),
    "qwen2.5-7b": (3584, 18944, 3584, 512),
}
L2_BYTES = 200 * 2**20
"""Bytes of weights a timed graph cycles through, more than any GPU's L2 cache."""


def projections(hidden: int, intermediate: int, q: int, kv: int) -> dict[str, tuple[int, int]]:
    """`[out, in]` of each of a layer's projections as the decoder runs them (fused q/k/v and gate/up)."""
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
    }


def time_projection(out: int, inputs: int, rows: int, bandwidth: float, sweep: bool) -> dict:
    """Microseconds of each method at `rows` rows of `[out, inputs]`, and the floors of bf16 and FP8 weights."""
    copies = min(256, max(2, -(-L2_BYTES // (out * inputs))))
    weights = [torch.randn(out, inputs, device="cuda", dtype=torch.bfloat16) / inputs**0.5 for _ in range(copies)]
    fp8 = [quantize_per_channel(w) for w in weights]
    x = torch.randn(rows, inputs, device="cuda", dtype=torch.bfloat16)
    record = {
        "out": out,
        "in": inputs,
        "rows": rows,
        "launch": launch(out, inputs, torch.cuda.get_device_properties(0).multi_processor_count),
        "bf16_us": timed([lambda w=w: torch.nn.functional.linear(x, w) for w in weights]),
        "kernel_us": timed([lambda w=w: weight_matmul(x, w.data, w.scale) for w in fp8]),
        "kernel_bf16_us": timed([lambda w=w: weight_matmul(x, w) for w in weights]),
        "scaled_mm_us": timed([lambda w=w: scaled_mm_linear(x, w) for w in fp8]),
        "floor_bf16_us": 1e6 * out * inputs * 2 / bandwidth,
        "floor_fp8_us": 1e6 * out * inputs / bandwidth,
    }
    expected = torch.nn.functional.linear(x.float(), fp8[0].data.float() * fp8[0].scale)
    record["kernel_max_diff"] = (weight_matmul(x, fp8[0].data, fp8[0].scale).float() - expected).abs().max().item()
    if sweep and rows <= 16:
        record["sweep_us"] = sweep_launches(x, fp8)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in record.items()}


def timed(fns: list) -> float:
    """Microseconds a call of the functions `fns`, each called once in turn in one CUDA graph."""
    return 1e6 * cuda_seconds(fns, calls=max(20, len(fns)))


def sweep_launches(x: torch.Tensor, fp8: list) -> dict[str, float]:
    """Microseconds of the kernel at each launch setting (BLOCK_N, splits, BLOCK_K, warps, stages)."""
    times = {}
    for block_n, splits, block_k, warps, stages in itertools.product(
        (16, 32, 64), (1, 2, 4), (128, 256, 512), (4, 8), (3, 4)
    ):
        tuning = {"BLOCK_N": block_n, "splits": splits, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
        try:
            us = timed([lambda w=w, t=tuning: weight_matmul(x, w.data, w.scale, tuning=dict(t)) for w in fp8])
        except Exception as error:  # a setting the GPU cannot launch (shared memory): skipped, said
            print(f"  {tuning}: {type(error).__name__}", flush=True)
            continue
        times[f"{block_n}/{splits}/{block_k}/{warps}/{stages}"] = round(us, 2)
    best = sorted(times.items(), key=lambda item: item[1])[:5]
    return dict(best)


def copy_bandwidth() -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read and write counted)."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / cuda_seconds(lambda: b.copy_(a), calls=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="time the kernel's launch settings at 4 rows")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "models": {}}
    for model in args.models:
        rows_records = []
        for name, (out, inputs) in projections(*SHAPES[model]).items():
            for rows in args.rows:
                record = {"projection": name} | time_projection(out, inputs, rows, bandwidth, args.sweep and rows == 4)
                print(json.dumps(record), flush=True)
                rows_records.append(record)
        result["models"][model] = rows_records
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
