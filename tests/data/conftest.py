"""Fixtures of the data tests: a private cache directory, the character tokenizer, a Parquet writer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ketch.data import build_char_tokenizer


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """KETCH_CACHE_DIR points into tmp_path, so the user's cache is never touched."""
    path = tmp_path / "cache"
    monkeypatch.setenv("KETCH_CACHE_DIR", str(path))
    return path


@pytest.fixture
def tokenizer() -> Any:
    return build_char_tokenizer()


@pytest.fixture
def write_rows(tmp_path: Path) -> Callable[..., str]:
    """write_rows(rows, name="data.parquet") writes a list of row dicts as Parquet and returns the path."""

    def write(rows: list[dict[str, Any]], name: str = "data.parquet") -> str:
        path = tmp_path / name
        pq.write_table(pa.Table.from_pylist(rows), path)
        return str(path)

    return write
