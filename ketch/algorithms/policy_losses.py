"""The policy-loss registry (`actor.policy_loss`) and the losses beyond PPO's: GSPO, GSPO-token and CISPO.

A registered loss is called as `fn(old_log_prob, log_prob, advantages, response_mask, **settings)` with
`[batch, response_len]` tensors and the keyword settings `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`,
`gspo_clip_ratio_low`, `gspo_clip_ratio_high`, `loss_agg_mode`, `num_tokens`, `num_seqs`, `norm_constant` and
`rollout_is_weights`; each loss takes what it needs. It returns `(loss, metrics)`, metrics being detached scalars
`pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl` (the log-ratio clamped to ±20).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ketch.algorithms._checks import check_same_shape
from ketch.algorithms.ppo_losses import agg_loss, clip_metrics, policy_loss, weighted
from ketch.registry import POLICY_LOSSES

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
Count = int | float | torch.Tensor | None


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss with the calling convention described in this module.

    Args:
        name: The name `actor.policy_loss` selects it by.

    Returns:
        A decorator that registers `fn` and returns it unchanged.

    Raises:
        ValueError: When the decorator is applied, if `name` is already registered.
    """

    def decorate(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.add(name, fn)
        return fn

    return decorate


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`.

    Args:
        name: A registered loss's name (`actor.policy_loss`).

    Returns:
        The loss function, `fn(old_log_prob, log_prob, advantages, response_mask, **settings) -> (loss, metrics)`.

    Raises:
        ValueError: If no loss is registered as `name` (the message lists those that are).
    """
    return POLICY_LOSSES.get(name)


def policy_loss_names() -> list[str]:
    """The names of the registered policy losses.

    Returns:
        The names, sorted.
    """
    return POLICY_LOSSES.names()


@register_policy_loss("vanilla")
def _vanilla(old_log_prob, log_prob, advantages, response_mask, **settings):
    keep = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "num_tokens", "num_seqs")
    keep += ("norm_constant", "rollout_is_weights")
    return policy_loss(
        old_log_prob, log_prob, advantages, response_mask, **{k: v for k, v in settings.items() if k in keep}
    )


def _sequence_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log s_i = mean over a sequence's valid tokens of log_prob − old_log_prob, `[batch]`, clamped to ±20."""
    token_log_ratio = torch.where(valid, log_prob - old_log_prob, 0)
    return (token_log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)).clamp(-20, 20)


@register_policy_loss("gspo")
def gspo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gspo_clip_ratio_low: float = 3e-4,
    gspo_clip_ratio_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_constant: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, sequence level (Zheng et al. 2025, https://arxiv.org/abs/2507.18071).

    s_i = exp(mean_t(log_prob − old_log_prob)) over the valid tokens of sequence i (the length-normalised
    sequence likelihood ratio), A_i the mean of its advantages, and the sequence's loss
    max(−A_i·s_i, −A_i·clip(s_i, 1 − gspo_clip_ratio_low, 1 + gspo_clip_ratio_high)); the paper's range is
    3e-4 / 4e-4 because s_i is a per-token geometric mean. The loss is put on every valid token of its sequence
    and reduced by `agg_loss`: `seq-mean-token-mean` gives the paper's (1/G)·Σ_i. `pg_clipfrac` counts the
    valid tokens of clipped sequences.
    """
    check_same_shape("gspo", old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, mask=response_mask)
    valid = response_mask.bool()
    seq_ratio = _sequence_log_ratio(old_log_prob, log_prob, valid).exp()
    seq_advantage = torch.where(valid, advantages, 0).sum(-1) / valid.sum(-1).clamp(min=1)
    unclipped = -seq_advantage * seq_ratio
    clipped = -seq_advantage * seq_ratio.clamp(1 - gspo_clip_ratio_low, 1 + gspo_clip_ratio_high)
    loss_mat = weighted(torch.maximum(unclipped, clipped)[:, None].expand_as(log_prob), rollout_is_weights)
    loss = agg_loss(loss_mat, valid, loss_agg_mode, num_tokens, num_seqs, norm_constant)
    took_clip = (clipped > unclipped)[:, None].expand_as(valid)
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0).clamp(-20, 20)
    return loss, clip_metrics(took_clip, torch.zeros_like(valid), log_ratio, valid)


@register_policy_loss("gspo_token")
def gspo_token_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gspo_clip_ratio_low: float = 3e-4,
    gspo_clip_ratio_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_constant: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, https://arxiv.org/abs/2507.18071, eq. 13): per-token advantages A_i,t.

    s_i,t = sg[s_i]·π(y_i,t)/sg[π(y_i,t)] has the value of the sequence ratio s_i and the gradient of the
    token's own log-prob; the per-token loss max(−A_i,t·s_i,t, −A_i,t·clip(s_i,t)) is reduced by `agg_loss`.
    With one advantage per sequence and `seq-mean-token-mean` it equals `gspo` in value and gradient.
    """
    check_same_shape(
        "gspo_token", old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, mask=response_mask
    )
    valid = response_mask.bool()
    seq_log_ratio = _sequence_log_ratio(old_log_prob, log_prob, valid).detach()
    own = torch.where(valid, log_prob, 0)
    ratio = (seq_log_ratio[:, None] + own - own.detach()).exp()
    advantages = torch.where(valid, advantages, 0)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - gspo_clip_ratio_low, 1 + gspo_clip_ratio_high)
    loss_mat = weighted(torch.maximum(unclipped, clipped), rollout_is_weights)
    loss = agg_loss(loss_mat, valid, loss_agg_mode, num_tokens, num_seqs, norm_constant)
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0).clamp(-20, 20)
    return loss, clip_metrics(clipped > unclipped, torch.zeros_like(valid), log_ratio, valid)


@register_policy_loss("cispo")
def cispo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_constant: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the importance weight, not the update.

    Per token the loss is −sg[clip(r, 1 − clip_ratio_low, 1 + clip_ratio_high)]·A·log_prob with
    r = exp(clamp(log_prob − old_log_prob, ±20)): every token keeps a gradient A·r̂·∇log π (PPO drops the
    gradient of clipped tokens), and the weight r̂ is bounded. The paper sets no lower bound in effect (a large
    clip_ratio_low) and tunes clip_ratio_high. `pg_clipfrac` counts the tokens whose weight was clipped.
    """
    check_same_shape("cispo", old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, mask=response_mask)
    valid = response_mask.bool()
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0).clamp(-20, 20)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    loss_mat = -weight * torch.where(valid, advantages, 0) * torch.where(valid, log_prob, 0)
    loss = agg_loss(weighted(loss_mat, rollout_is_weights), valid, loss_agg_mode, num_tokens, num_seqs, norm_constant)
    return loss, clip_metrics(weight != ratio, torch.zeros_like(valid), log_ratio, valid)
