"""Is learning kept with partial rollouts? The built-in run (`ketch train` with no arguments: GRPO, 190 steps) against
the same run with partial rollouts that carry at least a third of the trajectories to the next step (issue 49).

    PYTHONPATH=. python3 benchmarks/partial_rollouts.py --out benchmarks/results/x.json [--runs synchronous,partial]
        [overrides of both runs ...]

The partial run over-samples 1.5 x data.train_batch_size prompts and generates in rounds of `--round-tokens` tokens
(8: the built-in answers `#### N` and their end token take 7 to 9), so the groups beyond the batch, finished or
not, go to the next step; its off-policy tokens are weighted by truncated importance sampling (actor.rollout_is=
token, which needs the training engine's old log-probs: actor.old_log_prob_from_rollout=false). Prints and writes,
per run: the greedy validation accuracy at each validation, wall seconds, the median seconds of each stage, and for
the partial run the mean over steps of the trajectories carried (all, unfinished, their fraction of the step's),
the staleness (mean of the means, max of the maxima), the rounds and the tokens dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from default_run import ACC, emit, run_dir, timed_fit

from ketch.config import load_config

PARTIAL = (
    "rollout.partial.enable=true",
    "rollout.partial.over_sample=1.5",
    "rollout.partial.max_staleness=1",
    "actor.rollout_is=token",
    "actor.old_log_prob_from_rollout=false",
)
MEANS = ("carried", "carried_unfinished", "carried_fraction", "staleness/mean", "rounds", "tokens_dropped")


def partial_summary(records: list[dict]) -> dict[str, float]:
    """The partial rollouts' metrics over the run's steps: means of `MEANS`, the largest staleness, tokens dropped."""
    steps = [r for r in records if "partial/carried" in r]
    out = {f"{key}_mean": round(statistics.mean(r[f"partial/{key}"] for r in steps), 3) for key in MEANS}
    out["staleness_max"] = max(r["partial/staleness/max"] for r in steps)
    out["tokens_dropped_total"] = sum(r["partial/tokens_dropped"] for r in steps)
    return out


def run(name: str, runs: str, overrides: list[str]) -> dict:
    config = load_config(overrides=[f"trainer.default_local_dir={runs}", f"trainer.experiment_name={name}", *overrides])
    records, timing = timed_fit(config, "rl")
    result = {"overrides": overrides, **timing, "val_acc": {r["step"]: round(r[ACC], 3) for r in records if ACC in r}}
    if config.rollout.partial.enable:
        result["partial"] = partial_summary(records)
    print(f"== {name}: {json.dumps(result)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--round-tokens", type=int, default=8, help="rollout.partial.round_tokens of the partial run")
    parser.add_argument(
        "--runs", default="synchronous,partial", help="which runs, comma-separated; they run one after the other"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides of both runs, as for ketch train")
    args = parser.parse_args()
    runs, start = run_dir("ketch-partial-rollouts-", empty_cache=False), time.perf_counter()
    overrides = {
        "synchronous": args.overrides,
        "partial": [*args.overrides, *PARTIAL, f"rollout.partial.round_tokens={args.round_tokens}"],
    }
    result = {name: run(name, runs, overrides[name]) for name in args.runs.split(",")}
    result["final_val_acc"] = {name: list(r["val_acc"].values())[-1] for name, r in result.items()}
    if len(result["final_val_acc"]) == 2:
        result["final_val_acc_gap"] = round(
            result["final_val_acc"]["partial"] - result["final_val_acc"]["synchronous"], 3
        )
    result["total_wall_s"] = round(time.perf_counter() - start, 1)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    emit(result, args.out)


if __name__ == "__main__":
    main()
