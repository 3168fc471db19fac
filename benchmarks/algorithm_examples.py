"""Validation accuracy against training time of the algorithm examples on the built-in task (CPU).

Run the examples first, each for the same number of steps, then summarise their run directories:

    ketch train --config-path examples/arithmetic_grpo.yaml trainer.total_steps=100 trainer.default_local_dir=runs/alg
    ketch train --config-path examples/dapo.yaml trainer.total_steps=100 trainer.default_local_dir=runs/alg
    ...
    python benchmarks/algorithm_examples.py runs/alg/arithmetic-* [--out results/algorithm_examples.json]

For every validation it prints the step, the greedy validation accuracy and the training seconds so far (the
sum of `timing_s/step`, so validation and start-up are not counted); with dynamic sampling also the mean
number of generation rounds per step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ketch.tracking import read_metrics

ACC = "val/ketch/arithmetic/acc"


def summarise(run_dir: Path, max_step: int | None = None) -> dict:
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if max_step is None or r["step"] <= max_step]
    seconds, points = 0.0, []
    for record in records:
        seconds += record.get("timing_s/step", 0.0)
        if ACC in record:
            points.append({"step": record["step"], "acc": record[ACC], "train_s": round(seconds, 1)})
    rounds = [r["dynamic_sampling/gen_rounds"] for r in records if "dynamic_sampling/gen_rounds" in r]
    return {"run": run_dir.name, "validations": points, "mean_gen_rounds": float(np.mean(rounds)) if rounds else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--max-step", type=int, help="ignore steps after this one")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = [summarise(d, args.max_step) for d in args.run_dirs]
    for result in results:
        line = ", ".join(f"step {p['step']}: {p['acc']:.3f} ({p['train_s']:.0f} s)" for p in result["validations"])
        rounds = f"; {result['mean_gen_rounds']:.2f} generation rounds/step" if result["mean_gen_rounds"] else ""
        print(f"{result['run']}: {line}{rounds}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
