"""`SFTDataset`: prompt/response pairs for supervised fine-tuning, with a loss mask on the response.

Each sequence is prompt tokens + response tokens + EOS; the loss covers the response and the EOS.
A sequence longer than `max_prompt_length + max_response_length` is handled per `data.truncation`:
`left` drops tokens from the start (the prompt side, keeping the response whole where it fits),
`right` drops tokens from the end (the response's tail, then its EOS, is lost), `error` raises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ketch.config.schema import DataConfig
from ketch.data.batching import PackedSequences, encode, pad, pad_token_id, position_ids
from ketch.data.builtin.files import resolve_data_files
from ketch.data.errors import DatasetError
from ketch.data.parquet import Rows, read_parquet_files
from ketch.data.preparation import first_rows, prompt_texts, within_limit
from ketch.data.values import object_array


class SFTDataset(Dataset):
    """Prompt/response pairs of one split. Item `i` is a dict of 1-D tensors `[seq_len_i]` (unpadded):
    `input_ids`, `attention_mask` (ones), `loss_mask` (0 on the prompt, 1 on the response and EOS),
    and `index` (int: the row's position in the concatenated files).
    """

    def __init__(self, data_files: str | list[str], tokenizer: Any, config: DataConfig) -> None:
        if tokenizer.eos_token_id is None:
            raise DatasetError("SFTDataset ends every response with EOS, but the tokenizer has no EOS token")
        files = resolve_data_files([data_files] if isinstance(data_files, str) else list(data_files))
        self.pad_token_id = pad_token_id(tokenizer)
        required = {config.prompt_key: "prompt_key", config.response_key: "response_key"}
        rows = read_parquet_files(files, required=required)
        row_ids = first_rows(rows, config)
        prompts = encode(tokenizer, prompt_texts(rows, row_ids, tokenizer, config))
        responses = encode(tokenizer, _responses(rows, row_ids, config.response_key))
        sequences = [p + r + [tokenizer.eos_token_id] for p, r in zip(prompts, responses, strict=True)]
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        limit = config.max_prompt_length + config.max_response_length
        setting = "data.max_prompt_length + data.max_response_length"
        keep = within_limit(lengths, limit, setting, config, rows, row_ids, "sequence")
        self.num_filtered = int((~keep).sum())
        self.row_ids = row_ids[keep]
        kept = np.flatnonzero(keep)
        cut = [_truncate(sequences[k], len(prompts[k]), limit, config.truncation) for k in kept]
        self.input_ids = PackedSequences([sequence for sequence, _ in cut])
        self.prompt_lengths = np.array([prompt_length for _, prompt_length in cut], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = range(len(self))[i]
        input_ids = self.input_ids[i]
        loss_mask = (torch.arange(len(input_ids)) >= int(self.prompt_lengths[i])).long()
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "loss_mask": loss_mask,
            "index": int(self.row_ids[i]),
        }

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Right-pad to the batch's longest: `input_ids`, `attention_mask`, `position_ids`, `loss_mask`
        `[batch, seq_len]` (padding has mask 0 and loss 0), and `index` as a numpy object array `[batch]`.
        """
        attention_mask = pad([item["attention_mask"] for item in items], 0, "right")
        return {
            "input_ids": pad([item["input_ids"] for item in items], self.pad_token_id, "right"),
            "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask),
            "loss_mask": pad([item["loss_mask"] for item in items], 0, "right"),
            "index": object_array([item["index"] for item in items]),
        }


def _truncate(sequence: list[int], prompt_length: int, limit: int, side: str) -> tuple[list[int], int]:
    """`sequence` cut to `limit` tokens (`left`: drop from the start, else from the end) and its new prompt length."""
    excess = max(len(sequence) - limit, 0)
    if side == "left":
        return sequence[excess:], max(prompt_length - excess, 0)
    return sequence[: len(sequence) - excess], min(prompt_length, limit)


def _responses(rows: Rows, row_ids: np.ndarray, key: str) -> list[str]:
    """The response text of each row; a cell that is not a string names its file and row."""
    column = rows.columns[key]
    for row in row_ids:
        if not isinstance(column[row], str):
            raise DatasetError(
                f"{rows.locate(row)}, column {key!r} (data.response_key): the response must be a string, "
                f"got {type(column[row]).__name__}"
            )
    return [column[row] for row in row_ids]
