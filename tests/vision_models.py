"""Tiny random vision-language models of each family ketch trains, saved like a hub checkout (model, character
tokenizer with the family's special tokens, image processor): text 2 blocks 64 wide, vision tower 1 block 32 wide,
images of 28 to 64 pixels a side. No network."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ketch.data.builtin.tokenizer import build_char_tokenizer

QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
GEMMA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TEXT_GQA = {**TEXT, "num_key_value_heads": 2, "max_position_embeddings": 1024}
QWEN_VISION = {"depth": 1, "num_heads": 2, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3")


def _qwen_config(family: str, tokenizer, special: dict) -> dict:
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            QWEN_TOKENS,
            strict=True,
        )
    }
    mrope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = {
        "qwen2_vl": {**QWEN_VISION, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "patch_size": 14},
        "qwen2_5_vl": {
            **QWEN_VISION,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [0],
        },
        "qwen3_vl": {
            **QWEN_VISION,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "patch_size": 16,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
    }[family]
    text = {**TEXT_GQA, **special, "vocab_size": len(tokenizer), "rope_parameters": mrope}
    if family == "qwen3_vl":
        text |= {"head_dim": 16, "rope_parameters": {**mrope, "mrope_interleaved": True}}
    return {"text_config": text, "vision_config": vision, **ids, **special}


def _gemma_config(tokenizer, special: dict) -> dict:
    text = {**TEXT_GQA, **special, "vocab_size": len(tokenizer), "head_dim": 16, "sliding_window": 8}
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    return {
        **special,
        "text_config": text,
        "vision_config": vision,
        "mm_tokens_per_image": 4,
        "boi_token_index": tokenizer.convert_tokens_to_ids(GEMMA_TOKENS["boi_token"]),
        "eoi_token_index": tokenizer.convert_tokens_to_ids(GEMMA_TOKENS["eoi_token"]),
        "image_token_index": tokenizer.convert_tokens_to_ids(GEMMA_TOKENS["image_token"]),
    }


def save_tiny_vlm(path: str | Path, family: str, seed: int = 0) -> Path:
    """A random tiny `family` model (one of `FAMILIES`) saved at `path` with its tokenizer and image processor."""
    path = Path(path)
    gemma = family == "gemma3"
    tokenizer = build_char_tokenizer(tuple(GEMMA_TOKENS.values()) if gemma else QWEN_TOKENS)
    tokenizer.save_pretrained(path)
    if gemma:  # the processor reads these tokens as the tokenizer's attributes
        settings = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps(settings | {"extra_special_tokens": GEMMA_TOKENS}))
        tokenizer = AutoTokenizer.from_pretrained(path)
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    settings = _gemma_config(tokenizer, special) if gemma else _qwen_config(family, tokenizer, special)
    config = AutoConfig.for_model(family, **settings)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(path)
    if gemma:
        Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
        (path / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
    else:
        patch = config.vision_config.patch_size * 2
        Qwen2VLImageProcessorPil(
            patch_size=patch // 2, min_pixels=patch * patch, max_pixels=4 * patch * patch
        ).save_pretrained(path)
    return path
