"""The static decoder's attention: the new tokens' keys and values written into its paged KV cache
(`kv_pages.py`), then attention over it, with the one-token step reading each key/value head once for the query
heads that share it (the op `ketch::decode_attention`: on GPUs a Triton kernel, `decode_kernel.py`, that reads the
cache only up to the new token's slot). Registered with transformers as the attention implementation
`DECODE_ATTENTION`."""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ketch.rollout.kv_pages import gather, write

DECODE_ATTENTION = "ketch_decode"
"""The attention implementation the decoding model is switched to."""


@torch.library.custom_op("ketch::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    filled: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`query` `[rows, kv_heads, group, head_dim]` (the query heads of each key/value head) against the paged cache
    (`kv_pages.py`): pools `key`/`value` `[pages, kv_heads, page, head_dim]` under `table` `[rows, length / page]`,
    where `filled` `[rows, length]` (bool), up to the slot `slot` `[1]` of the newest token; returns `[rows,
    kv_heads, group, head_dim]`, contiguous. An op of its own, so that compiled blocks, their saved forms and CUDA
    graphs hold it as one call. Off the kernel, the rows' slots are gathered out of the pools first (a copy)."""
    return _sdpa(query, key, value, table, filled, scale)


@decode_attention.register_kernel("cuda")
def _decode_attention_cuda(query, key, value, table, filled, slot, scale):
    from ketch.rollout.decode_kernel import decode_attention as kernel
    from ketch.rollout.decode_kernel import fits

    if fits(query, key, value):
        return kernel(query, key, value, table, filled, slot, scale)
    return _sdpa(query, key, value, table, filled, scale)


@decode_attention.register_fake
def _decode_attention_fake(query, key, value, table, filled, slot, scale):
    return query.new_empty(query.shape)


def _sdpa(query, key, value, table, filled, scale) -> torch.Tensor:
    length = filled.shape[1]
    keys, values = (gather(pool, table, length).to(query.dtype) for pool in (key, value))  # an FP8 cache's too
    mask = filled[:, None, None, :]
    return nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale).contiguous()


def grouped_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    filled: torch.Tensor,
    slot: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """One new token per row: `query` `[batch, heads, 1, head_dim]` against the paged cache (pools `key`/`value`
    `[pages, kv_heads, page, head_dim]`, `table` `[batch, length / page]`) where `filled` `[batch, length]`, up to
    the new token's `slot` `[1]`. The `heads / kv_heads` query heads that share a key/value head attend as one group
    of queries (`decode_attention`), so the cache is read once and never copied per query head (transformers' SDPA
    path repeats it when there is a mask). Returns `[batch, 1, heads, head_dim]`."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)  # query head i uses kv head i // group
    scale = head_dim**-0.5 if scaling is None else scaling
    out = decode_attention(grouped, key, value, table, filled, slot, scale)
    return out.reshape(batch, 1, heads, head_dim)


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
    the module's paged KV cache (`module.decode_kv`: the pools and the page table, set by `DecodeBuffers.use`) at
    the cache slots `cache_slots` `[new]`, then attends: the prompt (`new` > 1) among its own tokens under
    transformers' causal mask (sliding windows included), one new token over the whole cache under
    `attention_mask` `[batch, 1, 1, length]` (True: a filled slot), in a layer with a `sliding_window` only over
    the slots less than that many back. The cache is reached through the module, not by the layer's index, so
    every block runs the same code. A module the decoder gives no cache (a vision encoder's) attends as SDPA."""
    if not hasattr(module, "decode_kv"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if cache_slots is None:
        raise ValueError(f"{DECODE_ATTENTION} attention: call the model with `cache_slots` (see StaticDecoder)")
    keys, values, table = module.decode_kv
    write(keys, table, cache_slots, key)
    write(values, table, cache_slots, value)
    if query.shape[2] > 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    filled = attention_mask[:, 0, 0, :]
    if sliding_window is not None:
        filled = filled & (torch.arange(filled.shape[1], device=filled.device) > cache_slots - sliding_window)
    return grouped_decode_attention(query, keys, values, table, filled, cache_slots, scaling), None


def use_cached_attention(model: nn.Module) -> None:
    """Switch a HF model to `cached_attention` (prompt masks built as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, cached_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(DECODE_ATTENTION)
