"""Spread sequences over data-parallel ranks so that each rank gets about the same number of real tokens."""

from __future__ import annotations

import heapq

import torch

from ketch.protocol import DataProto


def balanced_order(lengths: list[int], parts: int) -> list[int]:
    """A permutation of row indices whose `parts` consecutive chunks (the first `len % parts` one row longer,
    as data-parallel dispatch cuts them) hold nearly equal sums of `lengths`: longest rows first, each to the
    chunk with the fewest tokens that still has room."""
    rows = len(lengths)
    room = [rows // parts + (p < rows % parts) for p in range(parts)]
    chunks: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, p) for p in range(parts) if room[p]]
    for i in sorted(range(rows), key=lambda i: -lengths[i]):
        tokens, p = heapq.heappop(heap)
        chunks[p].append(i)
        if len(chunks[p]) < room[p]:
            heapq.heappush(heap, (tokens + lengths[i], p))
    return [i for chunk in chunks for i in chunk]


def balance_tokens(batch: DataProto, parts: int) -> DataProto:
    """`batch` reordered by `balanced_order` of its real tokens (`attention_mask` sums) over `parts` ranks."""
    if parts <= 1:
        return batch
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    return batch.reorder(torch.tensor(balanced_order(lengths, parts)))
