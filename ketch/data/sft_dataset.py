"""`SFTDataset`: prompt/response pairs for supervised fine-tuning, with a loss mask on the response.

Each sequence is prompt tokens + response tokens + EOS; the loss covers the response and the EOS. A response
may also be a list of messages that continues the conversation (assistant turns, tool results, user replies):
it is tokenized as a multi-turn rollout holds it (`conversation_tokens`), each assistant turn ending with EOS
(or, given `turn_stop`, the end of a tool call), and the loss covers the assistant turns only, never a tool
result or the template around it. Given `tools` (the JSON schemas of a multi-turn rollout's tools, by name),
each prompt is rendered as that rollout renders it: its messages with the schemas of the tools the row allows.
A sequence longer than `max_prompt_length + max_response_length` is handled per `data.truncation`:
`left` drops tokens from the start (the prompt side, keeping the response whole where it fits),
`right` drops tokens from the end (the response's tail, then its EOS, is lost), `error` raises.
Given a vision-language model's `processor`, a row's images (`data.image_key`) go where its prompt's `<image>`
placeholders are, as in `RLHFDataset`: the prompt holds their vision tokens and the item their image tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ketch.config.schema import DataConfig
from ketch.data.batching import PackedSequences, encode, pad, pad_token_id, position_ids
from ketch.data.builtin.files import resolve_data_files
from ketch.data.chat_templates import to_messages
from ketch.data.conversation import ChatRenderer, conversation_tokens, prompt_messages, row_tool_names
from ketch.data.errors import DatasetError
from ketch.data.images import check_untruncated, image_tensors, process_prompt, prompt_images
from ketch.data.parquet import Rows, read_parquet_files
from ketch.data.preparation import first_rows, prompt_texts, within_limit
from ketch.protocol import object_array


class SFTDataset(Dataset):
    """Prompt/response pairs of one split. Item `i` is a dict of 1-D tensors `[seq_len_i]` (unpadded):
    `input_ids`, `attention_mask` (ones), `loss_mask` (0 on the prompt, 1 on the response and EOS; for a
    message-list response 1 on the assistant turns only), and `index` (int: the row's position in the
    concatenated files). `turn_stop`: the strings after which a rollout's turn ends (`</tool_call>`), where an
    assistant turn gets no EOS; `tools`: the rollout's tool schemas by name, shown to the model in the prompt.
    With a `processor` (`ketch.models.vision.load_image_processor`), item `i` also has `multi_modal_inputs`, the
    image tensors of its row's images (`pixel_values`, Qwen's `image_grid_thw`; empty without images), and the
    prompt's `input_ids` the images' vision tokens, which are never truncated.
    """

    def __init__(
        self,
        data_files: str | list[str],
        tokenizer: Any,
        config: DataConfig,
        turn_stop: tuple[str, ...] = (),
        tools: dict[str, dict] | None = None,
        processor: Any | None = None,
    ) -> None:
        if tokenizer.eos_token_id is None:
            raise DatasetError("SFTDataset ends every response with EOS, but the tokenizer has no EOS token")
        files = resolve_data_files([data_files] if isinstance(data_files, str) else list(data_files))
        self.pad_token_id, self.processor = pad_token_id(tokenizer), processor
        rows = read_parquet_files(files, self.required_columns(config))
        row_ids = first_rows(rows, config)
        self.images, self.texts = {}, {}
        if tools is None:
            texts = prompt_texts(rows, row_ids, tokenizer, config)
            self.images = prompt_images(rows, row_ids, texts, config.image_key, processor is not None)
            self.texts = {int(row): text for row, text in zip(row_ids, texts, strict=True) if self.images.get(int(row))}
            prompts = self._prompt_ids(tokenizer, row_ids, texts)
            row_tools = [None] * len(row_ids)
        else:
            row_tools = [_row_tools(rows, row, tools) for row in row_ids]
            prompts = _prompts_with_tools(rows, row_ids, row_tools, tokenizer, config)
        responses = _responses(rows, row_ids, row_tools, tokenizer, config, turn_stop)
        sequences = [p + r for p, (r, _) in zip(prompts, responses, strict=True)]
        loss_masks = [[0] * len(p) + m for p, (_, m) in zip(prompts, responses, strict=True)]
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        limit = config.max_prompt_length + config.max_response_length
        setting = "data.max_prompt_length + data.max_response_length"
        keep = within_limit(lengths, limit, setting, config, rows, row_ids, "sequence")
        check_untruncated(keep & (lengths > limit), self.images, rows, row_ids, f"{setting}={limit}")
        self.num_filtered = int((~keep).sum())
        self.row_ids = row_ids[keep]
        kept = np.flatnonzero(keep)
        self.input_ids = PackedSequences([_truncate(sequences[k], limit, config.truncation) for k in kept])
        self.loss_masks = PackedSequences([_truncate(loss_masks[k], limit, config.truncation) for k in kept])

    def _prompt_ids(self, tokenizer: Any, row_ids: np.ndarray, texts: list[str]) -> list[list[int]]:
        """Each prompt's token ids; a row's images expanded into their vision tokens by the processor."""
        if self.processor is None:
            return encode(tokenizer, texts)
        return [
            process_prompt(self.processor, text, self.images.get(int(row)))["input_ids"][0].tolist()
            for row, text in zip(row_ids, texts, strict=True)
        ]

    @staticmethod
    def required_columns(config: DataConfig) -> dict[str, str]:
        """The columns every file must have, each with the `data.` key that names it."""
        return {config.prompt_key: "prompt_key", config.response_key: "response_key"}

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = range(len(self))[i]
        input_ids, row = self.input_ids[i], int(self.row_ids[i])
        item = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "loss_mask": self.loss_masks[i],
            "index": row,
        }
        if self.processor is not None:
            images = self.images.get(row)
            item["multi_modal_inputs"] = (
                image_tensors(process_prompt(self.processor, self.texts[row], images)) if images else {}
            )
        return item

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Right-pad to the batch's longest: `input_ids`, `attention_mask`, `position_ids`, `loss_mask`
        `[batch, seq_len]` (padding has mask 0 and loss 0), and `index` (and with a processor `multi_modal_inputs`)
        as a numpy object array `[batch]`.
        """
        attention_mask = pad([item["attention_mask"] for item in items], 0, "right")
        batch = {
            "input_ids": pad([item["input_ids"] for item in items], self.pad_token_id, "right"),
            "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask),
            "loss_mask": pad([item["loss_mask"] for item in items], 0, "right"),
            "index": object_array([item["index"] for item in items]),
        }
        if self.processor is not None:
            batch["multi_modal_inputs"] = object_array([item["multi_modal_inputs"] for item in items])
        return batch


