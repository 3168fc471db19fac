"""The static decoder's KV cache in pages: a row holds the slots it has filled, not the longest response.

Rows decode in lockstep (at each step every row writes the same cache slot), so a row needs pages up to the current
slot only, from the page of its first real token (the pages of its left padding are the scratch page, never
read), and a finished row needs none. Per block, keys and values live in a pool `[pages, kv_heads, PAGE, head_dim]`;
`table` `[rows, length / PAGE]` (int64, at a fixed address that CUDA graphs and the Triton kernel read)
maps each row's n-th page of slots to its page in the pool. Page 0 is scratch: rows that have finished, and the rows
that pad a batch, write there and read nothing of use. The host hands pages out at the decoder's checks
(`KVPages.assign`: pages for the slots up to the next check), takes back the pages of finished rows, and moves
rows by their table rows when the decoder compacts (`KVPages.move`). A pool starts with room for
`POOL_SLOTS_PER_ROW` slots per row (or the whole length, if less) and grows when the rows' pages outgrow it,
doubling, one block at a time (so that growing costs one block's old keys and values beyond the new size); it
keeps its size for later batches.
"""

from __future__ import annotations

import torch
from torch import nn

from ketch.architecture import AttentionShape
from ketch.models.pages import as_pool

PAGE = 128
"""Cache slots per page (a multiple of the decode kernel's blocks of slots)."""
POOL_SLOTS_PER_ROW = 4096
"""Slots per row that a new pool holds before it grows: a batch of responses up to this long never grows it."""
FP8_MAX = 448.0
"""The largest float8 e4m3 value: an FP8 cache (`rollout.kv_cache_dtype=fp8`) holds keys and values clamped to it,
with no scale (as vLLM's default scale of 1)."""


