"""GSM8K scorer: the number after the last `####`, compared numerically (`#### $1,125` equals `1125`)."""

from __future__ import annotations

import math
import re
from typing import Any

from ketch.rewards.registry import register_scorer

_NUMBER = re.compile(r"\s*([-+]?)\s*\$?\s*([-+]?)((?:\d[\d,]*)?\.?\d+)")


def parse_number(text: str) -> float | None:
    """The number at the start of `text`, ignoring thousands separators and a leading `$`; None if none."""
    match = _NUMBER.match(text)
    if match is None:
        return None
    sign = -1.0 if "-" in match.group(1) + match.group(2) else 1.0
    return sign * float(match.group(3).replace(",", ""))


def extract_answer(solution_str: str) -> float | None:
    """The number right after the last `####` of `solution_str`, or None."""
    _, marker, tail = solution_str.rpartition("####")
    return parse_number(tail) if marker else None


@register_scorer("openai/gsm8k", "gsm8k")
def score_gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the response's `####` answer equals `ground_truth` (a number, or a solution ending in `#### n`)."""
    truth_text = str(ground_truth).rpartition("####")[2]
    truth = parse_number(truth_text)
    if truth is None:
        raise ValueError(f"gsm8k ground_truth {ground_truth!r} is not a number")
    answer = extract_answer(solution_str)
    return float(answer is not None and math.isclose(answer, truth, rel_tol=1e-9, abs_tol=1e-6))
