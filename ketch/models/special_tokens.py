"""The tokens that end a response and the token that pads, read from the tokenizer and the model's generation
config, so that every backend, the export and the served model agree.

`transformers.generate` and vLLM stop at every id of the model's `generation_config.json` `eos_token_id` (an int
or a list: Llama-3-Instruct ends turns with `<|eot_id|>`, Qwen2.5 with `<|im_end|>` or `<|endoftext|>`), which
the tokenizer's single EOS often misses; ketch stops at the union.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from transformers import AutoConfig, GenerationConfig

logger = logging.getLogger("ketch.models")

_TURN_START = re.compile(r"start|\[INST\]", re.IGNORECASE)
"""Special tokens named like this open a turn (`<|im_start|>`, `<|start_header_id|>`, `<start_of_turn>`, `[INST]`)."""

_said: set[str] = set()
"""Pad-token choices already logged by this process (one line per model, not one per load)."""

ADDED_PAD_TOKEN = "<|ketch_pad|>"
"""The pad token added to a tokenizer that has no safe one."""


def generation_token_ids(model_path: str) -> tuple[list[int], int | None]:
    """(EOS ids, pad id) of the model's generation config, as `generate` reads them: `generation_config.json`,
    else `config.json`. A hub id is read through transformers; a path without either file gives ([], None)."""
    config = _model_file(model_path, "generation_config.json") or _model_file(model_path, "config.json")
    config = config.get("text_config", config) if "eos_token_id" not in config else config
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return [int(i) for i in eos_ids], config.get("pad_token_id")


def _model_file(model_path: str, name: str) -> dict[str, Any]:
    """A JSON file of the model as a dict ({} when it has none)."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        return json.loads((local / name).read_text()) if (local / name).is_file() else {}
    try:
        if name == "generation_config.json":
            return GenerationConfig.from_pretrained(model_path).to_dict()
        return AutoConfig.from_pretrained(model_path).to_dict()
    except (OSError, ValueError):
        return {}


def stop_token_ids(tokenizer, model_path: str, extra: list[int] | tuple[int, ...] = ()) -> list[int]:
    """The tokens that end a response, `[tokenizer EOS, generation-config EOS ids..., extra...]` without repeats.

    `extra` is `rollout.stop_token_ids`. Every backend, validation, `vllm_engine_config.json` and the exported
    `generation_config.json` use this one set; a response keeps its first stop token and nothing after it."""
    eos_ids, _ = generation_token_ids(model_path)
    ids = [tokenizer.eos_token_id, *eos_ids, *extra]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def turn_start_ids(tokenizer) -> set[int]:
    """BOS and the special tokens that open a turn: never a pad token (padding must not look like a new turn)."""
    ids = {tokenizer.bos_token_id} - {None}
    for token, token_id in tokenizer.get_added_vocab().items():
        if _TURN_START.search(token):
            ids.add(token_id)
    return ids


def ensure_eos_token(tokenizer, model_path: str) -> None:
    """Name the model's first generation-config EOS as the tokenizer's EOS when the tokenizer names none, or one
    that opens a turn (a converted SmolLM2 tokenizer may name `<|im_start|>`): SFT and preference data end
    responses with the tokenizer's EOS, which must be the token the model ends turns with. Logged once."""
    starts = turn_start_ids(tokenizer)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in starts:
        return
    eos_ids = [i for i in generation_token_ids(model_path)[0] if i not in starts and i < len(tokenizer)]
    if eos_ids:
        was = tokenizer.eos_token
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_ids[0])
        say_once(
            f"the tokenizer of {model_path} names EOS {was!r}; using the generation config's {tokenizer.eos_token!r}"
        )


def ensure_pad_token(tokenizer, model_path: str) -> None:
    """Give `tokenizer` a pad token when it has none (or has one that opens a turn), saying once which and why:
    the generation config's pad, else an EOS of the model (tokenizer's, then generation config's), else a new
    `ADDED_PAD_TOKEN` (only while its id stays below the model's `vocab_size`, so the embedding has a row)."""
    starts = turn_start_ids(tokenizer)
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in starts:
        return
    eos_ids, gen_pad = generation_token_ids(model_path)
    was = f"its pad token {tokenizer.pad_token!r} opens a turn" if tokenizer.pad_token_id is not None else "no pad"
    candidates = [(gen_pad, "the generation config's pad token")]
    candidates += [(i, "an EOS token of the model") for i in [tokenizer.eos_token_id, *eos_ids]]
    for token_id, why in candidates:
        if token_id is not None and token_id not in starts and token_id < len(tokenizer):
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(token_id))
            say_once(f"the tokenizer of {model_path} has {was}; padding with {tokenizer.pad_token!r} ({why})")
            return
    new_id, vocab_size = len(tokenizer), _model_file(model_path, "config.json").get("vocab_size")
    if vocab_size is not None and new_id >= vocab_size:
        raise ValueError(
            f"the tokenizer of {model_path} has {was} and no EOS that can pad, and the model's {vocab_size} "
            "embeddings leave no room for a new token; save the tokenizer with a pad token (tokenizer.pad_token = ...)"
        )
    tokenizer.add_special_tokens({"pad_token": ADDED_PAD_TOKEN})
    say_once(
        f"the tokenizer of {model_path} has {was} and no EOS that can pad; added {ADDED_PAD_TOKEN!r} (id {new_id})"
    )


def say_once(message: str, level: int = logging.INFO) -> None:
    """Log `message` at `level` the first time this process says it (models load once per role and worker)."""
    if message not in _said:
        _said.add(message)
        logger.log(level, message)
