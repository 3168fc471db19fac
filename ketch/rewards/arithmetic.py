"""Scorer of the built-in arithmetic task: responses end in `#### <integer>`."""

from __future__ import annotations

from typing import Any

from ketch.rewards.registry import register_scorer


def extract_answer(solution_str: str) -> int | None:
    """The integer right after the last `####`, or None when there is none."""
    _, marker, tail = solution_str.rpartition("####")
    words = tail.split()
    if not marker or not words:
        return None
    try:
        return int(words[0].rstrip("."))
    except ValueError:
        return None


@register_scorer("ketch/arithmetic", "ketch/calculator")
def score_arithmetic(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, digit_credit: float = 0.0
) -> float | dict[str, float]:
    """1.0 when the answer after the last `####` equals the integer `ground_truth` (e.g. "-7"), else 0.0.

    With `digit_credit` > 0 (`reward.scorer_kwargs`), a wrong answer earns `digit_credit` times the fraction of
    its places, aligned from the units, that match the true answer's (`digit_match`), and the result is a dict:
    `score` (that training reward) and `acc` (exact match, 1.0 or 0.0; validation reports it as accuracy)."""
    if not 0.0 <= digit_credit < 1.0:
        raise ValueError(f"digit_credit={digit_credit} must be in [0, 1): a wrong answer must score below a right one")
    answer, truth = extract_answer(solution_str), int(str(ground_truth).strip())
    exact = float(answer is not None and answer == truth)
    if not digit_credit:
        return exact
    partial = 0.0 if answer is None else digit_credit * digit_match(answer, truth)
    return {"score": max(exact, partial), "acc": exact}


def digit_match(answer: int, truth: int) -> float:
    """The fraction of places, aligned from the units over the longer of the two numbers, where `answer` and
    `truth` have the same character (digit or sign): 132 against 131 is 2/3, 32 against 132 is 2/3."""
    a, t = str(answer), str(truth)
    width = max(len(a), len(t))
    a, t = a.rjust(width), t.rjust(width)
    return sum(x == y for x, y in zip(a, t, strict=True)) / width
