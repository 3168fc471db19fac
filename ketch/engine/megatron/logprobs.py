"""Log-probs and entropy from vocabulary-parallel logits: each tensor-parallel rank holds a slice of the
vocabulary and the full `[tokens x vocab]` logits are never gathered; only per-token sums cross ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
