"""The multimodal rotary positions of Qwen's vision-language models (their 3D "mrope": time, height, width), computed
once per row by the rollout and carried in the batch as `position_ids` `[batch, 3, seq]`.

A text token's three positions are equal; an image's tokens count over the image's grid. The prompt's come from the
model's own `get_rope_index`; each response token's counts on from the prompt's largest position, one a token, as
the model's `generate` counts them (the row's text position plus the offset its images leave).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ketch.models.vision import image_model_inputs


def has_mrope(backbone: nn.Module) -> bool:
    """Whether the vision-language backbone (a model's `model`: vision encoder and language model) has multimodal
    rotary positions from `get_rope_index` (the Qwen families; not Gemma 3)."""
    return hasattr(backbone, "get_rope_index")


def rope_positions(
    backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Any
) -> torch.Tensor:
    """The multimodal rotary positions `[batch, 3, seq]` of left-padded tokens, 0 at padding.

    Args:
        backbone: A Qwen vision-language model's `model` (`has_mrope`).
        input_ids: Tokens `[batch, seq]`, vision tokens included.
        attention_mask: `[batch, seq]`, 1 at real tokens.
        rows: Each row's `multi_modal_inputs` (`[batch]`, a dict each, empty for a row without images), or None.
    """
    images = image_model_inputs(backbone.config, input_ids, rows) if rows is not None else {}
    types = images.get("mm_token_type_ids", torch.zeros_like(input_ids, dtype=torch.int))
    grid = images.get("image_grid_thw")
    positions, _ = backbone.get_rope_index(input_ids, types, image_grid_thw=grid, attention_mask=attention_mask)
    return positions.transpose(0, 1).contiguous()


def continued_positions(prompt_positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions `[batch, 3, prompt_len + response_len]` of prompts and their right-padded responses: the
    prompt's, then each real response token one past the last (the prompt's largest position), 0 at padding.

    Args:
        prompt_positions: `rope_positions` of the prompts, `[batch, 3, prompt_len]`.
        attention_mask: The prompts' and responses' `[batch, prompt_len + response_len]`.
    """
    batch, dims, prompt_len = prompt_positions.shape
    if attention_mask.shape[0] != batch or attention_mask.shape[1] < prompt_len:
        raise ValueError(
            f"continued_positions: prompt positions {tuple(prompt_positions.shape)} do not fit an attention mask of "
            f"{tuple(attention_mask.shape)} (the same rows, the prompt's columns first)"
        )
    response = attention_mask[:, prompt_len:].to(prompt_positions.dtype)
    last = prompt_positions.amax(dim=(1, 2)).unsqueeze(1)  # [batch, 1]
    counted = (last + response.cumsum(-1)) * response  # [batch, response_len]
    return torch.cat([prompt_positions, counted.unsqueeze(1).expand(batch, dims, -1)], dim=-1)
