"""Time `ketch train --config-path examples/tool_calculator.yaml`, both warm-ups included, and record its curve.

    PYTHONPATH=. python3 benchmarks/tool_calculator_run.py --empty-cache --out benchmarks/results/x.json [overrides]

With `--empty-cache` the built-in data and the built-in models (`builtin:tiny-arithmetic`, then
`builtin:tiny-calculator-calls` and `builtin:tiny-calculator` from it) are built afresh in a temporary cache, as on
a fresh clone. Prints and writes: wall and CPU seconds of the arithmetic warm-up, of the two calculator warm-ups
together and of the GRPO run, the median seconds of each step stage, the
greedy validation accuracy, tool-call rate and tool error rate at every validation, torch's thread count and
the machine's load average (the figures are only comparable on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from default_run import emit, run_dir, timed, timed_fit

from ketch.config import load_config
from ketch.config.schema import BUILTIN_MODEL
from ketch.trainer import builtin

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tool_calculator.yaml"
CURVES = {
    "val_acc": "val/ketch/calculator/acc",
    "val_tool_call_rate": "val/multi_turn/tool_call_rate",
    "val_tool_error_rate": "val/multi_turn/tool_error_rate",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--empty-cache", action="store_true", help="build data and both warm-ups in a fresh cache")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for ketch train")
    args = parser.parse_args()
    runs = run_dir("ketch-tool-calculator-", args.empty_cache)
    start, load_before = time.perf_counter(), os.getloadavg()
    config = load_config(str(CONFIG), overrides=[f"trainer.default_local_dir={runs}", *args.overrides])
    arithmetic = load_config(overrides=[f"model.path={BUILTIN_MODEL}", f"trainer.device={config.trainer.device}"])
    _, arithmetic_wall, arithmetic_cpu = timed(builtin.resolve_model_path, arithmetic)
    _, calculator_wall, calculator_cpu = timed(builtin.resolve_model_path, config)  # cached: PPOTrainer reuses it
    records, grpo_timing = timed_fit(config, "grpo")
    result = {
        "overrides": args.overrides,
        "empty_cache": args.empty_cache,
        "total_wall_s": round(time.perf_counter() - start, 1),
        "arithmetic_warmup_wall_s": round(arithmetic_wall, 1),
        "arithmetic_warmup_cpu_s": round(arithmetic_cpu, 1),
        "calculator_warmup_wall_s": round(calculator_wall, 1),
        "calculator_warmup_cpu_s": round(calculator_cpu, 1),
        **grpo_timing,
        **{name: {r["step"]: round(r[key], 3) for r in records if key in r} for name, key in CURVES.items()},
        "torch_threads": torch.get_num_threads(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
