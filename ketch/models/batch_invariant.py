"""Batch-invariant forwards (`rollout.exact_log_probs`): a token's results do not depend on how many rows or keys
are computed with it, so the rollout's one-token decode steps and the training forward over whole sequences give the
same log-probs, bit for bit.

A kernel's reduction order depends on the shapes it is given: on the CPU a matmul of 1 to 3 rows takes another code
path than one of 8, a sum over one row of a 152k vocabulary is split over threads where one over many rows is not,
and SiLU's vectorised loop leaves the last elements of a tensor to a scalar formula. Each reduction here therefore
runs in an op of one fixed shape on both sides: projections multiply blocks of `ROWS` rows (`linear`); attention
walks the keys in blocks of `KEYS` from the first, each block's scores and weighted values in `[ROWS, KEYS]` matmuls,
merged by an online softmax in the same order for a decode step over its cache and a forward over the sequence
(`attention`); SiLU is `x / (1 + exp(-x))`, whose ops round each element alike wherever it sits. A mixture of
experts (Qwen3-MoE's layout: a top-k router, experts as 3D tensors) routes through `linear` and runs each expert's
tokens through `linear`, adding the experts' outputs to a token in the experts' order (`_router_forward`,
`_experts_forward`). What is left is
invariant as it stands (measured, `tests/test_exact_log_probs.py`): the norms' mean over one row of the hidden size,
the log-softmax over the vocabulary (one row per thread), the rotary cos/sin of a position, and elementwise
arithmetic. On CUDA (and under Triton's interpreter: `on_kernels`) the projections, the RMSNorms, the rotary
embedding and attention run Triton kernels instead, the same for both sides (`invariant_matmul.py`,
`invariant_norm.py`, `invariant_rotary.py`, `invariant_attention.py`), whose rows' arithmetic does not depend on
the other rows."""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from torch.nn import functional as F

from ketch.architecture import batch_invariant_problem

ATTENTION = "ketch_batch_invariant"
"""The attention implementation name batch-invariant models are switched to."""
ROWS = 16
"""Rows per block of every matmul: the fewest at which the CPU's matmul takes its general path."""
KEYS = 64
"""Keys per block of attention."""


def on_kernels(tensor: torch.Tensor) -> bool:
    """Whether the batch-invariant Triton kernels compute for `tensor`: on CUDA, and on the CPU under Triton's
    interpreter (`TRITON_INTERPRET=1`: how the CPU tests run the GPU's path)."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _blocks(rows: torch.Tensor) -> torch.Tensor:
    """`[n, width]` zero-padded to a multiple of `ROWS` rows, as `[blocks, ROWS, width]`."""
    return F.pad(rows, (0, 0, 0, -rows.shape[0] % ROWS)).view(-1, ROWS, rows.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, `[..., in]` -> `[..., out]`, each row computed in a `[ROWS, in] @ [in, out]` matmul."""
    return _BlockLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


