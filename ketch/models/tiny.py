"""The built-in tiny Qwen2-architecture model (about a million parameters) for the built-in task."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2_config(vocab_size: int, pad_token_id: int, eos_token_id: int, bos_token_id: int) -> Qwen2Config:
    """Four layers of width 128: small enough to train on a laptop CPU in minutes."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
    )


def build_tiny_model(tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised tiny Qwen2 whose vocabulary matches `tokenizer`."""
    torch.manual_seed(seed)
    config = tiny_qwen2_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
    return Qwen2ForCausalLM(config)
