"""Where metrics go: `metrics.jsonl` in the run directory (always), a readable console line, and the trackers
chosen in `trainer.logger`: TensorBoard, Weights & Biases, MLflow (each imported only when chosen).

Each step appends one JSON object `{"step": N, "<metric>": value, ...}`; events (recoveries, the end of a
run) are lines with an `"event"` field; validation samples go to `samples.jsonl`. The console shows a
progress bar on a terminal and one summary line every `trainer.log_interval` steps.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from ketch.tracking.backends import BACKENDS, Backend, TrackerError

__all__ = ["Tracker", "TrackerError", "format_step_line", "info", "read_metrics", "read_records"]

logger = logging.getLogger("ketch")

# (short console name, metric name, format); timing stages are added in the order they ran.
CONSOLE_FIELDS = (
    ("loss/actor", "actor/pg_loss", ".3f"),
    ("loss/critic", "critic/vf_loss", ".3f"),
    ("kl_divergence", "actor/reward_kl_penalty", ".3f"),
    ("kl_divergence", "actor/kl_loss", ".3f"),
    ("kl_divergence", "actor/ppo_kl", ".3f"),
    ("reward_mean", "critic/score/mean", ".2f"),
    ("reward_std", "critic/score/std", ".2f"),
    ("response_len_mean", "response_length/mean", ".1f"),
)


def format_step_line(step: int, metrics: dict[str, float]) -> str:
    """`Step 10: timing/gen=0.82s, ..., loss/actor=0.421, ..., response_len_mean=42.7` (+ validation)."""
    parts = [f"timing/{k.removeprefix('timing_s/')}={v:.2f}s" for k, v in metrics.items() if _is_stage_time(k)]
    shown = set()
    for short, name, fmt in CONSOLE_FIELDS:
        if name in metrics and short not in shown:
            parts.append(f"{short}={metrics[name]:{fmt}}")
            shown.add(short)
    parts += [f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith("val/") and k.endswith("/acc")]
    return f"Step {step}: " + ", ".join(parts)


def _is_stage_time(key: str) -> bool:
    return key.startswith("timing_s/") and key not in ("timing_s/step", "timing_s/weight_sync")


class Tracker:
    """Appends every metric to `run_dir/metrics.jsonl`, prints the console line every `log_interval`, and sends
    the numeric metrics to the backends named in `loggers` (`tensorboard`, `wandb`, `mlflow`).

    `step_lines=False` leaves the console lines to the caller (`ketch sft` and `ketch rm` print their own).
    `project`, `experiment` and `config` name the run and its settings for wandb and mlflow. A chosen backend
    whose library is missing raises `TrackerError` here, at start-up."""

    def __init__(
        self,
        run_dir: Path,
        loggers: list[str],
        total_steps: int,
        log_interval: int = 1,
        *,
        project: str = "ketch",
        experiment: str | None = None,
        config: dict[str, Any] | None = None,
        step_lines: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.backends = _open_backends(loggers, self.run_dir, project, experiment or self.run_dir.name, config or {})
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115  (kept open for the run)
        self.console = "console" in loggers
        self.step_lines = step_lines
        self.log_interval = log_interval
        self.bar = _progress_bar(total_steps) if self.console else None

    @classmethod
    def for_run(cls, run_dir: Path, config: dict[str, Any], total_steps: int, step_lines: bool = True) -> Tracker:
        """The tracker a run of the resolved `config` (as a dict) asks for in its `trainer` section."""
        t = config["trainer"]
        return cls(
            run_dir,
            t["logger"],
            total_steps,
            t["log_interval"],
            project=t["project_name"],
            experiment=t["experiment_name"],
            config=config,
            step_lines=step_lines,
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
        self._write({"step": step, **{k: _plain(v) for k, v in values.items()}})
        numbers = {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        for backend in self.backends:
            backend.log(numbers, step)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        timed = any(k.startswith("timing_s/") for k in metrics)
        if self.console and self.step_lines and step % self.log_interval == 0 and timed:
            info(format_step_line(step, metrics), self.bar)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """Append validation samples (prompt, response, score, ...) to `samples.jsonl`, each with `step`."""
        if not rows:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)

    def event(self, kind: str, **fields: Any) -> None:
        """Record a non-step event (e.g. a recovery) with a wall-clock timestamp."""
        self._write({"event": kind, "time": time.time(), **fields})

    def truncate_after(self, step: int) -> None:
        """Drop the step records (and validation samples) after `step`; events stay. A resumed run rewrites the
        steps it repeats, so the files have each step once; TensorBoard hides its events after `step` too."""
        self.jsonl.close()
        _truncate_jsonl(self.run_dir / "metrics.jsonl", step)
        _truncate_jsonl(self.run_dir / "samples.jsonl", step)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115  (kept open for the run)
        for backend in self.backends:
            backend.truncate_after(step)

    def _write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self, failed: bool = False) -> None:
        """Close the files and end the backends' runs (marked failed when `failed`)."""
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        for backend in self.backends:
            backend.close(failed)


def _open_backends(
    loggers: list[str], run_dir: Path, project: str, experiment: str, config: dict[str, Any]
) -> list[Backend]:
    """The chosen backends, started in order; when one fails, those already started are closed again."""
    backends: list[Backend] = []
    try:
        for name in (k for k in loggers if k in BACKENDS):
            backends.append(BACKENDS[name](run_dir, project, experiment, config))
    except BaseException:
        for backend in backends:
            backend.close(failed=True)
        raise
    return backends


def _truncate_jsonl(path: Path, step: int) -> None:
    """Rewrite `path` without the records whose `step` is after `step` (records without a step, events, stay), and
    without a last line cut short by a killed run (the next record would be appended to it)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if lines and not _parses(lines[-1]):
        lines.pop()
    kept = [line for line in lines if json.loads(line).get("step", -1) <= step or "event" in json.loads(line)]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


def info(message: str, bar=None) -> None:
    """Log at INFO without breaking a progress bar on the terminal."""
    if bar is not None:
        bar.clear()
    logger.info(message)
    if bar is not None:
        bar.refresh()


def _progress_bar(total: int):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="ketch", unit="step", dynamic_ncols=True, leave=False)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a `metrics.jsonl`, step records and events, in file order. A last line cut short by a
    crash mid-write is skipped."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        records += [json.loads(line) for line in lines[-1:]]
    except json.JSONDecodeError:
        logger.warning("%s: the last line is incomplete (the run stopped while writing it); skipped", path)
    return records


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a `metrics.jsonl` (events skipped)."""
    return [r for r in read_records(path) if "event" not in r]
