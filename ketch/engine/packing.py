"""Padding-free forwards: the real tokens of a micro-batch packed into one row, attention kept per sequence.

A left-padded prompt + right-padded response batch `[batch, seq]` becomes one row of its `T` real tokens with
each sequence's own position ids; the backbone runs on that row and its hidden states go back to the padded
layout, so the heads (log-probs, values, scores) do not change. Attention stays inside each sequence: the
packed attention function registered with transformers as `ketch_packed` runs variable-length flash
attention on CUDA in bf16/fp16 (`torch.nn.attention.varlen`); on the CPU, SDPA of each sequence on its own;
in compiled blocks and on GPUs off the flash path, SDPA over the row under a mask that is causal within each
sequence. Padding then costs nothing in the backbone, whatever the length spread.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ketch.architecture import packing_problem
from ketch.engine.attention_all_to_all import heads_to_tokens, tokens_to_heads

logger = logging.getLogger("ketch.engine")

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


def packs(model: nn.Module, requested: bool) -> bool:
    """Whether `model` (a HF model) runs packed: where it is `requested` and the model can (`packing_problem`).
    A model that cannot runs on padded batches, said once per model class in an INFO line."""
    problem = packing_problem(model) if requested else None
    if problem and type(model).__name__ not in _PADDED:
        _PADDED.add(type(model).__name__)
        logger.info("%s trains on padded batches, not packed: %s", type(model).__name__, problem)
    return requested and problem is None


_PADDED: set[str] = set()
"""The model classes whose fall-back to padded batches has been logged in this process."""


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
        attention_mask=None,  # the packed attention has no mask function: the model builds no mask
        use_cache=False,
        cu_seq_lens_q=packing.cu_seqlens,
        cu_seq_lens_k=packing.cu_seqlens,
        max_length_q=packing.max_len,
        max_length_k=packing.max_len,
    ).last_hidden_state
    return packing.unpack(hidden)


def use_packed_attention(model: nn.Module) -> None:
    """Switch a HF model (and its sub-configs) to the packed attention function. It is registered without a mask
    function, so that transformers builds no attention mask for it (as for any attention that needs none): every
    model then takes packed calls alike, whatever masks (causal, sliding) it would build."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    model.set_attn_implementation(ATTENTION)


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    softcap: float | None = None,
    sequence_parallel_group=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query` `[1, heads, T, head_dim]`, `key`/`value` `[1, kv_heads, T,
    head_dim]` -> `[1, T, heads, head_dim]`, causal within each sequence of `cu_seq_lens_q` and, in a layer with a
    `sliding_window`, over that many tokens (the query's own included). Attention logit soft-capping is not
    supported: `ketch.architecture` keeps such models padded. With a `sequence_parallel_group`, the inputs
    hold this rank's slice of the row's tokens and the attention runs over all of them with this rank's share of
    the heads (`ketch.engine.sequence_parallel`)."""
    if cu_seq_lens_q is None or softcap is not None:
        raise ValueError(
            f"{ATTENTION} attention on {type(module).__name__}: "
            + ("no sequence offsets (call it through backbone_hidden)" if softcap is None else "soft-capped logits")
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, head_dim]
    if sequence_parallel_group is not None:
        q, k, v = heads_to_tokens(q, k, v, sequence_parallel_group)
    flash = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not dropout
    if flash and _varlen_fits(sliding_window, v.shape[-1] == q.shape[-1]):
        out = _flash_varlen(q, k, v, cu_seq_lens_q, max_length_q, scaling, sliding_window)
    elif q.is_cuda or torch.compiler.is_compiling():  # shapes that do not depend on the data: no host reads
        out = _sdpa_masked(q, k, v, cu_seq_lens_q, scaling, dropout, sliding_window)
    else:
        out = _sdpa_per_sequence(q, k, v, cu_seq_lens_q, scaling, dropout, sliding_window)
    if sequence_parallel_group is not None:
        out = tokens_to_heads(out, sequence_parallel_group)
    return out.unsqueeze(0), None


def _sdpa_masked(
    q, k, v, cu_seqlens: torch.Tensor, scaling: float | None, dropout: float, sliding_window: int | None
) -> torch.Tensor:
    """SDPA over the whole packed row under a mask that keeps each token within its own sequence, causal (and in
    its window): `[T, heads, head_dim]` in and out. Its `[T, T]` mask costs memory and time the variable-length
    kernel does not (the square of the row's length), but it has no shapes that depend on the data, so compiled
    blocks trace it and a GPU reads nothing back; eager forwards on the CPU take `_sdpa_per_sequence`."""
    positions = torch.arange(q.shape[0], device=q.device)
    sequence = torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)  # [T]: each token's sequence
    distance = positions[:, None] - positions[None, :]
    mask = (sequence[:, None] == sequence[None, :]) & (distance >= 0)
    if sliding_window is not None:
        mask &= distance < sliding_window
    q, k, v = _heads_first(q, k, v)
    out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(0, 1)


def _sdpa_per_sequence(
    q, k, v, cu_seqlens: torch.Tensor, scaling: float | None, dropout: float, sliding_window: int | None
) -> torch.Tensor:
    """SDPA of each sequence of `cu_seqlens` on its own, causal (and in its window), as `_sdpa_masked` computes
    it: `[T, heads, head_dim]` in and out. It costs the sum of the squared lengths, not the square of their sum
    (a row of 32 sequences of 150 tokens: 32 times less), but it reads the offsets on the host and loops over
    them, so that traced code and GPUs take `_sdpa_masked`."""
    q, k, v = _heads_first(q, k, v)
    lengths, outs = cu_seqlens.diff().tolist(), []
    for qs, ks, vs in zip(*(t.split(lengths, dim=1) for t in (q, k, v)), strict=True):
        mask = None
        if sliding_window is not None and sliding_window < qs.shape[1]:
            distance = torch.arange(qs.shape[1], device=q.device)
            distance = distance[:, None] - distance[None, :]
            mask = (distance >= 0) & (distance < sliding_window)
        outs.append(
            nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling
            )
        )
    return torch.cat(outs, dim=1).transpose(0, 1)


def _heads_first(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[T, heads, head_dim]` query and `[T, kv_heads, head_dim]` keys and values -> `[heads, T, head_dim]` each,
    every key/value head repeated for the query heads that share it."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
    return q, k, v


def _varlen_fits(sliding_window: int | None, same_head_size: bool) -> bool:
    """Whether this torch has variable-length attention for the layer: a window argument where it needs one, and
    values of the queries' head size (multi-head latent attention's differ: masked SDPA takes those)."""
    windowed = sliding_window is None or "window_size" in VARLEN_PARAMETERS
    return bool(VARLEN_PARAMETERS) and windowed and same_head_size


def _flash_varlen(
    q, k, v, cu_seqlens: torch.Tensor, max_len: int, scaling: float | None, sliding_window: int | None
) -> torch.Tensor:
    """Variable-length causal flash attention (torch >= 2.10); `[T, heads, head_dim]` in and out."""
    from torch.nn.attention.varlen import varlen_attn

    if "window_size" in VARLEN_PARAMETERS:  # (keys before the query, keys after it); -1: no limit
        kwargs = {"window_size": (-1 if sliding_window is None else sliding_window - 1, 0)}
    else:
        kwargs = {"is_causal": True}
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
    except ImportError:  # torch < 2.10: no variable-length attention, packed forwards take masked SDPA
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


VARLEN_PARAMETERS = _varlen_parameters()
"""The keyword parameters of this torch's `varlen_attn` (they changed between releases); a constant, so that
torch.compile traces the attention call without looking at signatures."""
