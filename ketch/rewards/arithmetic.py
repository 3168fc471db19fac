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
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    digit_credit: float = 0.0,
    call_credit: float = 0.0,
) -> float | dict[str, float]:
    """1.0 when the answer after the last `####` equals the integer `ground_truth` (e.g. "-7"), else 0.0.

    Partial credit for a wrong answer (`reward.scorer_kwargs`; together under 1.0): `digit_credit` times the
    fraction of its places, aligned from the units, that match the true answer's (`digit_match`), plus
    `call_credit` when the trajectory called a tool and every call ran (`clean_calls`). With either, the result
    is a dict: `score` (that training reward) and `acc` (exact match; validation reports it as accuracy)."""
    if min(digit_credit, call_credit) < 0.0 or digit_credit + call_credit >= 1.0:
        raise ValueError(
            f"digit_credit={digit_credit} and call_credit={call_credit} must be >= 0 and sum to less than 1: a "
            "wrong answer must score below a right one"
        )
    answer, truth = extract_answer(solution_str), int(str(ground_truth).strip())
    exact = float(answer is not None and answer == truth)
    if not (digit_credit or call_credit):
        return exact
    partial = 0.0 if answer is None else digit_credit * digit_match(answer, truth)
    partial += call_credit * clean_calls(extra_info)
    return {"score": max(exact, partial), "acc": exact}


def clean_calls(extra_info: Any) -> bool:
    """Whether a multi-turn trajectory called a tool and no call failed (`extra_info`'s `tool_calls` and
    `tool_errors`, which the scorer adds for multi-turn rollouts); False for a single-turn response."""
    info = extra_info if isinstance(extra_info, dict) else {}
    return info.get("tool_calls", 0) > 0 and info.get("tool_errors", 0) == 0


def digit_match(answer: int, truth: int) -> float:
    """The fraction of places, aligned from the units over the longer of the two numbers, where `answer` and
    `truth` have the same character (digit or sign): 132 against 131 is 2/3, 32 against 132 is 2/3."""
    a, t = str(answer), str(truth)
    width = max(len(a), len(t))
    a, t = a.rjust(width), t.rjust(width)
    return sum(x == y for x, y in zip(a, t, strict=True)) / width
