"""Padding-free forwards: the real tokens of a micro-batch packed into one row, attention kept per sequence.

A left-padded prompt + right-padded response batch `[batch, seq]` becomes one row of its `T` real tokens with
each sequence's own position ids; the backbone runs on that row and its hidden states go back to the padded
layout, so the heads (log-probs, values, scores) do not change. Attention stays inside each sequence: the
packed attention function registered with transformers as `ketch_packed` runs variable-length flash
attention on CUDA (`torch.nn.attention.varlen`) and, elsewhere, causal SDPA sequence by sequence. Padding
then costs nothing in the backbone, whatever the length spread.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch
from torch import nn

ATTENTION = "ketch_packed"
"""The attention implementation name packed models are switched to."""


@dataclass
class Packing:
    """Where the real tokens of a `[batch, seq]` micro-batch sit, and their sequence boundaries."""

    index: torch.Tensor
    """`[T]` positions of the real tokens in the flattened `[batch * seq]` layout."""
    cu_seqlens: torch.Tensor
    """`[batch + 1]` int32 offsets of each sequence in the packed row."""
    max_len: int
    shape: torch.Size

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor, device: torch.device | None = None) -> Packing:
        """The packing of `attention_mask` `[batch, seq]`, computed where the mask is and held on `device` (default:
        the mask's). From a mask on the host it costs the GPU no wait; on the GPU, `nonzero` waits for the work
        queued before it."""
        lengths = attention_mask.sum(-1, dtype=torch.int32)
        cu_seqlens = nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        index = attention_mask.flatten().nonzero().squeeze(-1)
        device = device or attention_mask.device
        return cls(to_device(index, device), to_device(cu_seqlens, device), int(lengths.max()), attention_mask.shape)

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, ...]` -> `[1, T, ...]` (real tokens only)."""
        return values.flatten(0, 1)[self.index].unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`[1, T, ...]` -> `[batch, seq, ...]`, zeros at padding."""
        flat = packed.new_zeros(self.shape[0] * self.shape[1], *packed.shape[2:])
        return flat.index_copy(0, self.index, packed[0]).view(*self.shape, *packed.shape[2:])


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; from the host to a GPU through pinned memory, a copy that does not wait for the GPU."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def packing_enabled(use_remove_padding: bool | None, device: torch.device) -> bool:
    """`model.use_remove_padding`, where None means: on CUDA devices only."""
    return device.type == "cuda" if use_remove_padding is None else use_remove_padding


def backbone_hidden(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    packed: bool,
    host_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last hidden states `[batch, seq, hidden]` of a HF base model (`model.model`, `base_model`) on a padded
    batch: directly, or (`packed`) on the packed row of real tokens, with zeros at the padding, the packing
    found from `host_mask` (the attention mask on the host) where given."""
    if not packed:
        return backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
    packing = Packing.from_mask(attention_mask if host_mask is None else host_mask, input_ids.device)
    hidden = backbone(
        input_ids=packing.pack(input_ids),
        position_ids=packing.pack(position_ids),
        # a mapping skips the model's mask construction: the packed attention needs none
        attention_mask={"full_attention": None, "sliding_attention": None},
        use_cache=False,
        cu_seq_lens_q=packing.cu_seqlens,
        cu_seq_lens_k=packing.cu_seqlens,
        max_length_q=packing.max_len,
        max_length_k=packing.max_len,
    ).last_hidden_state
    return packing.unpack(hidden)


def use_packed_attention(model: nn.Module) -> None:
    """Switch a HF model (and its sub-configs) to the packed attention function; padded calls (no sequence
    offsets) still run SDPA with the model's mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query` `[1, heads, T, head_dim]`, `key`/`value` `[1, kv_heads, T,
    head_dim]` -> `[1, T, heads, head_dim]`, causal within each sequence of `cu_seq_lens_q`."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if sliding_window is not None:
        raise ValueError(
            "padding-free packing does not support sliding-window attention; set model.use_remove_padding=false"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not dropout and VARLEN_PARAMETERS:
        out = _flash_varlen(q, k, v, cu_seq_lens_q, max_length_q, scaling)
    else:
        out = _sdpa_per_sequence(q, k, v, cu_seq_lens_q.tolist(), scaling, dropout)
    return out.unsqueeze(0), None


def _sdpa_per_sequence(q, k, v, offsets: list[int], scaling: float | None, dropout: float) -> torch.Tensor:
    """Causal SDPA of each sequence on its own; `[T, heads, head_dim]` in and out."""
    outs = []
    for start, end in itertools.pairwise(offsets):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, len, head_dim]
            ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], dim=0) for t in (ks, vs))
            out = nn.functional.scaled_dot_product_attention(
                qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scaling
            )
            outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _flash_varlen(q, k, v, cu_seqlens: torch.Tensor, max_len: int, scaling: float | None) -> torch.Tensor:
    """Variable-length causal flash attention (torch >= 2.10); `[T, heads, head_dim]` in and out."""
    from torch.nn.attention.varlen import varlen_attn

    kwargs = {"window_size": (-1, 0)} if "window_size" in VARLEN_PARAMETERS else {"is_causal": True}
    if "scale" in VARLEN_PARAMETERS:
        kwargs["scale"] = scaling
    if "enable_gqa" in VARLEN_PARAMETERS:
        kwargs["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


def _varlen_parameters() -> frozenset[str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10: no variable-length attention, packed forwards take SDPA per sequence
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


VARLEN_PARAMETERS = _varlen_parameters()
"""The keyword parameters of this torch's `varlen_attn` (they changed between releases); a constant, so that
torch.compile traces the attention call without looking at signatures."""
