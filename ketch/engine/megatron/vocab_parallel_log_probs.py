"""Log-probs and entropy from vocabulary-parallel logits: each tensor-parallel rank holds a slice of the
vocabulary and the full `[tokens x vocab]` logits are never gathered; only per-token sums cross ranks.
`chunked_vocab_parallel_log_probs` also projects the hidden states onto the slice a chunk of tokens at a time,
so that not even one rank's `[tokens x vocab / tp]` logits exist whole."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ketch.engine.fused_log_probs import LOGIT_CHUNK


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: the loss downstream is the same on every rank of the group,
    so each rank's local term receives the gradient of the sum unchanged."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        tensor = tensor.clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_ranks(tensor: torch.Tensor, group=None) -> torch.Tensor:
    return _SumOverRanks.apply(tensor, group)


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward, all-reduce (sum) of the gradient backward: a tensor replicated over the group whose
    ranks each compute part of the loss gets the gradient of the whole. (Megatron's
    `copy_to_tensor_model_parallel_region` does this only for a contiguous gradient: it reduces a contiguous
    copy and returns the original, so a transposed one, as GPTModel's `[batch, seq]` output gives it, was
    left unsummed.)"""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        if dist.is_initialized() and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_ranks(tensor: torch.Tensor, group=None) -> torch.Tensor:
    return _SumGradOverRanks.apply(tensor, group)


def vocab_parallel_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group=None, calc_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `labels` `[...]` (and the entropy) under softmax over the whole vocabulary, from this rank's
    logits `[..., vocab / tp]` covering token ids `vocab_start ..`; float32 results `[...]`, differentiable."""
    logits = logits.float()
    peak = logits.detach().amax(-1, keepdim=True)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak
    exp = shifted.exp()
    sum_exp = sum_over_ranks(exp.sum(-1), group)
    local = labels - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    log_prob = sum_over_ranks(picked, group) - sum_exp.log()
    if not calc_entropy:
        return log_prob, None
    mean_shifted = sum_over_ranks((exp * shifted).sum(-1), group) / sum_exp
    return log_prob, sum_exp.log() - mean_shifted


def chunked_vocab_parallel_log_probs(
    states: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    vocab_start: int,
    group=None,
    temperature: float = 1.0,
    calc_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    chunk: int = LOGIT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `labels` `[tokens]` (and entropy) from hidden `states` `[tokens, hidden]` and this rank's
    slice `weight` `[vocab / tp, hidden]` of the output layer (token ids `vocab_start ..`), for logits divided by
    `temperature`; float32 results `[tokens]`. `chunk` tokens at a time; under autograd each chunk's logits are
    recomputed in the backward pass instead of kept. `compute_dtype`: the projection's autocast dtype (as in
    the model's forward), None for none."""
    log_probs, entropies = [], []
    for start in range(0, max(len(states), 1), chunk):  # an empty input still gives (empty) outputs
        args = (states[start : start + chunk], labels[start : start + chunk], weight, vocab_start, group)
        args += (temperature, calc_entropy, compute_dtype)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args)
        log_probs.append(lp)
        entropies.append(ent)
    return torch.cat(log_probs), torch.cat(entropies) if calc_entropy else None


def _chunk(states, labels, weight, vocab_start, group, temperature, calc_entropy, compute_dtype):
    with torch.autocast(states.device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
        logits = torch.nn.functional.linear(states, weight)
    log_prob, entropy = vocab_parallel_log_probs(logits.float() / temperature, labels, vocab_start, group, calc_entropy)
    return log_prob, entropy if calc_entropy else log_prob.new_zeros(0)
