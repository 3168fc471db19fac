"""Split a per-device mini-batch into micro-batches: a fixed number of sequences, or a token budget."""

from __future__ import annotations

from ketch.protocol import DataProto


def split_micro_batches(
    data: DataProto, micro_batch_size: int | None, max_tokens: int | None = None
) -> list[DataProto]:
    """Consecutive micro-batches of `micro_batch_size` sequences, or, with `max_tokens`, as many sequences
    as fit in that many real tokens (attention_mask ones; a longer sequence gets a micro-batch alone).
    Order is kept, so concatenating the results' outputs restores the input order."""
    if max_tokens is None:
        return data.split(micro_batch_size or len(data))
    lengths = data.batch["attention_mask"].sum(-1).tolist()
    parts, start, used = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and used + length > max_tokens:
            parts.append(data[start:i])
            start, used = i, 0
        used += length
    parts.append(data[start:])
    return parts
