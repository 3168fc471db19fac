"""Rollout–training mismatch: how far the rollout engine's log-probs are from the training engine's, and
truncated importance sampling (TIS) that corrects the policy gradient for it.

The rollout engine (vLLM, a compiled decode loop, another dtype) samples from π_rollout, which is not quite the
training engine's π_old. TIS (Yao et al. 2025, https://fengyao.notion.site/off-policy-rl) weights each token's
loss by min(π_old/π_rollout, threshold), detached; `sequence` uses one weight per sequence, the product of its
token ratios (unbiased, higher variance).
"""

from __future__ import annotations

import torch

from ketch.algorithms._checks import check_same_shape
from ketch.algorithms.masked import masked_mean

ROLLOUT_IS_LEVELS = ("token", "sequence")
TURN_KINDS = ("tool_turns", "answer_turns")
"""The kinds of turn of a multi-turn response that the mismatch metrics are also given for (`turn_masks`)."""


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float,
) -> torch.Tensor:
    """Truncated importance weights `[batch, response_len]`, detached, 0 at masked tokens.

    `token`: w_t = min(exp(old_log_prob − rollout_log_probs), threshold); `sequence`: every token of a sequence
    gets min(exp(Σ_t (old_log_prob − rollout_log_probs)), threshold). Log-ratios are clamped to ±20 before exp.
    """
    check_same_shape(
        "rollout_is_weights", old_log_prob=old_log_prob, rollout_log_probs=rollout_log_probs, mask=response_mask
    )
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r} (actor.rollout_is); choose token or sequence")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold (actor.rollout_is_threshold) must be > 0, got {threshold}")
    valid = response_mask.bool()
    log_ratio = torch.where(valid, old_log_prob - rollout_log_probs, 0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    weights = log_ratio.clamp(-20, 20).exp().clamp(max=threshold)
    return torch.where(valid, weights, 0).detach()


def rollout_mismatch_terms(
    log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token `[batch, response_len]`, 0 at masked tokens: |p_train − p_rollout| (the probabilities of the
    sampled tokens) and the k3 term exp(d) − d − 1 of KL(π_rollout ‖ π_train), d = log_prob − rollout_log_probs
    clamped to ±20 (the samples come from the rollout)."""
    check_same_shape("rollout_mismatch", log_prob=log_prob, rollout_log_probs=rollout_log_probs, mask=response_mask)
    valid = response_mask.bool()
    diff = torch.where(valid, (log_prob.exp() - rollout_log_probs.exp()).abs(), 0)
    d = torch.where(valid, log_prob - rollout_log_probs, 0).clamp(-20, 20)
    return diff, d.exp() - d - 1


def turn_masks(response_mask: torch.Tensor, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sampled tokens of multi-turn responses `[batch, response_len]` (bool) by kind of turn: `tool_turns`, the
    turns that the environment answered (tool calls: tokens it wrote follow them), and `answer_turns`, each
    response's last turn (all of a single-turn response). `real` is the response's attention mask: 1 on every token
    it holds, the model's (`response_mask` 1) and the environment's (`response_mask` 0)."""
    check_same_shape("turn_masks", response_mask=response_mask, real=real)
    sampled = response_mask.bool()
    answered = (real.bool() & ~sampled).flip(-1).cumsum(-1).flip(-1) > 0  # an environment's token at or after t
    return dict(zip(TURN_KINDS, (sampled & answered, sampled & ~answered), strict=True))


def rollout_mismatch_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    real: torch.Tensor | None = None,
) -> dict[str, float]:
    """How the rollout engine's token probabilities differ from the training engine's, over valid tokens.

    `training/rollout_probs_diff_max` / `_mean`: max and mean of |p_train − p_rollout| (as verl logs them);
    `training/rollout_kl`: the mean k3 estimate of KL(π_rollout ‖ π_train) per token (`rollout_mismatch_terms`).
    Given `real` (the response's attention mask) and a response with a turn the environment answered, also the
    max and mean per kind of turn (`turn_masks`): `training/rollout_probs_diff_max/tool_turns`, `.../answer_turns`
    and the same of `_mean`.
    """
    valid = response_mask.bool()
    if not valid.any():
        return {}
    diff, kl = rollout_mismatch_terms(old_log_prob, rollout_log_probs, response_mask)
    metrics = {
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": masked_mean(diff, valid).item(),
        "training/rollout_kl": masked_mean(kl, valid).item(),
    }
    turns = turn_masks(response_mask, real) if real is not None else {}
    if turns and turns["tool_turns"].any():
        for kind, mask in turns.items():
            if mask.any():
                metrics[f"training/rollout_probs_diff_max/{kind}"] = diff[mask].max().item()
                metrics[f"training/rollout_probs_diff_mean/{kind}"] = masked_mean(diff, mask).item()
    return metrics
