"""Conversions between numpy/pyarrow cell values and plain Python."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def to_python(value: Any) -> Any:
    """`value` with numpy arrays turned into lists and numpy scalars into Python scalars, recursively."""
    if isinstance(value, np.ndarray):
        return to_python(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_python(v) for v in value]
    return value


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D numpy object array `[len(values)]` holding each value as one element (lists stay lists)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out
