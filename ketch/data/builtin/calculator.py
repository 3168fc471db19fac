"""The built-in tool task: multiplications such as `347*58=` that the tiny model cannot do in its head but
can with the `calculate` tool. Each row's `response` is a demonstration of the call format (for the SFT
warm-up), the conversation after the prompt: the call, the tool's reply, and the answer. SFT trains on the two
assistant turns only (the tool's reply is the environment's, as in a rollout).

`builtin:calculator/{train,val}` resolve to Parquet files generated once into the user cache.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ketch.data.parquet import cached_splits

BUILTIN_CALCULATOR_TASK = "builtin:calculator"
DATA_SOURCE = "ketch/calculator"
SPLITS = ("train", "val")
CALL = '<tool_call>{{"name": "calculate", "arguments": {{"expression": "{}"}}}}</tool_call>'
"""The Hermes-format call of the `calculate` tool, as the demonstrations write it."""


@dataclass(frozen=True)
class CalculatorTask:
    """Products of a `min_digits`..`max_digits`-digit number and a 1..`max_digits`-digit one."""

    min_digits: int = 2
    max_digits: int = 3
    num_train: int = 4000
    num_val: int = 128
    seed: int = 0

    def settings_hash(self) -> str:
        return hashlib.sha256(json.dumps({**asdict(self), "format": 3}, sort_keys=True).encode()).hexdigest()[:12]


def demonstration(a: int, b: int) -> list[dict[str, str]]:
    """The messages after the prompt `a*b=`: the model's call, the tool's reply, the model's answer."""
    return [
        {"role": "assistant", "content": CALL.format(f"{a}*{b}")},
        {"role": "tool", "name": "calculate", "content": str(a * b)},
        {"role": "assistant", "content": f"#### {a * b}"},
    ]


def generate_calculator_task(task: CalculatorTask) -> dict[str, list[dict[str, Any]]]:
    """Rows of each split (distinct problems across splits; validation drawn first)."""
    rng = random.Random(task.seed)
    seen: set[tuple[int, int]] = set()
    while len(seen) < task.num_val + task.num_train:
        digits = rng.randint(task.min_digits, task.max_digits)
        seen.add((rng.randint(10 ** (digits - 1), 10**digits - 1), rng.randint(2, 10 ** rng.randint(1, 2) - 1)))
    problems = sorted(seen, key=lambda _: rng.random())
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "response": demonstration(a, b),
            "answer": str(a * b),
            "data_source": DATA_SOURCE,
        }
        for a, b in problems
    ]
    return {"val": rows[: task.num_val], "train": rows[task.num_val :]}


def builtin_calculator_files(task: CalculatorTask | None = None) -> dict[str, Path]:
    """The cached Parquet files of `task` by split, generated on first use."""
    task = task or CalculatorTask()
    return cached_splits(f"calculator-{task.settings_hash()}", SPLITS, lambda: generate_calculator_task(task))
