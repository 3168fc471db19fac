"""Steps both datasets take up front: choose rows, format prompt cells into text, apply the length limit."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ketch.config.schema import DataConfig
from ketch.data.chat_templates import format_prompt, get_chat_template
from ketch.data.errors import DatasetError
from ketch.data.images import with_image_markers
from ketch.data.parquet import Rows

logger = logging.getLogger("ketch.data")


def first_rows(rows: Rows, config: DataConfig) -> np.ndarray:
    """Row numbers `[n]` in use: all rows, or the first `data.max_samples`."""
    count = len(rows) if config.max_samples is None else min(len(rows), config.max_samples)
    if count < 1:
        raise DatasetError(f"data.max_samples={config.max_samples} leaves no rows; set it to at least 1")
    return np.arange(count)


def prompt_texts(rows: Rows, row_ids: np.ndarray, tokenizer: Any, config: DataConfig) -> list[str]:
    """The prompt text of each row in `row_ids` (see `format_prompt`; images in a message's content list become
    `<image>` placeholders); a bad prompt cell names its file and row."""
    if config.chat_template:
        try:
            get_chat_template(config.chat_template)
        except ValueError as e:
            raise DatasetError(f"data.chat_template: {e}") from None
    column = rows.columns[config.prompt_key]
    texts = []
    for row in row_ids:
        try:
            texts.append(
                format_prompt(
                    with_image_markers(column[row]), tokenizer, config.chat_template, config.apply_chat_template
                )
            )
        except ValueError as e:
            raise DatasetError(f"{rows.locate(row)}, column {config.prompt_key!r}: {e}") from None
    return texts


def within_limit(
    lengths: np.ndarray, max_len: int, setting: str, config: DataConfig, rows: Rows, row_ids: np.ndarray, what: str
) -> np.ndarray:
    """Which rows to keep, `[n]` bool, given token `lengths` `[n]` and the limit `max_len` set by `setting`.

    Rows over the limit are dropped with `data.filter_overlong_prompts` (and the count logged), kept for
    the caller to truncate with `data.truncation=left|right`, and raise DatasetError with `error`.
    """
    limit = f"{setting}={max_len}"
    over = lengths > max_len
    if not over.any():
        return ~over
    if config.filter_overlong_prompts:
        logger.info("dropped %d of %d %ss longer than %s tokens", over.sum(), len(over), what, limit)
        if over.all():
            raise DatasetError(f"every {what} is longer than {limit} tokens, so none is left; raise the limit")
        return ~over
    if config.truncation == "error":
        first = int(np.flatnonzero(over)[0])
        others = f" (and {over.sum() - 1} more)" if over.sum() > 1 else ""
        raise DatasetError(
            f"{rows.locate(row_ids[first])}: the {what} is {lengths[first]} tokens, longer than {limit}{others}; "
            "set data.truncation=left or right, data.filter_overlong_prompts=true, or raise the limit"
        )
    return np.ones_like(over)
