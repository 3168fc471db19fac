"""Scorers by data source: `register_scorer` adds one, `compute_score` dispatches to it.

A scorer is `score(data_source, solution_str, ground_truth, extra_info) -> float | dict`; a dict holds
`score` plus extra fields that are logged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Scorer = Callable[[str, str, Any, Any], "float | dict[str, Any]"]

_SCORERS: dict[str, Scorer] = {}


class UnknownDataSourceError(ValueError):
    """No scorer is registered for a data source."""


def register_scorer(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Decorator registering `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict` as the scorer
    of every name in `data_sources`.

    Args:
        *data_sources: The `data_source` values of the rows it scores.

    Returns:
        A decorator that registers `fn` and returns it unchanged.

    Raises:
        ValueError: If no data source is given, or (when the decorator is applied) one already has another scorer.
    """
    if not data_sources:
        raise ValueError("register_scorer needs at least one data source name, e.g. @register_scorer('my/task')")

    def decorate(fn: Scorer) -> Scorer:
        for source in data_sources:
            old = _SCORERS.get(source)
            if old is not None and _qualified_name(old) != _qualified_name(fn):
                raise ValueError(
                    f"data source {source!r} already has the scorer {_qualified_name(old)}; "
                    f"cannot register {_qualified_name(fn)} for it too"
                )
            _SCORERS[source] = fn
        return fn

    return decorate


def known_data_sources() -> list[str]:
    """The data sources that have a registered scorer.

    Returns:
        Their names, sorted.
    """
    return sorted(_SCORERS)


def scorer_for(data_source: str) -> Scorer:
    """The scorer registered for `data_source`; `UnknownDataSourceError` if there is none."""
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise UnknownDataSourceError(
            f"no reward scorer for data_source {data_source!r}; known data sources: "
            f"{', '.join(known_data_sources())}. Score other data with your own function: "
            "reward.function=path/to/file.py:fn, fn(data_source, solution_str, ground_truth, extra_info) -> float"
        )
    return scorer


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float | dict:
    """Score one decoded response with the scorer registered for `data_source`."""
    return scorer_for(data_source)(data_source, solution_str, ground_truth, extra_info)


def _qualified_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
