"""`@register`: marks a worker method as callable on a whole WorkerGroup, with its dispatch mode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ketch.controller.dispatch import ONE_TO_ALL, DispatchMode

ATTR = "__ketch_register__"


@dataclass(frozen=True)
class Registration:
    dispatch: DispatchMode
    execute: str
    """`all`: every rank runs it; `rank_zero`: only rank 0 runs it."""


def register(dispatch: DispatchMode = ONE_TO_ALL, execute: str = "all") -> Callable:
    """Decorator exposing a worker method as a method of its worker group.

    Args:
        dispatch: How the group splits the call's arguments over ranks and gathers the results (`ONE_TO_ALL`:
            every rank gets the same arguments, the results come back as a list by rank).
        execute: `all`: every rank runs it; `rank_zero`: only rank 0 runs it.

    Returns:
        A decorator that marks the method and returns it unchanged.

    Raises:
        ValueError: If `execute` is neither `all` nor `rank_zero`.
    """
    if execute not in ("all", "rank_zero"):
        raise ValueError(f"execute must be 'all' or 'rank_zero', got {execute!r}")

    def wrap(method: Callable) -> Callable:
        setattr(method, ATTR, Registration(dispatch, execute))
        return method

    return wrap


def registered_methods(cls: type) -> dict[str, Registration]:
    """Every `@register`-ed method of a worker class, by name."""
    return {
        name: getattr(member, ATTR)
        for name in dir(cls)
        if callable(member := getattr(cls, name, None)) and hasattr(member, ATTR)
    }
