"""Advantage estimators (GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, ReMax) and their registry.

Inputs are `[batch, response_len]` tensors with a `response_mask` that is 1 for real response tokens and 0
for padding, which may sit anywhere in a row. A masked token is skipped as if it did not exist: its reward
and value are ignored and it gets advantage 0 and return 0. Each estimator returns `(advantages, returns)`.

Registered estimators share one calling convention, `fn(token_level_rewards, response_mask, **context)`,
where `context` holds `values`, `group_ids`, `reward_baselines`, `gamma`, `lam` and
`norm_adv_by_std_in_grpo` (any of them may be None); each takes what it needs.

Functions named after verl's (`compute_gae_advantage_return`, `compute_grpo_outcome_advantage`,
`compute_reinforce_pp_advantage`, `compute_reinforce_pp_baseline_advantage`) return the numbers verl's namesakes
return for the same inputs at valid tokens (verl leaves arbitrary values at masked tokens; here they are 0).
The others (`compute_gae`, `compute_grpo_advantage`, ...) are ketch's building blocks, not whitened.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ketch.algorithms._checks import check_same_shape
from ketch.algorithms.masked import masked_whiten
from ketch.registry import ADV_ESTIMATORS

GroupIds = Sequence[Hashable] | np.ndarray | torch.Tensor
EstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- token-level estimators
def compute_gae(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016), not whitened.

    δ_t = r_t + γ·V(next valid token) − V_t and A_t = δ_t + γλ·A(next valid token), where the value after the
    last valid token is 0 (the episode ends). Returns `(advantages, returns)`, both `[batch, response_len]`,
    with returns = advantages + values at valid tokens and 0 elsewhere.
    """
    check_same_shape("compute_gae", token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    mask = response_mask.bool()
    dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
    rewards, values = token_level_rewards.to(dtype), values.to(dtype)
    next_value = torch.zeros_like(values[:, 0])
    carried = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(values.shape[-1])):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * carried
        carried = torch.where(valid, advantage, carried)
        next_value = torch.where(valid, values[:, t], next_value)
        columns.append(torch.where(valid, advantage, 0))
    advantages = torch.stack(columns[::-1], dim=-1)
    return advantages, torch.where(mask, advantages + values, 0)


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE as verl's namesake returns it: advantages whitened over the valid tokens, returns = raw GAE + values.

    Shapes `[batch, response_len]`; both are 0 at masked tokens.
    """
    advantages, returns = compute_gae(token_level_rewards, values, response_mask, gamma, lam)
    return masked_whiten(advantages, response_mask), returns


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go G_t = r_t + γ·G(next valid token) per row, `[batch, response_len]`, 0 at masked tokens.

    This is GAE with all values 0 and λ = 1.
    """
    return compute_gae(token_level_rewards, torch.zeros_like(token_level_rewards), response_mask, gamma, 1.0)[0]


def compute_reinforce_pp_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262): the discounted return-to-go, whitened over the
    batch's valid tokens (no baseline, no critic).

    Returns `(advantages, returns)` `[batch, response_len]`: the whitened and the raw return-to-go, 0 at masked
    tokens. (verl's namesake restarts the return at a masked token inside a row; here a masked token is skipped,
    so rows whose padding is only at the end give the same numbers.)
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


def compute_remax_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go (γ = 1) minus the reward of the greedy response.

    `reward_baselines` is `[batch]`. Returns `(advantages, returns)` `[batch, response_len]` with returns the
    return-to-go; both are 0 at masked tokens.
    """
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"compute_remax_advantage: reward_baselines has shape {tuple(reward_baselines.shape)}, "
            f"expected [batch] = {tuple(token_level_rewards.shape[:1])} (one greedy reward per sequence)"
        )
    returns = discounted_returns(token_level_rewards, response_mask, 1.0)
    advantages = torch.where(response_mask.bool(), returns - reward_baselines[:, None], 0)
    return advantages, returns


# ----------------------------------------------------------------------------- group estimators
class _GroupStats(NamedTuple):
    """Per sequence, all `[batch]`: its score, deviation from its group's mean, group size and group std."""

    scores: torch.Tensor
    centered: torch.Tensor
    size: torch.Tensor
    std: torch.Tensor


