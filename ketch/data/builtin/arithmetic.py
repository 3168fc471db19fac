"""The built-in arithmetic task: addition and subtraction problems such as `347+58=` -> `#### 405`.

`builtin_task_files` generates the Parquet files of `builtin:arithmetic/{train,val}` once into the user cache.
"""

from __future__ import annotations

import hashlib
import json
import operator
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ketch.data.parquet import cached_splits, write_rows_atomic

DATA_SOURCE = "ketch/arithmetic"
SPLITS = ("train", "val")
MAX_PROMPT_CHARS = 16
_OPS = {"+": operator.add, "-": operator.sub}
_FORMAT_VERSION = 2  # bump when the rows written for the same settings change, to regenerate cached files


@dataclass(frozen=True)
class ArithmeticTask:
    """Settings of the generated problems; operands have `min_digits` to `max_digits` digits."""

    min_digits: int = 1
    max_digits: int = 2
    ops: tuple[str, ...] = ("+",)
    num_train: int = 4700
    num_val: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        longest = 2 * self.max_digits + 2
        if not 1 <= self.min_digits <= self.max_digits or longest > MAX_PROMPT_CHARS:
            raise ValueError(
                f"ArithmeticTask needs 1 <= min_digits <= max_digits <= {(MAX_PROMPT_CHARS - 2) // 2} "
                f"(prompts stay within {MAX_PROMPT_CHARS} characters); got min_digits={self.min_digits}, "
                f"max_digits={self.max_digits}"
            )
        unknown = [op for op in self.ops if op not in _OPS]
        if not self.ops or unknown or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ArithmeticTask.ops must be distinct operators from {sorted(_OPS)}; got {self.ops}")
        if self.num_train < 1 or self.num_val < 0:
            raise ValueError(
                f"ArithmeticTask needs num_train >= 1 and num_val >= 0; got {self.num_train}, {self.num_val}"
            )
        if self.num_val > self.num_problems // 2:
            raise ValueError(
                f"ArithmeticTask asks for {self.num_val} distinct validation problems but its settings allow "
                f"{self.num_problems}; ask for at most half of them or raise max_digits"
            )

    @property
    def num_problems(self) -> int:
        """How many distinct problems these settings can produce."""
        low = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        operands = 10**self.max_digits - low
        return len(self.ops) * operands * operands

    def settings_hash(self) -> str:
        """A short hash of the settings (and of the row format), naming the cache directory."""
        text = json.dumps({**asdict(self), "format": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _operand(rng: random.Random, task: ArithmeticTask) -> int:
    """A number whose digit count is uniform in [min_digits, max_digits]."""
    digits = rng.randint(task.min_digits, task.max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _problem(rng: random.Random, task: ArithmeticTask) -> tuple[int, str, int]:
    return _operand(rng, task), rng.choice(task.ops), _operand(rng, task)


def _row(problem: tuple[int, str, int], index: int, split: str) -> dict[str, Any]:
    left, op, right = problem
    answer = str(_OPS[op](left, right))
    return {
        "prompt": f"{left}{op}{right}=",
        "response": f"#### {answer}",
        "answer": answer,
        "data_source": DATA_SOURCE,
        "extra_info": {"index": index, "split": split},
    }


def generate_arithmetic_task(task: ArithmeticTask) -> dict[str, list[dict[str, Any]]]:
    """Rows of each split, keyed `train` and `val`, both drawn from the same distribution of problems.

    Validation problems are drawn first and are distinct, so the validation split does not change with num_train.
    Training problems are then drawn from the same distribution, leaving out the validation ones; they may repeat.
    Drawing them distinct as well would use up the shapes with few problems (there are only 100 sums of two
    one-digit numbers) and train on another mix of shapes than the one validated: with the defaults, 1% of the
    training problems against 19% of the validation problems would be one-digit sums.
    """
    rng = random.Random(task.seed)
    val: dict[tuple[int, str, int], None] = {}  # distinct, in the order drawn
    while len(val) < task.num_val:
        val.setdefault(_problem(rng, task))
    train: list[tuple[int, str, int]] = []
    while len(train) < task.num_train:
        problem = _problem(rng, task)
        if problem not in val:
            train.append(problem)
    return {
        "train": [_row(p, i, "train") for i, p in enumerate(train)],
        "val": [_row(p, i, "val") for i, p in enumerate(val)],
    }


def write_arithmetic_task(out_dir: str | Path, task: ArithmeticTask) -> dict[str, Path]:
    """Generate the task and write `train.parquet` and `val.parquet` into `out_dir`; returns the paths by split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in generate_arithmetic_task(task).items():
        paths[split] = out / f"{split}.parquet"
        write_rows_atomic(rows, paths[split])
    return paths


def builtin_task_files(task: ArithmeticTask) -> dict[str, Path]:
    """The cached Parquet files of `task` by split, generated on first use."""
    return cached_splits(f"arithmetic-{task.settings_hash()}", SPLITS, lambda: generate_arithmetic_task(task))
