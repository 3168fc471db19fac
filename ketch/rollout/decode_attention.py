"""The static decoder's attention: the new tokens' keys and values written into a preallocated KV cache, then
attention over it, with the one-token step reading each key/value head once for the query heads that share it
(the op `ketch::decode_attention`: on GPUs a Triton kernel, `decode_kernel.py`, that reads the cache only up to
the new token's slot). Registered with transformers as the attention implementation `DECODE_ATTENTION`."""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

DECODE_ATTENTION = "ketch_decode"
"""The attention implementation the decoding model is switched to."""


@torch.library.custom_op("ketch::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, filled: torch.Tensor, slot: torch.Tensor, scale: float
) -> torch.Tensor:
    """`query` `[rows, kv_heads, group, head_dim]` (the query heads of each key/value head) against the cache
    `key`/`value` `[rows, kv_heads, length, head_dim]` where `filled` `[rows, length]` (bool), up to the slot
    `slot` `[1]` of the newest token; returns `[rows, kv_heads, group, head_dim]`, contiguous. An op of its own,
    so that compiled blocks, their saved forms and CUDA graphs hold it as one call."""
    return _sdpa(query, key, value, filled, scale)


@decode_attention.register_kernel("cuda")
def _decode_attention_cuda(query, key, value, filled, slot, scale):
    from ketch.rollout.decode_kernel import decode_attention as kernel
    from ketch.rollout.decode_kernel import fits

    if fits(query, key, value):
        return kernel(query, key, value, filled, slot, scale)
    return _sdpa(query, key, value, filled, scale)


@decode_attention.register_fake
def _decode_attention_fake(query, key, value, filled, slot, scale):
    return query.new_empty(query.shape)


def _sdpa(query, key, value, filled, scale) -> torch.Tensor:
    mask = filled[:, None, None, :]
    return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale).contiguous()


def grouped_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    slot: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. For one new token per row, `query` `[batch, heads, 1, head_dim]`
    against the cache `key`/`value` `[batch, kv_heads, length, head_dim]`: the `heads / kv_heads` query heads
    that share a key/value head attend as one group of queries, so the cache is read once and never copied per
    query head (transformers' SDPA path repeats it when there is a mask); with the new token's cache `slot` `[1]`
    and a mask, through `decode_attention`. Longer queries (the prompt) go to SDPA.
    Returns `[batch, 1, heads, head_dim]`."""
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads == kv_heads:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)  # query head i uses kv head i // group
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]
    if slot is not None and mask is not None:
        scale = head_dim**-0.5 if scaling is None else scaling
        out = decode_attention(grouped, key, value, mask[:, 0, 0, :], slot, scale)
    else:
        out = nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, head_dim), None


def cached_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cache_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered `DECODE_ATTENTION`: writes the new `key`/`value` `[batch, kv_heads, new, head_dim]` into
    the module's KV cache (`module.decode_kv`, set by `DecodeBuffers.use`) at the cache slots `cache_slots`
    `[new]`, then attends: the prompt (`new` > 1) among its own tokens under transformers' causal mask (sliding
    windows included), one new token over the whole cache under `attention_mask` `[batch, 1, 1, length]` (True:
    a filled slot), in a layer with a `sliding_window` only over the slots less than that many back.
    The cache is reached through the module, not by the layer's index, so every block runs the same code."""
    if cache_slots is None:
        raise ValueError(f"{DECODE_ATTENTION} attention: call the model with `cache_slots` (see StaticDecoder)")
    keys, values = module.decode_kv
    keys.index_copy_(2, cache_slots, key)
    values.index_copy_(2, cache_slots, value)
    if query.shape[2] > 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sliding_window is not None:
        recent = torch.arange(keys.shape[2], device=keys.device) > cache_slots - sliding_window
        attention_mask = attention_mask & recent
    return grouped_decode_attention(module, query, keys, values, attention_mask, scaling=scaling, slot=cache_slots)


def use_cached_attention(model: nn.Module) -> None:
    """Switch a HF model to `cached_attention` (prompt masks built as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, cached_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(DECODE_ATTENTION)
