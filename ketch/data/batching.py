"""Compact storage of token sequences and the padding helpers the datasets' `collate` methods share."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from ketch.data.errors import DatasetError

logger = logging.getLogger("ketch.data")


class PackedSequences:
    """Token sequences of different lengths kept in one flat int64 array (compact for 100k rows)."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(self.offsets[-1]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        """Sequence `i` as a 1-D LongTensor `[length_i]`."""
        return torch.from_numpy(self.flat[self.offsets[i] : self.offsets[i + 1]].copy())


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id (logged), else DatasetError."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        logger.warning("the tokenizer has no pad token; padding with its EOS token (id %d)", tokenizer.eos_token_id)
        return tokenizer.eos_token_id
    raise DatasetError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token before loading data")


def pad(sequences: Sequence[torch.Tensor], value: int, side: Literal["left", "right"]) -> torch.Tensor:
    """Stack 1-D tensors into `[batch, longest]`, filling with `value` on the given side."""
    longest = max(len(s) for s in sequences)
    out = torch.full((len(sequences), longest), value, dtype=sequences[0].dtype)
    for row, seq in enumerate(sequences):
        if side == "left":
            out[row, longest - len(seq) :] = seq
        else:
            out[row, : len(seq)] = seq
    return out


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions `[batch, seq]` counting real tokens from 0: `clip(cumsum(mask) - 1, min=0)`."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens added (batch-encoded)."""
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
