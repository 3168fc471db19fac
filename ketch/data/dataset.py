"""`RLHFDataset`: prompts from Parquet files, tokenized up front, for rollout and reward.

Two row layouts load: the verl/GSM8K one (`data_source`, `prompt` as a chat list, `ability`,
`reward_model: {style, ground_truth}`, `extra_info`) and the simple one (`prompt`, and optionally
`answer`, `response`, `chosen`, `rejected`, ...).
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
from ketch.data.images import check_untruncated, image_tensors, process_prompt, prompt_images
from ketch.data.parquet import Rows, read_parquet_files
from ketch.data.preparation import first_rows, prompt_texts, within_limit
from ketch.protocol import object_array

_RESERVED_COLUMNS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "raw_prompt",
    "index",
    "source_row",
    "multi_modal_inputs",
)

DEFAULT_DATA_SOURCE = "unknown"
"""The data source of a row whose file has no `data_source` column (or an empty cell)."""


class RLHFDataset(Dataset):
    """Prompts of one split. Item `i` is a dict (1-D tensors unpadded):

    - `input_ids` LongTensor `[prompt_len_i]`, `attention_mask` ones `[prompt_len_i]`;
    - `raw_prompt`: the prompt cell (str or list of message dicts);
    - `data_source` (default "unknown"), `extra_info` (default {});
    - `ground_truth`: `reward_model["ground_truth"]`, else the `answer` column, else a `ground_truth` column, else None;
    - `index`: the row's position in the concatenated files (kept when other rows are filtered out);
    - `source_row`: where the row comes from, `<file>, row N` (error messages name it);
    - with a `processor` (a vision-language model's, `ketch.models.vision.load_image_processor`): `images`, the
      row's images (PIL, RGB; `data.image_key` column), and `multi_modal_inputs`, the processor's image tensors
      for them (`pixel_values`, Qwen's `image_grid_thw` `[images, 3]`; empty without images); `input_ids` then
      holds the vision tokens, which the prompt length counts;
    - every other column as it is (`ability`, `reward_model`, `answer`, `chosen`, ...).

    Every image is decoded and counted against its prompt's `<image>` placeholders here, so a bad one stops the
    run at start-up with its file, row and column named.
    """

    def __init__(
        self, data_files: str | list[str], tokenizer: Any, config: DataConfig, processor: Any | None = None
    ) -> None:
        files = resolve_data_files([data_files] if isinstance(data_files, str) else list(data_files))
        self.config, self.processor = config, processor
        self.pad_token_id = pad_token_id(tokenizer)
        self.rows = read_parquet_files(files, self.required_columns(config))
        _check_reserved(self.rows, config.prompt_key)
        row_ids = first_rows(self.rows, config)
        texts = prompt_texts(self.rows, row_ids, tokenizer, config)
        self.images = prompt_images(self.rows, row_ids, texts, config.image_key, processor is not None)
        ids = encode(tokenizer, texts) if processor is None else self._vision_ids(row_ids, texts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        limit = config.max_prompt_length
        keep = within_limit(lengths, limit, "data.max_prompt_length", config, self.rows, row_ids, "prompt")
        if processor is not None:
            over = keep & (lengths > limit)
            check_untruncated(over, self.images, self.rows, row_ids, f"data.max_prompt_length={limit}")
        self.num_filtered = int((~keep).sum())
        self.texts = [texts[k] for k in np.flatnonzero(keep)]
        self.row_ids = row_ids[keep]
        self.input_ids = PackedSequences([_truncate(ids[k], limit, config.truncation) for k in np.flatnonzero(keep)])

    def _vision_ids(self, row_ids: np.ndarray, texts: list[str]) -> list[list[int]]:
        """Each prompt's token ids with its images' vision tokens (the processor's expansion)."""
        return [
            process_prompt(self.processor, text, self.images.get(int(row)))["input_ids"][0].tolist()
            for row, text in zip(row_ids, texts, strict=True)
        ]

    @staticmethod
    def required_columns(config: DataConfig) -> dict[str, str]:
        """The columns every file must have, each with the `data.` key that names it."""
        return {config.prompt_key: "prompt_key"}

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = range(len(self))[i]
        input_ids = self.input_ids[i]
        row = int(self.row_ids[i])
        cells = {name: values[row] for name, values in self.rows.columns.items()}
        item = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        if self.processor is not None:
            cells.pop(self.config.image_key, None)
            item["images"] = self.images.get(row, [])
            processed = process_prompt(self.processor, self.texts[i], item["images"]) if item["images"] else {}
            item["multi_modal_inputs"] = image_tensors(processed)
        item["raw_prompt"] = cells.pop(self.config.prompt_key)
        item["data_source"] = _default(cells.pop("data_source", None), DEFAULT_DATA_SOURCE)
        item["ground_truth"] = _ground_truth(cells)
        cells.pop("ground_truth", None)
        item["extra_info"] = _default(cells.pop("extra_info", None), {})
        item["index"] = row
        item["source_row"] = self.rows.locate(row)
        return item | cells

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """A batch for `DataProto.from_single_dict`: prompts left-padded to the batch's longest.

        `input_ids`, `attention_mask`, `position_ids` are `[batch, prompt_len]` tensors; every other key
        becomes a numpy object array `[batch]`.
        """
        attention_mask = pad([item["attention_mask"] for item in items], 0, "left")
        batch: dict[str, Any] = {
            "input_ids": pad([item["input_ids"] for item in items], self.pad_token_id, "left"),
            "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask),
        }
        for key in items[0]:
            if key not in batch:
                batch[key] = object_array([item[key] for item in items])
        return batch


def _truncate(ids: list[int], limit: int, side: str) -> list[int]:
    """`ids` cut to `limit` tokens: `left` keeps the end, `right` keeps the start."""
    if len(ids) <= limit:
        return ids
    return ids[-limit:] if side == "left" else ids[:limit]


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _ground_truth(cells: dict[str, Any]) -> Any:
    reward_model = cells.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return reward_model["ground_truth"]
    if cells.get("answer") is not None:
        return cells["answer"]
    return cells.get("ground_truth")


def _check_reserved(rows: Rows, prompt_key: str) -> None:
    clashes = [name for name in _RESERVED_COLUMNS if name in rows.columns and name != prompt_key]
    if clashes:
        raise DatasetError(
            f"the data files ({', '.join(rows.files)}) have column(s) {clashes}, which the dataset fills itself; "
            "rename them in the files"
        )
