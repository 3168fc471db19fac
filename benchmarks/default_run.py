"""Time `ketch train` on a built-in task, warm-up included, and record its learning curve.

    PYTHONPATH=. python3 benchmarks/default_run.py --empty-cache --out benchmarks/results/x.json [overrides ...]
    PYTHONPATH=. python3 benchmarks/default_run.py --config-path examples/arithmetic_ppo.yaml --out ...

Without `--config-path` it runs what `make run` runs; with one, that example config of a built-in task (the
arithmetic ones, or the visual task's `examples/vision.yaml`). With `--empty-cache` the built-in data and the
warmed-up model are built afresh in a temporary cache, as on a fresh clone. Prints and writes: wall and CPU seconds
of the warm-up and of the RL run, the warm-up's validations (kept beside the built-in model), the median seconds
of each step stage, the validation accuracy at every validation, torch's thread count and the machine's load
average (the figures are only comparable on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.config import load_config
from ketch.tracking import read_metrics
from ketch.trainer import builtin
from ketch.trainer.ppo import PPOTrainer

ACC = "val/ketch/arithmetic/acc"
VAL_ACC = re.compile(r"val/.+/acc")
"""The greedy validation accuracy of any task's data source (`ACC`, the visual task's `val/ketch/dots/acc`)."""


def timed(fn, *args):
    """(result, wall seconds, CPU seconds of this process and its finished children) of `fn(*args)`."""
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = fn(*args)
    return result, time.perf_counter() - wall, _cpu_seconds() - cpu


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def stage_medians(records: list[dict]) -> dict[str, float]:
    """Median seconds of each `timing_s/` stage over the steps after the first (which includes one-off start-up
    work); a stage counts over the steps that have it (validation times only come with validated steps)."""
    steps = [r for r in records if "timing_s/step" in r][1:]
    stages = sorted({k for r in steps for k in r if k.startswith("timing_s/")})
    return {k.removeprefix("timing_s/"): round(statistics.median(r[k] for r in steps if k in r), 3) for k in stages}


def run_dir(prefix: str, empty_cache: bool) -> str:
    """A new directory for the run's outputs; with `empty_cache`, a new ketch cache directory as well (data and
    warmed-up models built afresh, as on a fresh clone)."""
    if empty_cache:
        os.environ["KETCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="ketch-cache-")
    return tempfile.mkdtemp(prefix=prefix)


def timed_fit(config, stage: str) -> tuple[list[dict], dict]:
    """Train `config` with `PPOTrainer`, timed: the run's metrics records, and `{stage}_wall_s`, `{stage}_cpu_s`
    and the median seconds of each step stage (`median_stage_s`)."""
    trainer = PPOTrainer(config)
    _, wall, cpu = timed(trainer.fit)
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    timing = {f"{stage}_wall_s": round(wall, 1), f"{stage}_cpu_s": round(cpu, 1)}
    return records, timing | {"median_stage_s": stage_medians(records)}


def validations(records: list[dict] | Path) -> dict[int, float]:
    """Each validation's greedy accuracy by step, from metrics records or their JSONL file (none where there is no
    such file: a built-in model cached before its warm-up's log was kept, or a model that is not built in)."""
    if isinstance(records, Path):
        records = read_metrics(records) if records.is_file() else []
    return {r["step"]: round(r[acc], 3) for r in records for acc in r if VAL_ACC.fullmatch(acc)}


def emit(result: dict, out: Path | None) -> None:
    """Print `result` as JSON and write it to `out` when given."""
    print(json.dumps(result, indent=2))
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--empty-cache", action="store_true", help="build data and warm-up in a fresh cache")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--config-path", help="a YAML file of the built-in task, as for ketch train --config-path")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for ketch train")
    args = parser.parse_args()
    runs = run_dir("ketch-default-run-", args.empty_cache)
    start = time.perf_counter()
    config = load_config(args.config_path, [f"trainer.default_local_dir={runs}", *args.overrides])
    model, warmup_wall, warmup_cpu = timed(builtin.resolve_model_path, config)  # cached: PPOTrainer reuses it
    print(f"warm-up (or the cached model): {warmup_wall:.1f} s wall, {warmup_cpu:.1f} s CPU", flush=True)
    warmup_acc = validations(Path(model) / builtin.WARMUP_LOG)
    print(f"the warm-up's validations (step: accuracy): {warmup_acc}", flush=True)
    records, rl_timing = timed_fit(config, "rl")
    result = {
        "config_path": args.config_path,
        "overrides": args.overrides,
        "empty_cache": args.empty_cache,
        "total_wall_s": round(time.perf_counter() - start, 1),
        "warmup_wall_s": round(warmup_wall, 1),
        "warmup_cpu_s": round(warmup_cpu, 1),
        "warmup_val_acc": warmup_acc,
        **rl_timing,
        "val_acc": validations(records),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
