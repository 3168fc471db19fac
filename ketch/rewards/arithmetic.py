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
def score_arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the answer after the last `####` equals the integer `ground_truth` (e.g. "-7"), else 0.0."""
    answer = extract_answer(solution_str)
    return float(answer is not None and answer == int(str(ground_truth).strip()))
