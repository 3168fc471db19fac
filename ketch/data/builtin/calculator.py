"""The built-in tool task: multiplications such as `347*58=` that the tiny model cannot do in its head but
can with the `calculate` tool. Each row's `response` is a demonstration for the SFT warm-up, the conversation
after the prompt. In `train` and `val` it is the call format: the call, the tool's reply, and the answer (SFT
trains on the two assistant turns only; the tool's reply is the environment's, as in a rollout). `mixed` has
`train`'s problems, `call_share` of them with that demonstration and the rest answered directly (`#### <the
product>`, which the tiny model cannot compute, so its own direct answers are almost always wrong): a model
fine-tuned on it answers directly when greedy but calls in some samples, and RL can learn that calling pays.

`builtin:calculator/{train,mixed,val}` resolve to Parquet files generated once into the user cache.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ketch.data.parquet import cached_splits

BUILTIN_CALCULATOR_TASK = "builtin:calculator"
DATA_SOURCE = "ketch/calculator"
SPLITS = ("train", "mixed", "val")
CALL = '<tool_call>{{"name": "calculate", "arguments": {{"expression": "{}"}}}}</tool_call>'
"""The Hermes-format call of the `calculate` tool, as the demonstrations write it."""


@dataclass(frozen=True)
class CalculatorTask:
    """Products of a `min_digits`..`max_digits`-digit number and a 1..`max_digits`-digit one; `call_share` of
    the `mixed` split's rows demonstrate the call, the others answer directly."""

    min_digits: int = 2
    max_digits: int = 3
    num_train: int = 4000
    num_val: int = 128
    seed: int = 0
    call_share: float = 0.3

    def settings_hash(self) -> str:
        return hashlib.sha256(json.dumps({**asdict(self), "format": 3}, sort_keys=True).encode()).hexdigest()[:12]


def demonstration(a: int, b: int) -> list[dict[str, str]]:
    """The messages after the prompt `a*b=`: the model's call, the tool's reply, the model's answer."""
    return [
        {"role": "assistant", "content": CALL.format(f"{a}*{b}")},
        {"role": "tool", "name": "calculate", "content": str(a * b)},
        {"role": "assistant", "content": f"#### {a * b}"},
    ]


def direct_answer(a: int, b: int) -> list[dict[str, str]]:
    """The message after the prompt `a*b=` that answers without the tool."""
    return [{"role": "assistant", "content": f"#### {a * b}"}]


def generate_calculator_task(task: CalculatorTask) -> dict[str, list[dict[str, Any]]]:
    """Rows of each split (distinct problems across `train` and `val`; validation drawn first; `mixed` is
    `train`'s problems with a random `1 - call_share` of them answered directly)."""
    rng = random.Random(task.seed)
    seen: set[tuple[int, int]] = set()
    while len(seen) < task.num_val + task.num_train:
        digits = rng.randint(task.min_digits, task.max_digits)
        seen.add((rng.randint(10 ** (digits - 1), 10**digits - 1), rng.randint(2, 10 ** rng.randint(1, 2) - 1)))
    problems = sorted(seen, key=lambda _: rng.random())
    val, train = problems[: task.num_val], problems[task.num_val :]
    mixed = [_row(a, b, demonstration if rng.random() < task.call_share else direct_answer) for a, b in train]
    return {"val": [_row(a, b) for a, b in val], "train": [_row(a, b) for a, b in train], "mixed": mixed}


def _row(a: int, b: int, response: Callable[[int, int], list[dict[str, str]]] = demonstration) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": f"{a}*{b}="}],
        "response": response(a, b),
        "answer": str(a * b),
        "data_source": DATA_SOURCE,
    }


def builtin_calculator_files(task: CalculatorTask | None = None) -> dict[str, Path]:
    """The cached Parquet files of `task` by split, generated on first use."""
    task = task or CalculatorTask()
    return cached_splits(f"calculator-{task.settings_hash()}", SPLITS, lambda: generate_calculator_task(task))