def _truncate(sequence: list[int], limit: int, side: str) -> list[int]:
    """`sequence` cut to `limit` tokens (`left`: drop from the start, else from the end)."""
    excess = max(len(sequence) - limit, 0)
    return sequence[excess:] if side == "left" else sequence[: len(sequence) - excess]


def _row_tools(rows: Rows, row: int, tools: dict[str, dict]) -> list[dict]:
    """The schemas of the tools row `row` allows (its `tools` column or `extra_info["tools"]`, else all)."""
    names = row_tool_names({key: rows.columns[key][row] for key in ("tools", "extra_info") if key in rows.columns})
    unknown = sorted(set(names or ()) - set(tools))
    if unknown:
        raise DatasetError(
            f"{rows.locate(row)}: the row allows tools {unknown} that are not loaded; add them to "
            f"rollout.multi_turn.tools (loaded: {sorted(tools)})"
        )
    return [tools[name] for name in (tools if names is None else names)]


def _prompts_with_tools(
    rows: Rows, row_ids: np.ndarray, row_tools: list[list[dict]], tokenizer: Any, config: DataConfig
) -> list[list[int]]:
    """Each row's prompt ids as a multi-turn rollout renders them: the chat template given the row's tools."""
    renderer = ChatRenderer(tokenizer, config.chat_template)
    column = rows.columns[config.prompt_key]
    prompts = []
    for row, tools in zip(row_ids, row_tools, strict=True):
        try:
            prompts.append(renderer.prompt_ids(prompt_messages(column[row]), tools))
        except ValueError as e:
            raise DatasetError(f"{rows.locate(row)}, column {config.prompt_key!r}: {e}") from None
    return prompts


def _responses(
    rows: Rows,
    row_ids: np.ndarray,
    row_tools: list[list[dict] | None],
    tokenizer: Any,
    config: DataConfig,
    turn_stop: tuple[str, ...],
) -> list[tuple[list[int], list[int]]]:
    """(ids, loss_mask) of each row's response: a string and EOS (all trained), or a message list (assistant
    turns trained); a cell that is neither names its file and row."""
    column, key = rows.columns[config.response_key], config.response_key
    eos = tokenizer.eos_token_id
    texts = {row: column[row] for row in row_ids if isinstance(column[row], str)}
    encoded = dict(zip(texts, encode(tokenizer, list(texts.values())), strict=True)) if texts else {}
    renderer = None
    responses = []
    for row, tools in zip(row_ids, row_tools, strict=True):
        if row in encoded:
            ids = [*encoded[row], eos]
            responses.append((ids, [1] * len(ids)))
            continue
        where = f"{rows.locate(row)}, column {key!r} (data.response_key)"
        if not isinstance(column[row], list | tuple | np.ndarray):
            raise DatasetError(
                f"{where}: the response must be a string or a list of messages, got {type(column[row]).__name__}"
            )
        try:
            renderer = renderer or ChatRenderer(tokenizer, config.chat_template)
            responses.append(conversation_tokens(renderer, to_messages(column[row]), eos, turn_stop, tools))
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from None
    return responses
