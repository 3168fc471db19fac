"""Does the GPU learn as the CPU does? The tool example and the built-in arithmetic run, each with its defaults, from
an empty cache, in one command (issue 36); on one H200 about 4 minutes (2026-12-03: 3 min 1 s for `tool`,
27 s for `arithmetic`, 34–80 s for each warm-up of `warmup_packing`).

    PYTHONPATH=. python3 benchmarks/learning_check.py --out $OUT/learning_check.json [--device cuda]
        [--runs tool,arithmetic,warmup_packing] [--keep-cache] [--tool-model DIR] [overrides of both runs ...]

`--tool-model` starts the tool example's GRPO from that model instead of its warm-up (a model carried from another
machine: the same start on both devices).

`tool`: `ketch train --config-path examples/tool_calculator.yaml` (the arithmetic warm-up, both calculator
warm-ups, then GRPO's 100 steps); `arithmetic`: `ketch train` with no arguments (its warm-up is the one `tool`
built, taken from the same cache); `warmup_packing`: the first calculator warm-up from the same arithmetic model,
packed and padded, for each of `--warmup-seeds`. Writes each run's curves by step: the validation accuracy (and,
for `tool`, the tool-call and tool-error rates), the training reward, the PPO clip fraction, the rollout mismatch
(`training/rollout_probs_diff_*` overall and per kind of turn, `training/rollout_kl`); the warm-ups' validations
(accuracy and loss); wall seconds of each part. Prints the same, and each run's accuracy at the start, the best
and the end (for `warmup_packing`, the final accuracies and their means by path).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from default_run import run_dir, timed, timed_fit

from ketch.config import load_config
from ketch.config.schema import BUILTIN_CALLER_MODEL, BUILTIN_MODEL
from ketch.tracking import read_metrics
from ketch.trainer import builtin
from ketch.trainer.sft import SFTTrainer

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tool_calculator.yaml"
CURVES = {
    "val_acc": "val/ketch/{task}/acc",
    "val_tool_call_rate": "val/multi_turn/tool_call_rate",
    "val_tool_error_rate": "val/multi_turn/tool_error_rate",
    "score": "critic/score/mean",
    "pg_clipfrac": "actor/pg_clipfrac",
    "rollout_kl": "training/rollout_kl",
    "rollout_probs_diff_mean": "training/rollout_probs_diff_mean",
    "rollout_probs_diff_max": "training/rollout_probs_diff_max",
    "rollout_probs_diff_mean_tool_turns": "training/rollout_probs_diff_mean/tool_turns",
    "rollout_probs_diff_max_tool_turns": "training/rollout_probs_diff_max/tool_turns",
    "rollout_probs_diff_mean_answer_turns": "training/rollout_probs_diff_mean/answer_turns",
    "rollout_probs_diff_max_answer_turns": "training/rollout_probs_diff_max/answer_turns",
}
VALIDATION = re.compile(r"SFT step (\d+)/\d+: (.*)")


class WarmupValidations(logging.Handler):
    """Collects the built-in warm-ups' validation lines (`SFT step N/M: val/...=x, ...`) by warm-up: a warm-up
    runs from its `warming up` line to its SFT's `SFT finished` line, and builds the warm-up it starts from within
    that span; validation lines outside every warm-up (`warmup_packing`'s own SFTs) are not collected."""

    def __init__(self):
        super().__init__()
        self.running, self.by_warmup = [], {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("warming up the built-in tiny model"):
            self.running.append(Path(message.rsplit(" ", 1)[-1].rstrip(")")).name)
        elif message.startswith("SFT finished") and self.running:
            self.running.pop()
        match = VALIDATION.match(message)
        if match and "val/" in match.group(2) and self.running:
            values = dict(pair.split("=") for pair in match.group(2).split(", "))
            kept = {k.split("/")[-1]: float(v) for k, v in values.items() if k == "val/loss" or k.endswith("/acc")}
            self.by_warmup.setdefault(self.running[-1], []).append({"step": int(match.group(1)), **kept})


def curves(records: list[dict], task: str) -> dict[str, dict[int, float]]:
    out = {}
    for name, key in CURVES.items():
        key = key.format(task=task)
        values = {r["step"]: float(f"{r[key]:.4g}") for r in records if key in r and "step" in r}
        if values:
            out[name] = values
    return out


def arithmetic_model(device: str) -> str:
    """The directory of `builtin:tiny-arithmetic`, warmed up on `device` where the cache lacks it."""
    config = load_config(overrides=[f"model.path={BUILTIN_MODEL}", f"trainer.device={device}"])
    return builtin.resolve_model_path(config)


def run(name: str, config, task: str) -> dict:
    """Both warm-ups of `config`'s model (built where missing, timed), then its training run."""
    _, arithmetic_s, _ = timed(arithmetic_model, config.trainer.device)
    _, model_s, _ = timed(builtin.resolve_model_path, config)
    records, timing = timed_fit(config, name)
    result = {"arithmetic_warmup_wall_s": round(arithmetic_s, 1), "model_warmup_wall_s": round(model_s, 1)}
    result |= timing | curves(records, task)
    acc = list(result.get("val_acc", {}).values())
    if acc:
        result["acc_start_best_end"] = [acc[0], max(acc), acc[-1]]
    print(f"== {name}: accuracy start/best/end {result.get('acc_start_best_end')}", flush=True)
    return result


def warmup_packing(device: str, runs: str, seeds: list[int]) -> dict:
    """The first calculator warm-up (`builtin:tiny-calculator-calls`) from the same arithmetic model, packed and
    padded, with each of `seeds`: the greedy validation accuracy and loss by step of each, the final accuracies and
    their means by path."""
    start, warmup = arithmetic_model(device), builtin.WARMUPS[BUILTIN_CALLER_MODEL]
    result, final = {}, {"packed": [], "padded": []}
    for seed, packed in itertools.product(seeds, (True, False)):
        path = "packed" if packed else "padded"
        name = f"{path}_seed{seed}"
        variation = (f"model.use_remove_padding={packed}", f"trainer.seed={seed}", f"trainer.experiment_name={name}")
        trainer = SFTTrainer(builtin.warmup_config(warmup, start, runs, device, *variation))
        _, seconds, _ = timed(trainer.fit)
        records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if warmup.metric in r]
        result[name] = {r["step"]: {"acc": r[warmup.metric], "loss": round(r["val/loss"], 5)} for r in records}
        result[f"{name}_wall_s"] = round(seconds, 1)
        final[path].append(records[-1][warmup.metric])
    result["final_acc"] = final
    result["final_acc_mean"] = {path: round(statistics.mean(accs), 4) for path, accs in final.items()}
    print(f"== warm-up final accuracy by path and seed {final}, means {result['final_acc_mean']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", default="tool,arithmetic", help="which runs, comma-separated")
    parser.add_argument("--keep-cache", action="store_true", help="use the ketch cache as it is (warm-ups built)")
    parser.add_argument("--warmup-seeds", default="0", help="warmup_packing's seeds, comma-separated")
    parser.add_argument("--tool-model", help="start the tool example's GRPO from this model, not its warm-up")
    parser.add_argument("overrides", nargs="*", help="config overrides of both runs, as for ketch train")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("ketch").setLevel(logging.INFO)
    validations = WarmupValidations()
    logging.getLogger("ketch").addHandler(validations)
    runs = run_dir("ketch-learning-check-", empty_cache=not args.keep_cache)
    common = [f"trainer.device={args.device}", f"trainer.default_local_dir={runs}", *args.overrides]
    start = time.perf_counter()
    result = {"device": args.device, "overrides": args.overrides, "runs": {}}
    for name in args.runs.split(","):
        if name == "warmup_packing":
            result["runs"][name] = warmup_packing(args.device, runs, [int(s) for s in args.warmup_seeds.split(",")])
            continue
        if name == "tool":
            model = [f"model.path={args.tool_model}"] if args.tool_model else []
            config, task = load_config(str(CONFIG), overrides=[*common, *model]), "calculator"
        else:
            config, task = load_config(overrides=common), "arithmetic"
        result["runs"][name] = run(name, config, task)
    result["warmup_validations"] = validations.by_warmup
    result["total_wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
