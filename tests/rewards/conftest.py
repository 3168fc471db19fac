"""Fixtures of the reward tests: a local character-level tokenizer and a rollout-batch builder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ketch.protocol import DataProto

CHARS = " 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ#$%,.+-*/=^_{}()[]\\!?:;'\""


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (spaces included); decoding joins the characters back unchanged."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *CHARS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture
def make_batch(char_tokenizer: PreTrainedTokenizerFast) -> Callable[..., DataProto]:
    """Build a rollout batch: each text + EOS, right-padded to `response_len` (mask 1 on text and EOS)."""

    def make(
        texts: list[str],
        ground_truths: list[Any],
        data_source: str = "ketch/arithmetic",
        response_len: int = 12,
        **non_tensors: Any,
    ) -> DataProto:
        responses = torch.full((len(texts), response_len), char_tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(texts), response_len), dtype=torch.int64)
        for i, text in enumerate(texts):
            ids = [*char_tokenizer.encode(text, add_special_tokens=False), char_tokenizer.eos_token_id]
            responses[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        columns = {"data_source": np.array([data_source] * len(texts), dtype=object), "ground_truth": ground_truths}
        return DataProto.from_dict({"responses": responses, "response_mask": mask}, columns | non_tensors)

    return make
