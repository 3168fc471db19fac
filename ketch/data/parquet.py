"""Read Parquet data files (local paths or fsspec URLs) into one column store, remembering where rows came from."""

from __future__ import annotations

import bisect
import os
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from ketch.cache import cache_dir
from ketch.data.errors import DatasetError

_PANDAS_INDEX_PREFIX = "__index_level_"


@dataclass
class Rows:
    """The rows of several files concatenated: `columns[name][row]`; a column absent from a file holds None there."""

    columns: dict[str, list[Any]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    """The first row of each file."""
    num_rows: int = 0

    def __len__(self) -> int:
        return self.num_rows

    def locate(self, row: int) -> str:
        """Where row `row` comes from, for error messages: `file, row N` (N counts from 0 in that file)."""
        f = bisect.bisect_right(self.starts, row) - 1
        return f"{self.files[f]}, row {row - self.starts[f]}"

    def append(self, file: str, table: pa.Table) -> None:
        before = len(self)
        self.files.append(file)
        self.starts.append(before)
        for name in table.column_names:
            if not name.startswith(_PANDAS_INDEX_PREFIX):
                self.columns.setdefault(name, [None] * before).extend(table.column(name).to_pylist())
        self.num_rows += table.num_rows
        for values in self.columns.values():
            values.extend([None] * (self.num_rows - len(values)))


def read_table(url: str, required: Mapping[str, str], columns: Collection[str] | None = None) -> pa.Table:
    """One Parquet file as a pyarrow Table: all its columns, or those in `columns`. A missing, unreadable or empty
    file, or one without a `required` column (see `read_parquet_files`), raises DatasetError."""
    try:
        with fsspec.open(url, "rb") as f:
            names = pq.ParquetFile(f).schema_arrow.names
            table = pq.read_table(f, columns=None if columns is None else [n for n in names if n in columns])
    except FileNotFoundError:
        raise DatasetError(f"data file not found: {url}; check data.train_files / data.val_files") from None
    except ImportError as e:
        raise DatasetError(f"cannot open {url}: {e} (install the fsspec backend for this URL scheme)") from None
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DatasetError(f"cannot read {url} as a Parquet file ({type(e).__name__}: {e})") from None
    if table.num_rows == 0:
        raise DatasetError(f"data file {url} has no rows; give a file with at least one row")
    for column, setting in required.items():
        if column not in names:
            raise DatasetError(
                f"data file {url} has no column {column!r} (data.{setting}); its columns are: "
                f"{', '.join(names)}; set data.{setting}=<one of them>"
            )
    return table


def expand_data_files(files: list[str]) -> list[str]:
    """`files` with each directory replaced by the `*.parquet` files in it and each glob pattern (`*`, `?`, `[`)
    by the files it matches, both sorted by name; a path that does not exist raises `DatasetError`."""
    expanded = []
    for entry in map(str, files):
        fs, path = fsspec.core.url_to_fs(entry)
        named = (lambda p: p) if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol
        if any(c in path for c in "*?["):
            found = [named(p) for p in sorted(fs.glob(path)) if not fs.isdir(p)]
            if not found:
                raise DatasetError(f"data file pattern {entry} matches no file; check data.train_files / val_files")
        elif fs.isdir(path):
            found = [named(p) for p in sorted(fs.glob(f"{path.rstrip('/')}/*.parquet"))]
            if not found:
                raise DatasetError(
                    f"data directory {entry} holds no *.parquet file; check data.train_files / val_files"
                )
        elif not fs.exists(path):
            raise DatasetError(f"data file not found: {entry}; check data.train_files / data.val_files")
        else:
            found = [entry]
        expanded += found
    return expanded


def read_parquet_files(files: list[str], required: Mapping[str, str], columns: Collection[str] | None = None) -> Rows:
    """Concatenate the rows of `files` in order (directories and glob patterns expanded by `expand_data_files`).

    `required` maps each column every file must have to the config field that names it (e.g.
    `{"question": "prompt_key"}`), so the error can say which setting to change. `columns`, when given, are the
    only columns read (a start-up check of large files reads one or two); the required ones are checked all the same.
    """
    if not files:
        raise DatasetError("no data files given; list Parquet files in data.train_files / data.val_files")
    rows = Rows()
    for url in expand_data_files(files):
        rows.append(url, read_table(url, required, columns))
    return rows


def write_rows_atomic(rows: list[dict[str, Any]], path: Path) -> None:
    """Write `rows` as Parquet to a temporary file next to `path`, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cached_splits(name: str, splits: tuple[str, ...], generate: Callable[[], dict[str, list[dict]]]) -> dict[str, Path]:
    """The Parquet files `<cache>/data/<name>/<split>.parquet` by split, written from `generate()` on first use."""
    out = cache_dir() / "data" / name
    paths = {split: out / f"{split}.parquet" for split in splits}
    if not all(path.exists() for path in paths.values()):
        out.mkdir(parents=True, exist_ok=True)
        for split, rows in generate().items():
            write_rows_atomic(rows, paths[split])
    return paths
