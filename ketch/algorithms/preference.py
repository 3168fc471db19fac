"""Reward-model training on preference pairs: the Bradley–Terry loss and pairwise accuracy.

A pair is the scalar score of the chosen and of the rejected sequence for one prompt. Both functions
take `[pairs]` tensors and, optionally, `num_pairs`, the number of pairs in the whole mini-batch over all
ranks: the result is then this micro-batch's share of the mini-batch mean (its sum divided by
`num_pairs`), so that shares add up exactly, as for the engine's other losses.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, num_pairs: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Mean over pairs of −log σ(r_chosen − r_rejected) (Bradley & Terry 1952; Ouyang et al. 2022).

    `chosen`, `rejected` `[pairs]`; returns a float32 scalar (differentiable)."""
    margin = _margin(chosen, rejected, "bradley_terry_loss")
    return -F.logsigmoid(margin).sum() / _count(margin, num_pairs)


def pairwise_accuracy(
    chosen: torch.Tensor, rejected: torch.Tensor, num_pairs: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Fraction of pairs whose chosen score is above the rejected one; a tie counts one half (so a model
    that scores everything alike gets 0.5, not 0). `chosen`, `rejected` `[pairs]`; returns a float32 scalar."""
    margin = _margin(chosen, rejected, "pairwise_accuracy")
    correct = (margin > 0).to(margin.dtype) + 0.5 * (margin == 0).to(margin.dtype)
    return correct.sum() / _count(margin, num_pairs)


def _margin(chosen: torch.Tensor, rejected: torch.Tensor, who: str) -> torch.Tensor:
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"{who}: chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must both be [pairs]"
        )
    return chosen.float() - rejected.float()


def _count(margin: torch.Tensor, num_pairs: torch.Tensor | float | None) -> torch.Tensor | float:
    if num_pairs is None:
        return max(margin.numel(), 1)
    return torch.as_tensor(num_pairs, dtype=margin.dtype, device=margin.device).clamp(min=1)