class _BlockLinear(torch.autograd.Function):
    """`rows @ weight.T + bias`, `[n, in]` -> `[n, out]`, forward in blocks of `ROWS` rows against one `weight`
    shared (not copied) by every block, the bias (or None) added after (with the kernels, `on_kernels`:
    `invariant_matmul`, a Triton kernel of fixed tiles that adds the bias before its one rounding). The backward
    needs no batch invariance (only forward results are compared) and runs as plain matmuls: autograd's own
    backward of the shared weight would make a `[blocks, in, out]` gradient before summing it, 9 GB a projection for
    8k tokens of a 0.5B model."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        if on_kernels(rows):  # one Triton kernel of fixed tiles (`invariant_matmul.py`)
            from ketch.models.invariant_matmul import invariant_matmul

            return invariant_matmul(rows.contiguous(), weight.contiguous(), bias)
        blocks = _blocks(rows)
        out = torch.bmm(blocks, weight.T.expand(blocks.shape[0], *weight.T.shape)).flatten(0, 1)[: rows.shape[0]]
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.T @ rows if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU, the same for an element wherever it sits in `x`: on CUDA torch's (one formula for every element, one
    launch), elsewhere `x / (1 + exp(-x))` (the CPU's SiLU leaves the last elements of its vectorised loop to
    another formula)."""
    return F.silu(x) if x.is_cuda else x / (1 + torch.exp(-x))


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query` `[batch, heads, q_len, head_dim]`, `key`/`value` `[batch, kv_heads,
    kv_len, head_dim]`, `attention_mask` `[batch, 1, q_len, kv_len]` (True: attend) -> `[batch, q_len, heads,
    head_dim]`. With the kernels (`on_kernels`): `invariant_attention.TrainingAttention` (each query over its row's
    real keys up to its own, `kwargs`' `sliding_window` honoured, one Triton kernel). Elsewhere: each row's keys
    that some query attends (not padding) are moved to the front, so that a sequence's keys fall into the same
    blocks however far it is padded; each query then walks them in blocks of `KEYS` with an online softmax. A
    block wholly masked leaves the running sums as they were, so a decode step over its cache and a forward over the
    whole sequence (whose later keys are masked) compute each query alike. A query with no key to attend gives
    zeros."""
    if dropout or kwargs.get("softcap") is not None or attention_mask is None:
        raise ValueError(f"{ATTENTION} attention on {type(module).__name__}: dropout, soft-capping or no mask")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if on_kernels(query):  # one Triton kernel, the decoder's too (`invariant_attention.py`)
        from ketch.models.invariant_attention import TrainingAttention

        real = attention_mask[:, 0].any(1)
        return TrainingAttention.apply(query, key, value, real, scale, kwargs.get("sliding_window")), None
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    rows = heads // kv_heads * q_len  # the queries of the heads that share a key head, as rows of one matmul
    mask = attention_mask[:, 0].expand(batch, q_len, -1)
    order = torch.sort((~mask.any(1)).byte(), dim=-1, stable=True).indices  # [batch, kv_len]: real keys first
    key, value = (t.gather(2, order[:, None, :, None].expand_as(t)) for t in (key, value))
    mask = mask.gather(-1, order[:, None].expand_as(mask))
    mask = mask[:, None].expand(-1, heads // kv_heads, -1, -1).reshape(batch, rows, -1)
    pad_q, pad_k = -rows % ROWS, -key.shape[2] % KEYS
    q = F.pad(query.reshape(batch, kv_heads, rows, head_dim), (0, 0, 0, pad_q))
    q = q.view(batch, kv_heads, -1, ROWS, head_dim)
    key, value = (F.pad(t, (0, 0, 0, pad_k)) for t in (key, value))
    mask = F.pad(mask, (0, pad_k, 0, pad_q)).view(batch, 1, q.shape[2], ROWS, -1)
    out = _walk_keys(q, key, value, mask, scale)
    out = out.flatten(2, 3)[:, :, :rows].reshape(batch, heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous(), None


def _walk_keys(q, key, value, mask, scale: float) -> torch.Tensor:
    """The online softmax over key blocks: `q` `[batch, kv_heads, q_blocks, ROWS, d]`, `key`/`value` `[batch,
    kv_heads, keys, d]` (keys a multiple of `KEYS`), `mask` `[batch, 1, q_blocks, ROWS, keys]` -> like `q`."""
    blocks = q.shape[2]
    flat_q = q.flatten(0, 2)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, a, b] -> [batch * kv_heads * blocks, a, b]
        return t[:, :, None].expand(-1, -1, blocks, -1, -1).flatten(0, 2)

    peak = q.new_full(q.shape[:-1], float("-inf"))
    total, acc = q.new_zeros(q.shape[:-1]), torch.zeros_like(q)
    for start in range(0, key.shape[2], KEYS):
        k, v = (t[:, :, start : start + KEYS] for t in (key, value))
        scores = torch.bmm(flat_q, per_block(k.transpose(2, 3))).view(*q.shape[:-1], KEYS)
        scores = (scores * scale).masked_fill(~mask[..., start : start + KEYS], float("-inf"))
        new_peak = torch.maximum(peak, scores.amax(-1))
        shift = torch.where(new_peak == float("-inf"), 0.0, new_peak)
        weights = torch.exp(scores - shift[..., None])
        rescale = torch.exp(peak - shift)
        total = total * rescale + weights.sum(-1)
        weighted = torch.bmm(weights.flatten(0, 2), per_block(v)).view_as(acc)
        acc = acc * rescale[..., None] + weighted
        peak = new_peak
    return acc / torch.where(total > 0, total, 1.0)[..., None]


def label_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, calc_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` `[...]` under `logits` `[..., vocab]` / `temperature`, in float32, each row's
    log-softmax on its own (the rollout's and the training forward's the same op); entropy `[...]` too with
    `calc_entropy`, else None."""
    log_softmax = (logits.float() / temperature).log_softmax(-1)
    log_prob = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not calc_entropy:
        return log_prob, None
    return log_prob, -(log_softmax.exp() * log_softmax).sum(-1)


def _router_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k router (`weight` `[experts, hidden]`): `[tokens, hidden]` -> router logits `[tokens, experts]`, the
    chosen experts' weights and indices `[tokens, top_k]`, as transformers' Qwen3-MoE router gives them."""
    logits = linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, index = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Experts as 3D tensors (`gate_up_proj` `[experts, 2 x width, hidden]`, `down_proj` `[experts, hidden,
    width]`): `[tokens, hidden]` routed to `top_k_index` `[tokens, top_k]` with `top_k_weights` -> `[tokens,
    hidden]`. Each expert's tokens go through `linear`; a token's outputs add up in the experts' order."""
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():  # ascending
        token, slot = torch.where(top_k_index == expert)
        gate, up = linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
        routed = linear(self.act_fn(gate) * up, self.down_proj[expert]) * top_k_weights[token, slot, None]
        out.index_add_(0, token, routed.to(out.dtype))
    return out


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Llama/Qwen RMSNorm: with the kernels (`on_kernels`) `invariant_norm.InvariantRMSNorm` (one program a row);
    elsewhere the class's own forward (invariant on the CPU as it stands)."""
    if on_kernels(hidden_states):
        from ketch.models.invariant_norm import InvariantRMSNorm

        return InvariantRMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)
    return self.own_forward(hidden_states)


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """A Llama/Qwen2/Qwen3 attention layer (`[batch, length, hidden]` -> `[batch, length, hidden]` and the
    interface's weights): with the kernels (`on_kernels`) transformers' forward with the rotary embedding in one
    launch for the query and one for the key (`invariant_rotary.Rotary`); elsewhere the class's own forward."""
    if not on_kernels(hidden_states):
        return self.own_forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ketch.models.invariant_rotary import Rotary

    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query, key, value = (proj(hidden_states).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
    if hasattr(self, "q_norm"):  # Qwen3's per-head norms
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = (Rotary.apply(t.transpose(1, 2), *position_embeddings) for t in (query, key))
    value = value.transpose(1, 2)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    out, weights = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation](
        self, query, key, value, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling, sliding_window=getattr(self, "sliding_window", None), **kwargs,
    )  # fmt: skip
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