def _group_index(group_ids: GroupIds, batch_size: int, device: torch.device) -> torch.Tensor:
    """`[batch]` long tensor numbering the distinct group ids 0, 1, ... in order of first appearance."""
    ids = group_ids.tolist() if isinstance(group_ids, np.ndarray | torch.Tensor) else list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch_size} sequences; give one per row")
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(g, len(numbers)) for g in ids], dtype=torch.long, device=device)


def _group_stats(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds) -> _GroupStats:
    """Scores (sums of valid token rewards) and their group statistics; the std is unbiased (0 for a group of one).

    The deviation is exactly 0 in a group whose scores are all equal (no rounding residue from the mean).
    """
    check_same_shape("group advantage", token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = torch.where(response_mask.bool(), token_level_rewards, 0).sum(-1)
    index = _group_index(group_ids, scores.shape[0], scores.device)
    empty = scores.new_zeros(int(index.max()) + 1 if index.numel() else 0)

    def per_group(values: torch.Tensor, reduce: str) -> torch.Tensor:
        return empty.scatter_reduce(0, index, values, reduce, include_self=False)[index]

    size = per_group(torch.ones_like(scores), "sum")
    constant = per_group(scores, "amax") == per_group(scores, "amin")
    centered = torch.where(constant, 0, scores - per_group(scores, "sum") / size)
    std = (per_group(centered.square(), "sum") / (size - 1).clamp(min=1)).sqrt()
    return _GroupStats(scores, centered, size, std)


def _broadcast(advantages: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence `[batch]` advantages spread over the valid tokens: `(advantages, returns)`, both equal."""
    per_token = torch.where(response_mask.bool(), advantages[:, None], 0)
    return per_token, per_token


def compute_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): (score − group mean) / (group std + eps), broadcast over valid tokens.

    https://arxiv.org/abs/2402.03300. The score is the sum of a sequence's valid token rewards; the std is
    unbiased. Without `norm_by_std` the advantage is score − mean (Dr. GRPO, Liu et al. 2025,
    https://arxiv.org/abs/2503.20783). A group of one uses mean 0 and std 1 (score / (1 + eps)); a group whose
    scores are all equal gets exactly 0 (NaN when eps = 0: 0/0). `group_ids` holds one hashable per row (e.g. the
    `uid` strings). Returns `(advantages, returns)` `[batch, response_len]`, returns = advantages.
    """
    stats = _group_stats(token_level_rewards, response_mask, group_ids)
    alone = stats.size == 1
    centered = torch.where(alone, stats.scores, stats.centered)
    if norm_by_std:
        centered = centered / (torch.where(alone, 1, stats.std) + eps)
    return _broadcast(centered, response_mask)


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_grpo_advantage` under verl's name and argument names (`index` are the group ids)."""
    return compute_grpo_advantage(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo)


def group_centered_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score minus its group's mean score (a group of one: the raw score), broadcast over valid tokens.

    The baseline step of REINFORCE++-baseline, before its batch whitening. Returns `(advantages, returns)`
    `[batch, response_len]`, both equal.
    """
    stats = _group_stats(token_level_rewards, response_mask, group_ids)
    return _broadcast(torch.where(stats.size > 1, stats.centered, stats.scores), response_mask)


def compute_reinforce_pp_baseline_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu et al. 2025, https://arxiv.org/abs/2501.03262): each score minus its group's
    mean score, then whitened over all valid tokens of the batch (the group mean removes the prompt's
    difficulty; the batch std, not the group's, sets the scale, so all-equal groups give no NaN).

    A group of one keeps its raw score before whitening. Returns `(advantages, returns)` `[batch, response_len]`,
    both the whitened advantages (as verl's `compute_reinforce_plus_plus_baseline_outcome_advantage`).
    """
    centered, _ = group_centered_scores(token_level_rewards, response_mask, group_ids)
    advantages = masked_whiten(centered, response_mask)
    return advantages, advantages


def compute_rloo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): score minus the mean score of the other sequences of its group.

    score − mean(others) = n/(n − 1)·(score − group mean) for a group of n; a group of one keeps its raw score.
    Returns `(advantages, returns)` `[batch, response_len]`, returns = advantages.
    """
    stats = _group_stats(token_level_rewards, response_mask, group_ids)
    leave_one_out = stats.centered * stats.size / (stats.size - 1).clamp(min=1)
    return _broadcast(torch.where(stats.size > 1, leave_one_out, stats.scores), response_mask)


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class AdvEstimator:
    """A registered estimator: call it like `fn`; `whiten` says whether its advantages may be whitened."""

    name: str
    fn: EstimatorFn
    whiten: bool

    def __call__(
        self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **context: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(token_level_rewards, response_mask, **context)


def register_adv_estimator(name: str, *, whiten: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator registering `fn(token_level_rewards, response_mask, **context) -> (advantages, returns)`.

    `fn` gets `[batch, response_len]` tensors and the keyword context described in this module, and returns
    advantages and returns of the same shape.

    Args:
        name: The name `algorithm.adv_estimator` selects it by.
        whiten: Whether `robust_compute_advantage` may whiten its advantages over valid tokens (when
            `normalize_advantage` is set).

    Returns:
        A decorator that registers `fn` and returns it unchanged.

    Raises:
        ValueError: When the decorator is applied, if `name` is already registered.
    """

    def decorate(fn: EstimatorFn) -> EstimatorFn:
        ADV_ESTIMATORS.add(name, AdvEstimator(name, fn, whiten))
        return fn

    return decorate


def get_adv_estimator(name: str) -> AdvEstimator:
    """The estimator registered as `name`.

    Args:
        name: A registered estimator's name (`algorithm.adv_estimator`).

    Returns:
        The `AdvEstimator`, called as `fn(token_level_rewards, response_mask, **context)`.

    Raises:
        ValueError: If no estimator is registered as `name` (the message lists those that are).
    """
    return ADV_ESTIMATORS.get(name)


def _needs(value: Any, estimator: str, what: str, source: str) -> Any:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {what} {source}, but got None")
    return value


_VALUES = "from the critic (batch.batch['values']; enable the critic)"
_GROUPS = "(batch.non_tensor_batch['uid']: the rollout.n responses of one prompt share a uid)"


@register_adv_estimator("gae", whiten=True)
def _gae(token_level_rewards, response_mask, *, values=None, gamma=1.0, lam=1.0, **_):
    return compute_gae(token_level_rewards, _needs(values, "gae", "values", _VALUES), response_mask, gamma, lam)


@register_adv_estimator("grpo")
def _grpo(token_level_rewards, response_mask, *, group_ids=None, norm_adv_by_std_in_grpo=True, **_):
    group_ids = _needs(group_ids, "grpo", "group_ids", _GROUPS)
    return compute_grpo_advantage(token_level_rewards, response_mask, group_ids, norm_by_std=norm_adv_by_std_in_grpo)


@register_adv_estimator("rloo")
def _rloo(token_level_rewards, response_mask, *, group_ids=None, **_):
    return compute_rloo_advantage(token_level_rewards, response_mask, _needs(group_ids, "rloo", "group_ids", _GROUPS))


@register_adv_estimator("reinforce_plus_plus", whiten=True)
def _reinforce_pp(token_level_rewards, response_mask, *, gamma=1.0, **_):
    # the whitening of compute_reinforce_pp_advantage is robust_compute_advantage's (algorithm.normalize_advantage)
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return returns, returns


@register_adv_estimator("reinforce_plus_plus_baseline", whiten=True)
def _reinforce_pp_baseline(token_level_rewards, response_mask, *, group_ids=None, **_):
    # the whitening of compute_reinforce_pp_baseline_advantage is robust_compute_advantage's
    group_ids = _needs(group_ids, "reinforce_plus_plus_baseline", "group_ids", _GROUPS)
    return group_centered_scores(token_level_rewards, response_mask, group_ids)


@register_adv_estimator("remax")
def _remax(token_level_rewards, response_mask, *, reward_baselines=None, **_):
    source = "(batch.batch['reward_baselines']: the reward of each prompt's greedy response)"
    baselines = _needs(reward_baselines, "remax", "reward_baselines", source)
    return compute_remax_advantage(token_level_rewards, baselines, response_mask)
