"""The static decoder's per-shape state (`DecodeBuffers`): the paged KV cache of one (rows, length) shape and the
decode step's inputs and outputs, at fixed addresses that a CUDA graph of the step replays on."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ketch.architecture import AttentionShape
from ketch.rollout.kv_pages import KVPages

ROW_BUFFERS = ("tokens", "positions", "mask", "responses", "log_probs", "done")
"""The per-row decode state of `DecodeBuffers` besides the KV cache: its first dimension is the row."""


class DecodeBuffers:
    """The KV cache and the decode step's state for one (rows, length) shape, at fixed addresses (a CUDA graph
    of the step replays on them): `tokens` and `positions` `[rows, 1]` (the next step's input token and its
    position), `slot` `[1]` (that token's cache slot), `mask` `[rows, length]` (True: a filled slot; `mask4d` is
    the same memory as `[rows, 1, 1, length]`), the paged keys and values of every block and the page table
    `table` `[rows, length / PAGE]` (`pages`, a `KVPages`), and what decoding has produced: `responses` `[rows,
    length]` (each sampled token at its cache slot, the pad token after a row's stop token), `log_probs` `[rows,
    length]` (float32) and `done` `[rows]`; `seed` `[1]` keys the sampling kernel's noise (drawn at `start`, one
    more per token)."""

    def __init__(
        self,
        attentions: list[nn.Module],
        shape: AttentionShape,
        rows: int,
        length: int,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ):
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.mask4d = self.mask[:, None, None, :]
        self.pages = KVPages(attentions, shape, rows, length, device, kv_dtype)
        self.table = self.pages.table
        self.responses = torch.zeros(rows, length, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(rows, length, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.fronts: dict[int, DecodeBuffers] = {}
        self.root = self

    def front(self, rows: int) -> DecodeBuffers:
        """The first `rows` rows of these buffers as buffers of their own: views of the same memory, the same pages,
        `slot` and `seed`, CUDA graphs of their own (kept here, for the next batch that compacts into them)."""
        if rows not in self.fronts:
            view = copy.copy(self)
            for name in ROW_BUFFERS:
                setattr(view, name, getattr(self, name)[:rows])
            view.mask4d, view.table = view.mask[:, None, None, :], self.table[:rows]
            view.graphs, view.fronts = {}, {}
            self.fronts[rows] = view
        return self.fronts[rows]

    def move_rows(self, rows: torch.Tensor, into: DecodeBuffers) -> None:
        """Copy rows `rows` `[n]` of every per-row buffer into `into` (a front of the same memory), in order (the
        page table's rows move on the host: `KVPages.move`)."""
        for name in ROW_BUFFERS:
            getattr(into, name).copy_(getattr(self, name).index_select(0, rows))  # source and target share memory

    def provide(self, unfinished: list[int], slots: int) -> None:
        """Pages for the first `slots` slots to rows `unfinished`, back from the other rows (`KVPages.assign`); a
        pool that grew drops the CUDA graphs of every front (they read the old one)."""
        if self.pages.assign(unfinished, len(self.done), slots):
            self.root.clear_graphs()
            self.use()

    def clear_graphs(self) -> None:
        """Drop the CUDA graphs of these buffers and of their fronts (captured on weights or pools that have
        moved), and capture the next ones into a new memory pool: the old one may still hold a graph's outputs,
        and torch refuses to capture into a pool whose graphs are gone."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle() if self.pool is not None else None
        for view in self.fronts.values():
            view.graphs.clear()
            view.pool = self.pool

    def use(self, rows: slice = slice(None)) -> None:
        """Point each block's attention module at its pools of keys and values here and at the page table's
        `rows` (a forward of those rows only: a group of the prefill)."""
        for attention, (keys, values) in zip(self.pages.attentions, self.pages.pools, strict=True):
            attention.decode_kv = (keys, values, self.table[rows])

    def start(
        self, attention_mask: torch.Tensor, positions: torch.Tensor, active_rows: int, pad_token_id: int, slots: int
    ):
        """Set up for left-padded prompts `[rows, prompt_len]` whose last positions are `positions` `[rows, 1]`: the
        prompt's slots filled, the first `slots` slots paged from each row's first real token on (up to the
        decoder's first check), nothing decoded, rows from `active_rows` on finished from the start."""
        prompt_len = attention_mask.shape[1]
        self.pages.begin(attention_mask.int().argmax(-1))
        self.provide(list(range(active_rows)), slots)
        self.mask.zero_()
        self.mask[:, :prompt_len] = attention_mask.bool()
        self.positions.copy_(positions + 1)
        self.slot.fill_(prompt_len - 1)
        self.responses.fill_(pad_token_id)
        self.log_probs.zero_()
        self.done.zero_()
        self.done[active_rows:] = True
        if self.seed.is_cuda:  # keys the sampling kernel's noise; on the CPU, sampling draws from torch's generator
            self.seed.random_(2**62)
