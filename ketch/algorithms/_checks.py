"""Checks shared by the algorithm modules: required batch keys, matching shapes, lists of bad rows."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def require(tensors: Mapping[str, torch.Tensor], key: str, who: str, hint: str) -> torch.Tensor:
    """`tensors[key]`, or a ValueError saying who needs it, what it is (`hint`) and which keys there are."""
    if key not in tensors:
        raise ValueError(f"{who} needs batch.batch[{key!r}] ({hint}); the batch has {sorted(tensors)}")
    return tensors[key]


def check_same_shape(who: str, **tensors: torch.Tensor | None) -> None:
    """Raise unless every given (non-None) tensor is 2-D `[batch, response_len]` and all shapes agree."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1 or any(len(shape) != 2 for shape in shapes.values()):
        listing = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{who}: got {listing}; all must be [batch, response_len] tensors of one shape")


def format_rows(bad_rows: torch.Tensor, limit: int = 8) -> str:
    """The indices where the `[batch]` bool tensor `bad_rows` is True, at most `limit` of them, as text."""
    rows = bad_rows.nonzero().flatten().tolist()
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"{rows[:limit]}{more}"
