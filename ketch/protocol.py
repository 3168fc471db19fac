"""`DataProto`: the one container that flows between the driver and the workers.

A DataProto holds `batch` (a dict of tensors that share their first dimension), `non_tensor_batch` (a
dict of numpy object arrays of the same length: raw prompts, ground truth, data sources) and
`meta_info` (a plain dict of settings for the call, e.g. `temperature`). Rows are samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


class DataProtoError(ValueError):
    """Inconsistent or impossible DataProto operation: the message names the keys and sizes."""


def _object_array(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D numpy object array `[len(values)]` holding each value as one element (lists stay lists)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


@dataclass
class DataProto:
    """Rows of samples that travel together: tensors, per-sample Python values and the call's settings.

    Attributes:
        batch: Tensors that share their first dimension, the rows (e.g. `responses` `[batch, response_len]`).
        non_tensor_batch: 1-D numpy object arrays of the same length (raw prompts, ground truth, data sources);
            other sequences given here are converted.
        meta_info: Settings of the call that hold for every row (e.g. `temperature`).

    Raises:
        DataProtoError: If the entries of `batch` and `non_tensor_batch` differ in length.
    """

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensor_batch = {k: _object_array(v) for k, v in self.non_tensor_batch.items()}
        lengths = {f"batch[{k!r}]": v.shape[0] for k, v in self.batch.items()}
        lengths |= {f"non_tensor_batch[{k!r}]": len(v) for k, v in self.non_tensor_batch.items()}
        if len(set(lengths.values())) > 1:
            sizes = ", ".join(f"{k}: {n}" for k, n in lengths.items())
            raise DataProtoError(f"all entries of a DataProto must have the same length; got {sizes}")

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from separate dicts of tensors and of per-sample Python values.

        Args:
            tensors: The `batch` entries (None: none).
            non_tensors: The `non_tensor_batch` entries, each a sequence with one value per row.
            meta_info: The call's settings.

        Returns:
            A new DataProto (the dicts are copied, their values are not).
        """
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Build from one dict, sorting tensors into `batch` and everything else into `non_tensor_batch`.

        Args:
            data: Column name -> a tensor or a sequence with one value per row.
            meta_info: The call's settings.

        Returns:
            A new DataProto.
        """
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, others, meta_info)

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        for value in self.batch.values():
            return value.shape[0]
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    def __getitem__(self, index: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> Any:
        """Rows by position.

        Args:
            index: An int, a slice, an array of row indices or a boolean mask over the rows.

        Returns:
            For an int, that row as a dict of every key's value; otherwise a DataProto of the chosen rows (with a
            copy of `meta_info`).
        """
        if isinstance(index, int | np.integer):
            row: dict[str, Any] = {k: v[index] for k, v in self.batch.items()}
            return row | {k: v[index] for k, v in self.non_tensor_batch.items()}
        if isinstance(index, slice):
            return self._take(index, index)
        idx = torch.as_tensor(np.asarray(index))
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        return self._take(idx, idx.numpy())

    def _take(self, tensor_index: slice | torch.Tensor, array_index: Any) -> DataProto:
        """Rows by slice or by index. An index gathers with `index_select`: advanced indexing (`v[idx]`) on a
        CPU tensor splits even a few hundred rows over the intra-op threads and took milliseconds per tensor
        where those threads were busy, on the update's critical path."""
        if isinstance(tensor_index, slice):
            tensors = {k: v[tensor_index] for k, v in self.batch.items()}
        else:
            tensors = {k: v.index_select(0, tensor_index.to(v.device)) for k, v in self.batch.items()}
        return DataProto(
            tensors,
            {k: v[array_index] for k, v in self.non_tensor_batch.items()},
            dict(self.meta_info),
        )

    def keys(self) -> list[str]:
        """The names of the columns.

        Returns:
            The keys of `batch`, then those of `non_tensor_batch`.
        """
        return [*self.batch, *self.non_tensor_batch]

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """A new DataProto with only the named keys; the values are shared, not copied.

        Args:
            batch_keys: Keys of `batch` to keep (None: all).
            non_tensor_keys: Keys of `non_tensor_batch` to keep (None: all).
            meta_keys: Keys of `meta_info` to keep (None: all).

        Returns:
            The selection.

        Raises:
            DataProtoError: If a named key is missing.
        """
        return DataProto(
            _pick(self.batch, batch_keys, "batch"),
            _pick(self.non_tensor_batch, non_tensor_keys, "non_tensor_batch"),
            _pick(self.meta_info, meta_keys, "meta_info"),
        )

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_keys: Iterable[str] = (),
        meta_keys: Iterable[str] = (),
    ) -> DataProto:
        """Remove the named keys from this DataProto and return them as a new one.

        Args:
            batch_keys: Keys of `batch` to remove.
            non_tensor_keys: Keys of `non_tensor_batch` to remove.
            meta_keys: Keys of `meta_info` to remove.

        Returns:
            A DataProto holding the removed entries.

        Raises:
            DataProtoError: If a named key is missing (nothing is removed then).
        """
        popped = self.select(batch_keys, non_tensor_keys, meta_keys)
        for key in popped.batch:
            del self.batch[key]
        for key in popped.non_tensor_batch:
            del self.non_tensor_batch[key]
        for key in popped.meta_info:
            del self.meta_info[key]
        return popped

    # ----------------------------------------------------------------- combination
    def union(self, other: DataProto) -> DataProto:
        """Merge `other`'s keys into a new DataProto.

        Args:
            other: A DataProto of the same length (or an empty one).

        Returns:
            A DataProto with the keys of both.

        Raises:
            DataProtoError: If the lengths differ, or a key present in both holds different values.
        """
        if len(self) and len(other) and len(self) != len(other):
            raise DataProtoError(f"cannot union DataProtos of lengths {len(self)} and {len(other)}")
        for key in self.batch.keys() & other.batch.keys():
            if not torch.equal(self.batch[key], other.batch[key]):
                raise DataProtoError(f"union: batch[{key!r}] differs between the two DataProtos")
        for key in self.non_tensor_batch.keys() & other.non_tensor_batch.keys():
            if not np.array_equal(self.non_tensor_batch[key], other.non_tensor_batch[key]):
                raise DataProtoError(f"union: non_tensor_batch[{key!r}] differs between the two DataProtos")
        for key in self.meta_info.keys() & other.meta_info.keys():
            if self.meta_info[key] != other.meta_info[key]:
                raise DataProtoError(
                    f"union: meta_info[{key!r}] differs ({self.meta_info[key]!r} vs {other.meta_info[key]!r})"
                )
        return DataProto(
            self.batch | other.batch,
            self.non_tensor_batch | other.non_tensor_batch,
            self.meta_info | other.meta_info,
        )

    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Stack DataProtos with the same keys row-wise.

        Args:
            parts: The DataProtos, in row order.

        Returns:
            One DataProto of all their rows, with a copy of the first part's `meta_info`.

        Raises:
            DataProtoError: If `parts` is empty or the parts' keys differ.
        """
        if not parts:
            raise DataProtoError("concat needs at least one DataProto")
        keys = set(parts[0].keys())
        for i, part in enumerate(parts[1:], start=1):
            if set(part.keys()) != keys:
                raise DataProtoError(f"concat: part {i} has keys {sorted(part.keys())}, part 0 has {sorted(keys)}")
        return DataProto(
            {k: torch.cat([p.batch[k] for p in parts]) for k in parts[0].batch},
            {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch},
            dict(parts[0].meta_info),
        )

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into equal parts.

        Args:
            chunks: The number of parts; it must divide the length (pad first with `pad_to_divisor`).

        Returns:
            `chunks` DataProtos of consecutive rows.

        Raises:
            DataProtoError: If `chunks` is below 1 or does not divide the length.
        """
        if chunks < 1 or len(self) % chunks:
            raise DataProtoError(
                f"cannot chunk a DataProto of length {len(self)} into {chunks} equal parts; "
                f"pad it first with pad_to_divisor(data, {chunks})"
            )
        return self.split(len(self) // chunks) if len(self) else [self._take(slice(0, 0), slice(0, 0))] * chunks

    def split(self, size: int) -> list[DataProto]:
        """Split into consecutive parts of `size` rows.

        Args:
            size: Rows per part; the last part may be shorter.

        Returns:
            The parts, in order.

        Raises:
            DataProtoError: If `size` is below 1.
        """
        if size < 1:
            raise DataProtoError(f"split size must be >= 1, got {size}")
        return [self[start : start + size] for start in range(0, len(self), size)]

    def repeat(self, times: int, interleave: bool = True) -> DataProto:
        """Repeat every row.

        Args:
            times: How many copies of each row.
            interleave: True: a row's copies are adjacent (a a b b); False: the whole batch is tiled (a b a b).

        Returns:
            A DataProto `times` times as long.
        """
        order = np.arange(len(self))
        index = np.repeat(order, times) if interleave else np.tile(order, times)
        return self[index]

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Rows in a new order.

        Args:
            indices: A permutation of the row indices.

        Returns:
            A DataProto whose row i is row `indices[i]` of this one.
        """
        return self[indices]

    def to(self, device: str | torch.device) -> DataProto:
        """Move every tensor of `batch` to `device`, in place.

        Args:
            device: The target device.

        Returns:
            This DataProto.
        """
        self.batch = {k: v.to(device) for k, v in self.batch.items()}
        return self

    # ----------------------------------------------------------------- persistence
    def save_to_disk(self, path: str | Path) -> None:
        """Write this DataProto to a file with `torch.save`.

        Args:
            path: The file to write.
        """
        torch.save({"batch": self.batch, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}, path)

    @classmethod
    def load_from_disk(cls, path: str | Path) -> DataProto:
        """Read a DataProto written by `save_to_disk` (unpickled: only load files you trust).

        Args:
            path: The file to read.

        Returns:
            The DataProto.
        """
        data = torch.load(path, weights_only=False)
        return cls(data["batch"], data["non_tensor_batch"], data["meta_info"])

    def __getstate__(self) -> dict[str, Any]:
        # CPU tensors travel as numpy arrays, which pickle protocol 5 (and Ray) move without extra copies.
        batch = {
            k: v.numpy() if v.device.type == "cpu" and v.dtype != torch.bfloat16 else v for k, v in self.batch.items()
        }
        return {"batch": batch, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = {
            k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v for k, v in state["batch"].items()
        }
        self.non_tensor_batch, self.meta_info = state["non_tensor_batch"], state["meta_info"]

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.batch.items()}
        non_tensor, meta = list(self.non_tensor_batch), list(self.meta_info)
        return f"DataProto(len={len(self)}, batch={shapes}, non_tensor={non_tensor}, meta={meta})"


def _pick(store: dict, keys: Iterable[str] | None, where: str) -> dict:
    if keys is None:
        return dict(store)
    keys = list(keys)
    missing = [k for k in keys if k not in store]
    if missing:
        raise DataProtoError(f"{where} has no key(s) {missing}; it has {sorted(store)}")
    return {k: store[k] for k in keys}


def pad_to_divisor(data: DataProto, divisor: int) -> tuple[DataProto, int]:
    """Pad by repeating the first rows so that the length divides `divisor`; returns (padded, pad_size)."""
    pad = -len(data) % divisor
    if pad == 0:
        return data, 0
    if len(data) == 0:
        raise DataProtoError("cannot pad an empty DataProto")
    filler = data[np.arange(pad) % len(data)]
    return DataProto.concat([data, filler]), pad


def unpad(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_to_divisor`."""
    return data[: len(data) - pad_size] if pad_size else data
