"""The training forward of a vision-language model (its whole model: vision encoder, projector, language model), padded
or, for the Qwen families, packed (`ketch.engine.packing`).

The Qwen families' multimodal rotary positions are the batch's `position_ids` `[batch, 3, seq]` where the rollout
carried them (`ketch.models.mrope`); rows without them (`[batch, seq]`: SFT data, an older run's checkpoint) get
them from the model's own `get_rope_index` on the padded batch, as the padded forward and `generate` compute them.
Packed, they are packed with the tokens, and the images are encoded apart, so that the packed attention's sequence
offsets reach only the language model.
"""

from __future__ import annotations

import torch
from torch import nn

from ketch.engine.packing import Packing
from ketch.models.mrope import has_mrope


def vision_hidden(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    image_inputs: dict[str, torch.Tensor],
    packed: bool,
    host_mask: torch.Tensor,
) -> torch.Tensor:
    """Last hidden states `[batch, seq, hidden]` of the vision-language model `lm` on a padded batch (zeros at the
    padding when `packed`).

    Args:
        lm: The model whose `model` is the backbone with the vision encoder (the image-text-to-text model, or a
            critic's `ketch.models.vision_critic.VisionTokenClassifier`).
        input_ids: Tokens `[batch, seq]`, vision tokens included.
        attention_mask: `[batch, seq]`, 1 at real tokens.
        position_ids: The multimodal rotary positions `[batch, 3, seq]` carried by the rollout, or `[batch, seq]`
            (not carried: computed here where the model has them).
        image_inputs: The batch's images (`ketch.models.vision.image_model_inputs`; empty: none).
        packed: Run the language model on the packed row of real tokens (a Qwen family's model).
        host_mask: The attention mask on the host, from which the packing is found.
    """
    model = lm.model
    carried = _carried(model, position_ids)
    if not packed:
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=carried, use_cache=False, **image_inputs
        )[0]
    images = dict(image_inputs)
    pixel_values, grid = images.pop("pixel_values", None), images.get("image_grid_thw")
    types = images.get("mm_token_type_ids", torch.zeros_like(input_ids, dtype=torch.int))
    positions = carried
    if positions is None:
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


def _carried(backbone: nn.Module, position_ids: torch.Tensor) -> torch.Tensor | None:
    """The carried multimodal rotary positions in the model's layout `[3, batch, seq]`, or None where `position_ids`
    are `[batch, seq]`; raises `ValueError` for carried positions that `backbone` has no use for."""
    if position_ids.dim() != 3:
        return None
    if not has_mrope(backbone) or position_ids.shape[1] != 3:
        raise ValueError(
            f"vision forward: position_ids of shape {tuple(position_ids.shape)} are not multimodal rotary positions "
            f"[batch, 3, seq] of {type(backbone).__name__} (which has them only with get_rope_index): a batch for "
            "it carries position_ids [batch, seq]"
        )
    return position_ids.transpose(0, 1)
