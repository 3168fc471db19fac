"""Per-token losses of PPO-style training and their reduction to a scalar.

`agg_loss` reduces a `[batch, response_len]` loss under a mask. Passing the GLOBAL `num_tokens` / `num_seqs`
of a whole mini-batch to each micro-batch makes the micro-batch losses sum exactly to the mini-batch loss,
so gradients do not depend on how the mini-batch is split.
"""

from __future__ import annotations

import torch

from ketch.algorithms._checks import check_same_shape
from ketch.algorithms.masked import masked_mean

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: `[..., vocab]` → `[...]`, as logsumexp − Σ p·logits.

    The logits are shifted by their max first (the entropy does not change) so large logits lose no precision.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    return torch.logsumexp(shifted, dim=-1) - (torch.softmax(shifted, dim=-1) * shifted).sum(-1)


def _count(given: int | float | torch.Tensor | None, default: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The divisor: `given` (a global count) or `default`; below 1 it is 1, so an empty batch gives 0, not NaN."""
    count = default if given is None else given
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce `loss_mat` `[batch, response_len]` over the valid tokens of `loss_mask` to a scalar.

    - `token-mean`: Σ loss / num_tokens (default: the valid tokens here).
    - `seq-mean-token-sum`: Σ over sequences of each sequence's token sum, / num_seqs.
    - `seq-mean-token-mean`: Σ over sequences of each sequence's token mean, / num_seqs.
    - `seq-mean-token-sum-norm` (Dr. GRPO): Σ over sequences of token sum / norm_constant (default
      `response_len`, the padded length), / num_seqs.
    num_seqs defaults to the rows with at least one valid token, as in verl's namesake (0.9.1 on) and as the engines
    pass it for a whole mini-batch: a row whose every token is masked (a filtered or cut-off response) adds nothing
    to the sum and is not counted in the mean.
    """
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {', '.join(AGG_MODES)}")
    mask = loss_mask.bool()
    masked = torch.where(mask, loss_mat, 0)
    if loss_agg_mode == "token-mean":
        return masked.sum() / _count(num_tokens, mask.sum(), masked)
    seq_sums, seq_tokens = masked.sum(-1), mask.sum(-1)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = seq_sums / seq_tokens.clamp(min=1)
    else:
        per_seq = seq_sums / (loss_mat.shape[-1] if norm_constant is None else norm_constant)
    return per_seq.sum() / _count(num_seqs, mask.any(-1).sum(), masked)


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_constant: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with range [1 − low, 1 + high] and optional dual clip.

    Per token, r = exp(clamp(log_prob − old_log_prob, −20, 20)) and loss = max(−A·r, −A·clip(r)); with
    `clip_ratio_c` (> 1, Ye et al. 2020) the loss of a negative advantage is capped at −A·clip_ratio_c.
    `rollout_is_weights` (detached, `[batch, response_len]`) multiply the per-token loss (truncated importance
    sampling against the rollout engine). Inputs are `[batch, response_len]`; the loss is reduced by `agg_loss`.
    Metrics (detached scalars): `pg_clipfrac` (valid tokens where the clipped term is larger than the
    unclipped one), `pg_clipfrac_lower` (where the dual-clip cap was taken) and `ppo_kl` (masked mean of
    old_log_prob − log_prob, the log-ratio clamped to ±20), as verl computes them.
    """
    check_same_shape(
        "policy_loss", old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
    )
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c (actor.clip_ratio_c) must be > 1 for dual clip, or None; got {clip_ratio_c}")
    valid = response_mask.bool()
    # masked tokens contribute nothing, not even a NaN gradient from garbage in their padding
    log_ratio = torch.where(valid, log_prob - old_log_prob, 0).clamp(-20, 20)
    advantages = torch.where(valid, advantages, 0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    took_dual = torch.zeros_like(valid)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        took_dual = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(took_dual, cap, loss_mat)
    loss_mat = weighted(loss_mat, rollout_is_weights)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, num_tokens, num_seqs, norm_constant)
    return loss, clip_metrics(clipped > unclipped, took_dual, log_ratio, valid)


def weighted(loss_mat: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """`loss_mat` times the detached importance weights `[batch, response_len]`, or unchanged when None."""
    return loss_mat if rollout_is_weights is None else loss_mat * rollout_is_weights.detach()


def clip_metrics(
    took_clip: torch.Tensor, took_dual: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl` (−log-ratio) as masked means over the valid tokens."""
    return {
        "pg_clipfrac": masked_mean(took_clip.float(), valid),
        "pg_clipfrac_lower": masked_mean(took_dual.float(), valid),
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
    }


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`policy_loss` under verl's name and calling convention: `(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`.

    `cliprange_low`/`cliprange_high` default to `cliprange`; dual clip is always on (`clip_ratio_c`, default 3).
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high")
    loss, m = policy_loss(old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c, loss_agg_mode)
    return loss, m["pg_clipfrac"], m["ppo_kl"], m["pg_clipfrac_lower"]


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ½·max((v − R)², (clip(v, old ± c) − R)²), reduced by `agg_loss`.

    Inputs are `[batch, response_len]`. Metrics: `vf_clipfrac`, the fraction of valid tokens where the
    clipped term was the larger one.
    """
    check_same_shape("value_loss", vpreds=vpreds, returns=returns, old_values=old_values, response_mask=response_mask)
    valid = response_mask.bool()
    returns, old_values = torch.where(valid, returns, 0), torch.where(valid, old_values, 0)
    vpreds_clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped, clipped = (vpreds - returns).square(), (vpreds_clipped - returns).square()
    loss_mat = 0.5 * torch.maximum(unclipped, clipped)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, num_tokens, num_seqs, norm_constant)
    return loss, {"vf_clipfrac": masked_mean((clipped > unclipped).float(), valid)}
