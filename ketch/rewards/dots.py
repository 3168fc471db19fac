"""Scorer of the built-in visual task (`builtin:dots`): the response is the count of red dots, e.g. `3`."""

from __future__ import annotations

from typing import Any

from ketch.rewards.registry import register_scorer


@register_scorer("ketch/dots")
def score_dots(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the response, stripped of surrounding whitespace, is exactly the count `ground_truth` (e.g. "3"),
    else 0.0 (`3 dots`, `03` and an empty response score 0)."""
    return float(solution_str.strip() == str(ground_truth).strip())