_FORWARDS = {
    "Qwen3MoeTopKRouter": _router_forward,
    "Qwen3MoeExperts": _experts_forward,
    **dict.fromkeys(("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm"), _rms_norm_forward),
    **dict.fromkeys(("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "Qwen3MoeAttention"), _attention_forward),
}
"""The modules switched, by class name, to their batch-invariant forward: a mixture of experts' router and experts,
the RMSNorms, the attention layers."""


@functools.cache
def _batch_invariant_class(cls: type) -> type:
    """A subclass of `cls` (so that transformers' output recorders still find its instances) with its
    batch-invariant forward, and `cls`'s as `own_forward`."""
    return type(
        f"BatchInvariant{cls.__name__}", (cls,), {"forward": _FORWARDS[cls.__name__], "own_forward": cls.forward}
    )


class BatchInvariantLinear(nn.Linear):
    """`nn.Linear` through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class BatchInvariantSiLU(nn.Module):
    """SiLU through `silu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Switch a HF causal LM to batch-invariant ops in place: its linear layers (the output projection among them)
    to `BatchInvariantLinear`, its SiLU activations to `BatchInvariantSiLU`, a mixture's router and experts and its
    RMSNorms to their batch-invariant forwards, its attention to `attention` under a boolean mask. Raises
    ValueError for a model `architecture.batch_invariant_problem` refuses."""
    from transformers import AttentionInterface, AttentionMaskInterface

    if problem := batch_invariant_problem(model.config):
        raise ValueError(f"rollout.exact_log_probs=true: {problem}")
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                child.__class__ = BatchInvariantLinear
            elif type(child).__name__ in ("SiLU", "SiLUActivation"):
                setattr(parent, name, BatchInvariantSiLU())
            elif type(child).__name__ in _FORWARDS:
                child.__class__ = _batch_invariant_class(type(child))
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, boolean_mask)
    model.set_attn_implementation(ATTENTION)
    return model


def boolean_mask(*args, **kwargs) -> torch.Tensor:
    """transformers' SDPA mask, `[batch, 1, q_len, kv_len]` booleans, always built (never skipped as causal)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **(kwargs | {"allow_is_causal_skip": False}))
