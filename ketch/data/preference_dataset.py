"""`PreferenceDataset`: prompt / chosen / rejected pairs for reward-model training (`ketch rm`).

A response cell is a string, appended to the prompt (column `data.prompt_key`), or a chat message list
holding the whole conversation: its last message is the assistant's reply and the earlier ones are the
prompt. Either way a sequence is the prompt text (a chat prompt rendered with the chat template and the
generation prompt) + the reply + EOS: what the policy produces in PPO, where the reward model scores it.

Pairs whose chosen equals rejected, or with an empty (or null) response, are counted, skipped and logged
once; a malformed cell (wrong type, bad messages) stops with the file, row and column.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ketch.config.schema import DataConfig
from ketch.data.batching import PackedSequences, encode, pad, pad_token_id
from ketch.data.builtin.files import resolve_data_files
from ketch.data.chat_templates import format_prompt, get_chat_template, to_messages
from ketch.data.errors import DatasetError
from ketch.data.parquet import Rows, read_parquet_files
from ketch.data.preparation import first_rows, within_limit
from ketch.protocol import object_array

logger = logging.getLogger("ketch.data")

PromptCell = str | list[dict[str, str]]


class PreferenceDataset(Dataset):
    """Preference pairs of one split. Item `i` is a dict: `chosen_input_ids` `[len_c]` and `rejected_input_ids`
    `[len_r]` (1-D LongTensors, unpadded) and `index` (the row's position in the concatenated files).
    `num_skipped` counts the pairs left out, by reason."""

    def __init__(self, data_files: str | list[str], tokenizer: Any, config: DataConfig) -> None:
        if tokenizer.eos_token_id is None:
            raise DatasetError("PreferenceDataset ends every response with EOS, but the tokenizer has no EOS token")
        if config.chat_template:
            try:
                get_chat_template(config.chat_template)
            except ValueError as e:
                raise DatasetError(f"data.chat_template: {e}") from None
        files = resolve_data_files([data_files] if isinstance(data_files, str) else list(data_files))
        self.pad_token_id = pad_token_id(tokenizer)
        rows = read_parquet_files(files, self.required_columns(config))
        pairs = {int(row): _pair(rows, int(row), config) for row in first_rows(rows, config)}
        self.num_skipped = _skip_bad_pairs(pairs, rows)
        row_ids = np.array(sorted(pairs), dtype=np.int64)
        chosen = _encode(tokenizer, rows, [pairs[r][0] for r in row_ids], row_ids, config)
        rejected = _encode(tokenizer, rows, [pairs[r][1] for r in row_ids], row_ids, config)
        lengths = np.array([max(len(c), len(r)) for c, r in zip(chosen, rejected, strict=True)], dtype=np.int64)
        limit = config.max_prompt_length + config.max_response_length
        setting = "data.max_prompt_length + data.max_response_length"
        keep = np.flatnonzero(within_limit(lengths, limit, setting, config, rows, row_ids, "sequence"))
        self.row_ids = row_ids[keep]
        self.chosen = PackedSequences([_truncate(chosen[k], limit, config.truncation) for k in keep])
        self.rejected = PackedSequences([_truncate(rejected[k], limit, config.truncation) for k in keep])

    @staticmethod
    def required_columns(config: DataConfig) -> dict[str, str]:
        """The columns every file must have, each with the `data.` key that names it."""
        return {config.chosen_key: "chosen_key", config.rejected_key: "rejected_key"}

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = range(len(self))[i]
        return {
            "chosen_input_ids": self.chosen[i],
            "rejected_input_ids": self.rejected[i],
            "index": int(self.row_ids[i]),
        }

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """A batch of pairs for `DataProto.from_single_dict`: `chosen_input_ids`, `chosen_attention_mask`,
        `rejected_input_ids`, `rejected_attention_mask` `[batch, seq]`, right-padded to one length (the longest
        of both sides) so that chosen and rejected stack into one forward; `index` as a numpy object array."""
        longest = max(len(item[f"{side}_input_ids"]) for item in items for side in ("chosen", "rejected"))
        batch: dict[str, Any] = {}
        for side in ("chosen", "rejected"):
            ids = [item[f"{side}_input_ids"] for item in items]
            batch[f"{side}_input_ids"] = _pad_to(ids, self.pad_token_id, longest)
            batch[f"{side}_attention_mask"] = _pad_to([torch.ones_like(t) for t in ids], 0, longest)
        batch["index"] = object_array([item["index"] for item in items])
        return batch


def _split_response(prompt: Any, response: Any) -> tuple[PromptCell, str]:
    """(prompt cell, reply text) of one response cell (see the module docstring); ValueError when malformed.
    A null response gives an empty reply (skipped by the dataset)."""
    if response is None or isinstance(response, str):
        return prompt, response or ""
    messages = to_messages(response)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise ValueError(
            "a chat-list response must hold the prompt messages, then the assistant's reply as its last message; "
            f"got roles {[m['role'] for m in messages]}"
        )
    return messages[:-1], messages[-1]["content"]


def _pair(rows: Rows, row: int, config: DataConfig) -> tuple[tuple[PromptCell, str], tuple[PromptCell, str]]:
    prompts = rows.columns.get(config.prompt_key)
    prompt = prompts[row] if prompts is not None else None
    sides = []
    for key, setting in ((config.chosen_key, "chosen_key"), (config.rejected_key, "rejected_key")):
        cell, where = rows.columns[key][row], f"{rows.locate(row)}, column {key!r} (data.{setting})"
        if isinstance(cell, str) and prompt is None:
            raise DatasetError(
                f"{where}: the response is a string, to be appended to the prompt, but there is no prompt in column "
                f"{config.prompt_key!r} (data.prompt_key); add that column, set data.prompt_key, or give whole chat "
                "message lists as responses"
            )
        try:
            sides.append(_split_response(prompt, cell))
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from None
    return sides[0], sides[1]


def _skip_bad_pairs(pairs: dict[int, tuple], rows: Rows) -> dict[str, int]:
    """Remove pairs with an empty response or chosen == rejected from `pairs`, log once; returns the counts."""
    total, skipped = len(pairs), Counter()
    first: dict[str, int] = {}
    for row, (chosen, rejected) in list(pairs.items()):
        reason = None
        if not chosen[1].strip() or not rejected[1].strip():
            reason = "an empty response"
        elif chosen == rejected:
            reason = "chosen equal to rejected"
        if reason:
            skipped[reason] += 1
            first.setdefault(reason, row)
            del pairs[row]
    if skipped:
        listing = ", ".join(f"{n} with {reason} (first: {rows.locate(first[reason])})" for reason, n in skipped.items())
        logger.warning("skipped %d of %d preference pairs: %s", sum(skipped.values()), total, listing)
    if not pairs:
        raise DatasetError(f"no usable preference pair is left in {', '.join(rows.files)}: {listing}")
    return dict(skipped)


def _encode(
    tokenizer: Any, rows: Rows, sides: list[tuple[PromptCell, str]], row_ids: np.ndarray, config: DataConfig
) -> list[list[int]]:
    """Token ids of prompt text + reply + EOS for each (prompt cell, reply) of `sides`."""
    texts = []
    for row, (prompt, _) in zip(row_ids, sides, strict=True):
        try:
            texts.append(format_prompt(prompt, tokenizer, config.chat_template, config.apply_chat_template))
        except ValueError as e:
            raise DatasetError(f"{rows.locate(int(row))}, the prompt: {e}") from None
    prompt_ids = encode(tokenizer, texts)
    reply_ids = encode(tokenizer, [reply for _, reply in sides])
    return [p + r + [tokenizer.eos_token_id] for p, r in zip(prompt_ids, reply_ids, strict=True)]


def _truncate(ids: list[int], limit: int, side: str) -> list[int]:
    """`left` drops tokens from the start (the prompt side), `right` from the end."""
    if len(ids) <= limit:
        return ids
    return ids[-limit:] if side == "left" else ids[:limit]


def _pad_to(sequences: list[torch.Tensor], value: int, length: int) -> torch.Tensor:
    """Right-pad 1-D tensors to `[batch, length]`."""
    padded = pad(sequences, value, "right")
    return torch.nn.functional.pad(padded, (0, length - padded.shape[1]), value=value)
