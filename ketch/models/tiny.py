"""Tiny models built locally: the built-in model (a Qwen2 of about a million parameters) and the smaller ones that
tests and benchmarks use."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2_config(
    tokenizer,
    hidden_size: int = 128,
    intermediate_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 256,
) -> Qwen2Config:
    """A Qwen2 config with `tokenizer`'s vocabulary and special tokens; the defaults (four layers of width
    128) are the built-in model, small enough to train on a laptop CPU in minutes."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def build_tiny_model(tokenizer, seed: int = 0, **sizes: int) -> Qwen2ForCausalLM:
    """A randomly initialised tiny Qwen2 (sizes as in `tiny_qwen2_config`)."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_qwen2_config(tokenizer, **sizes))


def save_tiny_model(path: str | Path, tokenizer, seed: int = 0, **sizes: int) -> Path:
    """`build_tiny_model` and `tokenizer`, saved together as a Hugging Face directory."""
    build_tiny_model(tokenizer, seed, **sizes).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)
