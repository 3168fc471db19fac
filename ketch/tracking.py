"""Where metrics go: `metrics.jsonl` in the run directory (always) and a readable console line.

Each step appends one JSON object `{"step": N, "<metric>": value, ...}`; events (recoveries, the end of a
run) are lines with an `"event"` field. The console shows a progress bar on a terminal and one summary
line every `trainer.log_interval` steps.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

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
    """Appends every metric to `run_dir/metrics.jsonl` and prints the console line every `log_interval`."""

    def __init__(self, run_dir: Path, loggers: list[str], total_steps: int, log_interval: int = 1):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115  (kept open for the run)
        self.console = "console" in loggers
        self.log_interval = log_interval
        self.bar = _progress_bar(total_steps) if self.console else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._write({"step": step, **{k: _plain(v) for k, v in metrics.items()}})
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if self.console and step % self.log_interval == 0 and any(k.startswith("timing_s/") for k in metrics):
            info(format_step_line(step, metrics), self.bar)

    def event(self, kind: str, **fields: Any) -> None:
        """Record a non-step event (e.g. a recovery) with a wall-clock timestamp."""
        self._write({"event": kind, "time": time.time(), **fields})

    def truncate_after(self, step: int) -> None:
        """Drop the step records after `step` (events stay): a resumed run rewrites the steps it repeats, so
        the file has each step once."""
        self.jsonl.close()
        path = self.run_dir / "metrics.jsonl"
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line).get("step", -1) <= step or "event" in json.loads(line)]
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
        self.jsonl = open(path, "a")  # noqa: SIM115  (kept open for the run)

    def _write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()


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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a `metrics.jsonl` (events skipped)."""
    with open(path) as f:
        return [r for line in f if line.strip() and "event" not in (r := json.loads(line))]
