"""Validation accuracy against training time of the algorithm examples on the built-in task (CPU).

Run the examples first, validating often, then summarise their run directories:

    ketch train --config-path examples/arithmetic_grpo.yaml trainer.experiment_name=grpo-s1 trainer.seed=1 \
        trainer.test_freq=10 trainer.default_local_dir=runs/alg
    ketch train --config-path examples/dapo.yaml trainer.experiment_name=dapo-s1 trainer.seed=1 \
        trainer.total_steps=120 trainer.test_freq=10 trainer.default_local_dir=runs/alg
    ...
    python benchmarks/algorithm_examples.py runs/alg/* [--same-time-as grpo] [--out results/algorithm_examples.json]

For every validation it prints the step, the greedy validation accuracy and the training seconds so far (the
sum of `timing_s/step`, so validation and start-up are not counted); with dynamic sampling also the mean
number of generation rounds per step. With `--same-time-as METHOD` (runs named `<method>-s<seed>`), each run is
read at its last validation within the training seconds that METHOD's run of the same seed took in all (or
within the time every run of that seed reached, if one stopped earlier), and the accuracies are averaged over
seeds: the same wall time, not the same steps. Start the runs together so that they share the machine's load.
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


def at_budget(result: dict, seconds: float) -> dict:
    """The last validation of a run within `seconds` of training."""
    return [p for p in result["validations"] if p["train_s"] <= seconds][-1]


def same_time(results: list[dict], baseline: str) -> dict[str, dict]:
    """Per method, the accuracy of each seed's run at the same training seconds, and its mean and sample standard
    deviation over seeds. The budget of a seed is the training seconds of `baseline`'s run, or less when a run of
    that seed stopped earlier (every run is read within the time all of them reached)."""
    runs = {tuple(r["run"].rsplit("-s", 1)): r for r in results}
    budgets = {}
    for method, seed in runs:
        if (baseline, seed) in runs:
            reached = runs[method, seed]["validations"][-1]["train_s"]
            budgets[seed] = min(budgets.get(seed, runs[baseline, seed]["validations"][-1]["train_s"]), reached)
    summary = {}
    for method in sorted({m for m, _ in runs}):
        points = {s: at_budget(runs[method, s], b) | {"budget_s": b} for s, b in budgets.items() if (method, s) in runs}
        accs = [p["acc"] for p in points.values()]
        spread = float(np.std(accs, ddof=1)) if len(accs) > 1 else 0.0
        summary[method] = {"by_seed": points, "acc_mean": float(np.mean(accs)), "acc_std": spread}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--max-step", type=int, help="ignore steps after this one")
    parser.add_argument("--same-time-as", metavar="METHOD", help="compare at the training seconds of METHOD's runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = [summarise(d, args.max_step) for d in args.run_dirs]
    for result in results:
        line = ", ".join(f"step {p['step']}: {p['acc']:.3f} ({p['train_s']:.0f} s)" for p in result["validations"])
        rounds = f"; {result['mean_gen_rounds']:.2f} generation rounds/step" if result["mean_gen_rounds"] else ""
        print(f"{result['run']}: {line}{rounds}")
    output: dict | list = results
    if args.same_time_as:
        summary = same_time(results, args.same_time_as)
        for method, m in summary.items():
            seeds = ", ".join(f"seed {s}: {p['acc']:.3f} at step {p['step']}" for s, p in m["by_seed"].items())
            print(f"{method}: {m['acc_mean']:.3f} ± {m['acc_std']:.3f} at {args.same_time_as}'s time ({seeds})")
        output = {"same_wall_time_as": args.same_time_as, "summary": summary, "runs": results}
    if args.out:
        args.out.write_text(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
