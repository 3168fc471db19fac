"""The tiny vision-language model of the built-in visual task: a Qwen2-VL with ketch's character tokenizer (its
vision tokens added as special tokens) and a PIL image processor, built locally."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision tokens, in the order of the config's `vision_start_token_id`, `vision_end_token_id`,
`image_token_id`, `video_token_id`."""
PATCH_SIZE = 14
MERGE_SIZE = 2


def tiny_qwen2_vl_config(
    tokenizer,
    hidden_size: int = 64,
    intermediate_size: int = 256,
    num_layers: int = 2,
    vision_width: int = 64,
    vision_depth: int = 1,
) -> PretrainedConfig:
    """A Qwen2-VL config with `tokenizer`'s vocabulary, special and vision tokens (`QWEN_VISION_TOKENS`): a language
    model of `num_layers` blocks `hidden_size` wide (heads of 16), a vision tower of `vision_depth` blocks
    `vision_width` wide on 14-pixel patches, each 2 x 2 patches merged into one vision token."""
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(names, QWEN_VISION_TOKENS, strict=True)}
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    heads = hidden_size // 16
    text = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 256,
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        **special,
    }
    vision = {
        "depth": vision_depth,
        "embed_dim": vision_width,
        "num_heads": vision_width // 16,
        "mlp_ratio": 2,
        "hidden_size": hidden_size,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "in_chans": 3,
    }
    return AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, **ids, **special)


def save_tiny_vlm(path: str | Path, tokenizer, image_size: int, seed: int = 0, **sizes: int) -> Path:
    """A random tiny Qwen2-VL (sizes as in `tiny_qwen2_vl_config`) saved at `path` with `tokenizer` and an image
    processor that keeps `image_size` x `image_size` images as they are (a multiple of 28 pixels: one vision token
    per 28 x 28 pixels)."""
    if image_size % (PATCH_SIZE * MERGE_SIZE):
        raise ValueError(f"save_tiny_vlm: image_size={image_size} must be a multiple of {PATCH_SIZE * MERGE_SIZE}")
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config(tokenizer, **sizes)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    pixels = image_size * image_size
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, min_pixels=pixels, max_pixels=pixels
    )
    processor.save_pretrained(path)
    return Path(path)
