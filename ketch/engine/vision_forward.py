"""The training forward of a vision-language model (its whole model: vision encoder, projector, language model), padded
or, for the Qwen families, packed (`ketch.engine.packing`).

Packed, the multimodal rotary positions (`[3, batch, seq]`: time, height, width) are computed on the padded batch by
the model's own `get_rope_index`, as the padded forward and `generate` compute them, then packed with the tokens;
the images are encoded apart, so that the packed attention's sequence offsets reach only the language model.
"""

from __future__ import annotations

import torch
from torch import nn

from ketch.engine.packing import Packing


def vision_hidden(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_inputs: dict[str, torch.Tensor],
    packed: bool,
    host_mask: torch.Tensor,
) -> torch.Tensor:
    """Last hidden states `[batch, seq, hidden]` of the vision-language model `lm` on a padded batch (zeros at the
    padding when `packed`).

    Args:
        lm: The image-text-to-text model (its `model` the backbone with the vision encoder).
        input_ids: Tokens `[batch, seq]`, vision tokens included.
        attention_mask: `[batch, seq]`, 1 at real tokens.
        image_inputs: The batch's images (`ketch.models.vision.image_model_inputs`; empty: none).
        packed: Run the language model on the packed row of real tokens (a Qwen family's model).
        host_mask: The attention mask on the host, from which the packing is found.
    """
    model = lm.model
    if not packed:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **image_inputs)[0]
    images = dict(image_inputs)
    pixel_values, grid = images.pop("pixel_values", None), images.get("image_grid_thw")
    types = images.get("mm_token_type_ids", torch.zeros_like(input_ids, dtype=torch.int))
    positions, _ = model.get_rope_index(input_ids, types, image_grid_thw=grid, attention_mask=attention_mask)
    encoded = None
    if pixel_values is not None:
        encoded = {"image": model.get_image_features(pixel_values, grid, return_dict=True)}
    packing = Packing.from_mask(host_mask, input_ids.device)
    hidden = model(
        input_ids=packing.pack(input_ids),
        position_ids=packing.pack(positions.permute(1, 2, 0)).permute(2, 0, 1),  # [3, 1, tokens]
        attention_mask=None,  # the packed attention has no mask function: the model builds no mask
        mm_encoder_outputs=encoded,
        image_grid_thw=grid,
        mm_token_type_ids=packing.pack(types),
        use_cache=False,
        cu_seq_lens_q=packing.cu_seqlens,
        cu_seq_lens_k=packing.cu_seqlens,
        max_length_q=packing.max_len,
        max_length_k=packing.max_len,
    )[0]
    return packing.unpack(hidden)
