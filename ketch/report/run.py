"""`RunRecord`: what a run directory holds (metrics, events, validation samples, config), read for the report."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ketch.tracking import read_records

WHOLE_TIMES = ("timing_s/step", "timing_s/testing", "timing_s/weight_sync")
"""Timings that are not stages of a step: the step itself, validation, and the weight sync inside update_actor."""


class ReportError(FileNotFoundError):
    """The directory given to the report is not a run directory (it has no `metrics.jsonl`)."""


@dataclass
class RunRecord:
    run_dir: Path
    steps: list[dict[str, Any]]
    """Step records, one per step (the last one written wins), by step."""
    events: list[dict[str, Any]]
    """`failure`, `checkpoint`, `resume`, `recovery`, `end`, ... in the order they happened."""
    samples: list[dict[str, Any]]
    """Rows of `samples.jsonl`: validation prompts, responses and scores, each with its step."""
    config: dict[str, Any]
    """`config.json` of the run, or {} when it is missing."""

    @classmethod
    def load(cls, run_dir: str | Path) -> RunRecord:
        run_dir = Path(run_dir)
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            raise ReportError(
                f"{run_dir} has no metrics.jsonl, so it is not a ketch run directory; give the directory of a run: "
                "trainer.default_local_dir/trainer.experiment_name (e.g. runs/arithmetic-grpo)"
            )
        records = read_records(path)
        by_step = {r["step"]: r for r in records if "event" not in r and "step" in r}
        samples_path = run_dir / "samples.jsonl"
        samples = read_records(samples_path) if samples_path.is_file() else []
        config_path = run_dir / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        events = [r for r in records if "event" in r]
        return cls(run_dir, [by_step[s] for s in sorted(by_step)], events, samples, config)

    def metric_names(self) -> list[str]:
        """Every metric name, in the order first seen."""
        return list(dict.fromkeys(k for record in self.steps for k in record if k != "step"))

    def stage_times(self) -> list[str]:
        """The `timing_s/<stage>` metrics of a step's stages, which add up to the step time."""
        return [k for k in self.metric_names() if k.startswith("timing_s/") and k not in WHOLE_TIMES]

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the steps that recorded `key` with a number (`"nan"`/`"inf"` strings included)."""
        pairs = [(r["step"], _number(r[key])) for r in self.steps if key in r]
        pairs = [(s, v) for s, v in pairs if v is not None]
        return np.array([s for s, _ in pairs], dtype=np.int64), np.array([v for _, v in pairs], dtype=np.float64)

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e["event"] == kind)

    @property
    def total_steps(self) -> int | None:
        """The planned number of steps (`trainer.total_steps`), when the config says."""
        return self.config.get("trainer", {}).get("total_steps")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if isinstance(value, int | float) or not math.isfinite(number) else None
