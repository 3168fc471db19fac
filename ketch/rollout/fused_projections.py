"""One matmul where a decoder layer has several over the same input, for the static decoder.

A decode step multiplies a few rows by each weight, so each projection's matmul costs about the same small time
whatever its size: Llama-style layers spend three launches on the query, key and value projections and two on
the MLP's gate and up projections. `fuse_projections` concatenates each group's weights into one tensor and
makes the projections' own parameters views of it: the parameters keep their names, and a weight copied into one
of them (the rollout's weight update) lands in the fused tensor. The attention and MLP modules then become
subclasses whose forward does one matmul per group (in FP8 where `fp8.FP8Projections` gave the group an FP8 copy,
`qkv_fp8` / `gate_up_fp8`) and splits its output. Layers of other architectures keep
their own forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from ketch.architecture import block_attention
from ketch.rollout.decode_attention import cached_attention
from ketch.rollout.fp8 import linear


def fused_attention_forward(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The Llama/Qwen2/Qwen3/Mistral attention on `hidden_states` `[batch, new, hidden]` with one matmul for q, k and
    v (Qwen3 then normalizes each query and key head), through the static decoder's `cached_attention`; returns
    `[batch, new, hidden]`."""
    batch_new = hidden_states.shape[:-1]
    qkv = linear(hidden_states, attention.qkv_weight, attention.qkv_bias, attention.qkv_fp8)
    query, key, value = (part.view(*batch_new, -1, attention.head_dim) for part in qkv.split(attention.qkv_sizes, -1))
    if hasattr(attention, "q_norm"):
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    query, key = attention.rotary(query, key, *position_embeddings)
    out, _ = cached_attention(
        attention, query, key, value, attention_mask, scaling=attention.scaling, **attention.window, **kwargs
    )
    return attention.o_proj(out.reshape(*batch_new, -1).contiguous()), None


def fused_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(act_fn(gate) * up)` with gate and up from one matmul; `x` `[..., hidden]`."""
    gate, up = linear(x, mlp.gate_up_weight, None, mlp.gate_up_fp8).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


class FusedLlamaAttention(llama.LlamaAttention):
    forward, rotary = fused_attention_forward, staticmethod(llama.apply_rotary_pos_emb)


class FusedQwen2Attention(qwen2.Qwen2Attention):
    forward, rotary = fused_attention_forward, staticmethod(qwen2.apply_rotary_pos_emb)


class FusedMistralAttention(mistral.MistralAttention):
    forward, rotary = fused_attention_forward, staticmethod(mistral.apply_rotary_pos_emb)


class FusedQwen3Attention(qwen3.Qwen3Attention):
    forward, rotary = fused_attention_forward, staticmethod(qwen3.apply_rotary_pos_emb)


class FusedLlamaMLP(llama.LlamaMLP):
    forward = fused_mlp_forward


class FusedQwen2MLP(qwen2.Qwen2MLP):
    forward = fused_mlp_forward


class FusedMistralMLP(mistral.MistralMLP):
    forward = fused_mlp_forward


class FusedQwen3MLP(qwen3.Qwen3MLP):
    forward = fused_mlp_forward


ATTENTIONS = {
    llama.LlamaAttention: (FusedLlamaAttention, lambda attention: None),
    qwen2.Qwen2Attention: (FusedQwen2Attention, lambda attention: attention.sliding_window),
    mistral.MistralAttention: (FusedMistralAttention, lambda a: getattr(a.config, "sliding_window", None)),
    qwen3.Qwen3Attention: (FusedQwen3Attention, lambda attention: attention.sliding_window),
}
"""The attention classes whose forward `fused_attention_forward` reproduces: the fused class, and where each
finds its sliding window (Qwen2 and Qwen3 per layer, Mistral the same for every layer, Llama none)."""

MLPS = {
    llama.LlamaMLP: FusedLlamaMLP,
    qwen2.Qwen2MLP: FusedQwen2MLP,
    mistral.MistralMLP: FusedMistralMLP,
    qwen3.Qwen3MLP: FusedQwen3MLP,
}
"""The MLP classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`."""


def fuse_projections(blocks: list[nn.Module]) -> int:
    """Fuse the q/k/v and the gate/up projections of each of `blocks` (decoder layers) whose attention and MLP are
    of the known classes; returns how many groups were fused."""
    fused = 0
    for block in blocks:
        attention, mlp = block_attention(block), getattr(block, "mlp", None)
        projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if type(attention) in ATTENTIONS and len({p.bias is None for p in projections}) == 1:
            fused_class, sliding_window = ATTENTIONS[type(attention)]
            attention.qkv_sizes = [p.weight.shape[0] for p in projections]
            attention.qkv_weight, attention.qkv_bias = _concatenate(projections)
            attention.qkv_fp8 = None
            window = sliding_window(attention)
            attention.window = {} if window is None else {"sliding_window": window}
            attention.__class__ = fused_class
            fused += 1
        if type(mlp) in MLPS and mlp.gate_proj.bias is None and mlp.up_proj.bias is None:
            mlp.gate_up_weight, _ = _concatenate([mlp.gate_proj, mlp.up_proj])
            mlp.gate_up_fp8 = None
            mlp.__class__ = MLPS[type(mlp)]
            fused += 1
    return fused


@torch.no_grad()
def _concatenate(projections: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The projections' weights `[sum of outputs, inputs]` (and biases, where they have them) as one tensor each;
    each projection's parameters become views of its rows."""
    weight = torch.cat([p.weight for p in projections])
    with_bias = projections[0].bias is not None
    bias = torch.cat([p.bias for p in projections]) if with_bias else None
    start = 0
    for p in projections:
        rows = slice(start, start + p.weight.shape[0])
        p.weight = nn.Parameter(weight[rows], requires_grad=False)
        if with_bias:
            p.bias = nn.Parameter(bias[rows], requires_grad=False)
        start = rows.stop
    return weight, bias