class KVPages:
    """The pools of one (rows, length) shape's KV cache, its page table and the host's record of it: `host`
    `[rows, length / PAGE]` (the table as last sent), `first` `[rows]` (the page of each row's first real token),
    `held` `[rows]` (pages each row holds: its table row's entries from `first` on), the free pages, and
    `most_held`, the most pages the rows have held at once."""

    def __init__(
        self,
        attentions: list[nn.Module],
        shape: AttentionShape,
        rows: int,
        length: int,
        device: torch.device,
        dtype: torch.dtype | None = None,
    ):
        """Pools for `rows` rows of `length` slots of each of `attentions`' layers, in `dtype` (default: the
        layers' weights'; `torch.float8_e4m3fn` halves a bf16 cache, `write` rounds into it)."""
        self.per_row = -(-length // PAGE)
        self.table = torch.zeros(rows, self.per_row, dtype=torch.long, device=device)
        self.host = torch.zeros(rows, self.per_row, dtype=torch.long)
        self.held = torch.zeros(rows, dtype=torch.long)
        self.first = torch.zeros(rows, dtype=torch.long)
        pages = 1 + rows * min(self.per_row, POOL_SLOTS_PER_ROW // PAGE)
        dtype = dtype or next(attentions[0].parameters()).dtype
        size = (pages, shape.kv_heads, PAGE, shape.head_dim)
        self.pools = [tuple(torch.zeros(size, dtype=dtype, device=device) for _ in range(2)) for _ in attentions]
        self.free = list(range(pages - 1, 0, -1))
        self.attentions = attentions
        self.most_held = 0

    @property
    def pages(self) -> int:
        """Pages in each pool, the scratch page included."""
        return self.pools[0][0].shape[0]

    def begin(self, first_slots: torch.Tensor) -> None:
        """A new batch whose first `len(first_slots)` rows' real tokens begin at slots `first_slots` `[rows]`: every
        row gives its pages back, and those rows' pages will begin at the page of that slot (`assign` hands them
        out)."""
        self._give_back(self.held.nonzero().flatten().tolist())
        self.first.zero_()
        self.first[: len(first_slots)] = first_slots.cpu() // PAGE
        self.table.copy_(self.host)

    def _give_back(self, rows: list[int]) -> None:
        for row in rows:
            first = int(self.first[row])
            self.free += self.host[row, first : first + self.held[row]].tolist()
            self.host[row], self.held[row] = 0, 0

    def assign(self, unfinished: list[int], rows: int, slots: int) -> bool:
        """Of the first `rows` rows, rows `unfinished` get pages for their first `slots` slots, and every other row
        gives its pages back and writes into the scratch page from now on; a changed table goes to the device (call
        it with the device idle: pages given back go to other rows at once). True when the pool grew: it moved, and
        what captured it must capture again."""
        others = torch.ones(rows, dtype=torch.bool)
        others[unfinished] = False
        finished = (others & (self.held[:rows] > 0)).nonzero().flatten().tolist()
        self._give_back(finished)
        need = min(-(-slots // PAGE), self.per_row)
        wanted = (need - self.first[unfinished] - self.held[unfinished]).clamp(min=0)
        short = int(wanted.sum()) - len(self.free)
        if short > 0:
            self._grow(short)
        for i in wanted.nonzero().flatten().tolist():
            row = unfinished[i]
            end = int(self.first[row] + self.held[row])
            for n in range(end, end + int(wanted[i])):
                self.host[row, n] = self.free.pop()
            self.held[row] += int(wanted[i])
        if finished or wanted.any():
            self.most_held = max(self.most_held, int(self.held.sum()))
            self.table.copy_(self.host)
        return short > 0

    def move(self, order: list[int], rows: int) -> None:
        """Compaction: rows `order` of the first `rows` (each holding pages or none: `assign` gave back the others)
        become the first `len(order)` rows, in that order; the rest of the first `rows` write into the scratch page."""
        kept = len(order)
        self.host[:kept], self.held[:kept], self.first[:kept] = self.host[order], self.held[order], self.first[order]
        self.host[kept:rows], self.held[kept:rows], self.first[kept:rows] = 0, 0, 0
        self.table.copy_(self.host)

    def _grow(self, short: int) -> None:
        """At least `short` more pages: the pools double (up to every row's whole length), one block at a time,
        the attention modules' references to the old pools dropped first."""
        old = self.pages
        new = min(max(old + short, 2 * old), 1 + len(self.held) * self.per_row)
        for attention in self.attentions:
            attention.decode_kv = None
        for i, pair in enumerate(self.pools):
            self.pools[i] = tuple(torch.cat([t, t.new_zeros(new - old, *t.shape[1:])]) for t in pair)
        self.free = list(range(new - 1, old - 1, -1)) + self.free


def slot_places(table: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where cache slots `slots` `[n]` of each row sit under `table` `[rows, length / PAGE]`: their pool pages
    `[rows, n]` and places in them `[n]` (what `write` writes at; the same for every block of a step)."""
    return table[:, slots // PAGE], slots % PAGE


def write(pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Write `new` `[rows, kv_heads, n, head_dim]` into cache slots `slots` `[n]` of each row's pages in `pool`
    `[pages, kv_heads, PAGE, head_dim]` under `table` `[rows, length / PAGE]` (`write_at` of `slot_places`)."""
    write_at(pool, slot_places(table, slots), new)


def write_at(pool: torch.Tensor, places: tuple[torch.Tensor, torch.Tensor], new: torch.Tensor) -> None:
    """Write `new` `[rows, kv_heads, n, head_dim]` at `places` (`slot_places`) of `pool`; into an FP8 pool rounded,
    clamped to its largest value (beyond it a float8 e4m3 cast gives NaN)."""
    if pool.dtype == torch.float8_e4m3fn:
        new = new.clamp(-FP8_MAX, FP8_MAX).to(pool.dtype)
    pool[places[0], :, places[1]] = new.transpose(1, 2)


def gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Each row's first `length` cache slots `[rows, kv_heads, length, head_dim]` out of `pool` (a copy)."""
    rows, per_row = table.shape
    _, kv_heads, page, head_dim = pool.shape
    pages = pool[table].transpose(1, 2)  # [rows, kv_heads, per_row, page, head_dim]
    return pages.reshape(rows, kv_heads, per_row * page, head_dim)[:, :, :length]


def as_pages(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous cache `[rows, kv_heads, length, head_dim]` as a pool and a page table (row r's pages after those
    of the rows before it, after the scratch page, in reverse order to keep the table honest): for the kernel's
    tests and benchmark."""
    pages, table = as_pool(cache, PAGE)
    pool = torch.cat([pages.new_zeros(1, *pages.shape[1:]), pages.flip(0)])
    return pool.contiguous(), table.numel() - table
