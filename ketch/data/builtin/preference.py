"""The built-in preference task: arithmetic problems with the correct answer preferred over a wrong one.

`builtin:arithmetic-preference/{sft,train,val}` resolve to Parquet files generated once into the user cache
from the same problems as `builtin:arithmetic/{train,val}`, for the three steps of the RLHF recipe:

- `sft`: demonstrations of mixed quality, one per training problem (`prompt`, `response`, `answer`,
  `data_source`): a share `sloppy` gives the bare number (`105`), which the rule-based scorer scores 0,
  the rest the well-formed `#### 105`. A model fine-tuned on them answers in both styles;
- `train`, `val`: preference pairs, `pairs_per_problem` rows per problem: `prompt` (`47+58=`), `chosen`
  (`#### 105`), `rejected`, `kind`, `answer` and `data_source`.

The rejected response is of one of three kinds:

- `near_miss` (`#### 104`): an answer a few units off, the kind of mistake the warmed-up built-in model makes;
  telling it apart takes arithmetic;
- `far_miss` (`#### 163`): an answer far off, which a rough sense of magnitude tells apart;
- `format` (`105`, `####`, `#### 105 ####`, `8141781`): no well-formed answer, which the rule-based scorer
  scores 0 too; a reward model that has not seen these rates such text at random, and PPO exploits that.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ketch.data.builtin.arithmetic import SPLITS, ArithmeticTask, generate_arithmetic_task
from ketch.data.parquet import cached_splits

PREFERENCE_SPLITS = ("sft", *SPLITS)
"""The splits of `builtin:arithmetic-preference`: demonstrations, then training and validation pairs."""

_FORMAT_VERSION = 4  # bump when the rows written for the same settings change, to regenerate cached files


@dataclass(frozen=True)
class PreferenceTask:
    """Settings of the generated pairs; the problems are those of `task`."""

    task: ArithmeticTask = field(default_factory=ArithmeticTask)
    pairs_per_problem: int = 2
    near_miss: float = 0.2
    """Fraction of near misses: the right answer plus an offset in [-max_offset, max_offset] \\ {0}."""
    far_miss: float = 0.2
    """Fraction of far misses: the right answer plus an offset of max_offset + 1 to 10 * max_offset either way;
    the rest of the rejected responses are badly formatted."""
    max_offset: int = 12
    sloppy: float = 0.5
    """Share of the `sft` demonstrations that give the bare number, without the `####` marker."""
    seed: int = 0

    def __post_init__(self) -> None:
        shares_ok = min(self.near_miss, self.far_miss) >= 0 and self.near_miss + self.far_miss <= 1
        shares_ok = shares_ok and 0 <= self.sloppy <= 1
        if self.pairs_per_problem < 1 or self.max_offset < 1 or not shares_ok:
            raise ValueError(
                f"PreferenceTask needs pairs_per_problem >= 1, max_offset >= 1, near_miss, far_miss >= 0 with "
                f"near_miss + far_miss <= 1 and 0 <= sloppy <= 1; got {self.pairs_per_problem}, {self.max_offset}, "
                f"{self.near_miss}, {self.far_miss}, {self.sloppy}"
            )

    def settings_hash(self) -> str:
        """A short hash of the settings (and of the row format), naming the cache directory."""
        text = json.dumps({**asdict(self), "format": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def near_miss(rng: random.Random, answer: int, max_offset: int) -> int:
    """`answer` plus a non-zero offset of at most `max_offset` either way; offset d has weight 1/|d|, so
    answers one off are the most frequent, as in the built-in model's own mistakes."""
    offsets = [d for d in range(-max_offset, max_offset + 1) if d]
    return answer + rng.choices(offsets, weights=[1 / abs(d) for d in offsets])[0]


def rejected_response(rng: random.Random, answer: int, task: PreferenceTask) -> tuple[str, str]:
    """(rejected response, its kind) for a problem whose answer is `answer` (see the module docstring)."""
    draw = rng.random()
    if draw < task.near_miss:
        return f"#### {near_miss(rng, answer, task.max_offset)}", "near_miss"
    if draw < task.near_miss + task.far_miss:
        offset = rng.randint(task.max_offset + 1, 10 * task.max_offset)
        return f"#### {answer + rng.choice((-1, 1)) * offset}", "far_miss"
    noise = "".join(rng.choices("0123456789", k=rng.randint(4, 12)))
    return rng.choice((f"{answer}", "####", f"#### {answer} ####", noise)), "format"


def generate_preference_task(task: PreferenceTask) -> dict[str, list[dict[str, Any]]]:
    """Rows of each split, keyed `sft`, `train` and `val` (see the module docstring)."""
    rng = random.Random(task.seed)
    problems = generate_arithmetic_task(task.task)
    splits = {"sft": [demonstration(rng, problem, task.sloppy) for problem in problems["train"]]}
    for split in SPLITS:
        splits[split] = [
            preference_pair(rng, problem, task) for problem in problems[split] for _ in range(task.pairs_per_problem)
        ]
    return splits


def demonstration(rng: random.Random, problem: dict[str, Any], sloppy: float) -> dict[str, Any]:
    """An `sft` row: the answer as the bare number with probability `sloppy`, else after `####`."""
    response = problem["answer"] if rng.random() < sloppy else f"#### {problem['answer']}"
    return {k: problem[k] for k in ("prompt", "answer", "data_source")} | {"response": response}


def preference_pair(rng: random.Random, problem: dict[str, Any], task: PreferenceTask) -> dict[str, Any]:
    """A `train`/`val` row: the right answer after `####` over a rejected response (see `rejected_response`)."""
    answer = int(problem["answer"])
    rejected, kind = rejected_response(rng, answer, task)
    pair = {"prompt": problem["prompt"], "chosen": f"#### {answer}", "rejected": rejected, "kind": kind}
    return pair | {k: problem[k] for k in ("answer", "data_source")}


def builtin_preference_files(task: PreferenceTask) -> dict[str, Path]:
    """The cached Parquet files of `task` by split, generated on first use."""
    name = f"arithmetic-preference-{task.settings_hash()}"
    return cached_splits(name, PREFERENCE_SPLITS, lambda: generate_preference_task(task))
