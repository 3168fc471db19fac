"""RL algorithms on tensors: advantage estimators, KL penalties and controllers, policy losses (PPO, GSPO, CISPO)
and value losses, rollout–training mismatch correction, DAPO's group filter and overlong shaping, the
Bradley–Terry loss of reward models and the mixing of reward sources.

This package imports no other ketch module but `ketch.registry` (the estimators' and policy losses' registries, which
the config's validation reads too) and, for type hints only, `ketch.protocol`: batches are used through `.batch`,
`.non_tensor_batch` and `.meta_info` only, so it can be tested and reused on its own.
"""

from ketch.algorithms.estimators import (
    AdvEstimator,
    compute_gae,
    compute_gae_advantage_return,
    compute_grpo_advantage,
    compute_grpo_outcome_advantage,
    compute_reinforce_pp_advantage,
    compute_reinforce_pp_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    discounted_returns,
    get_adv_estimator,
    group_centered_scores,
    register_adv_estimator,
)
from ketch.algorithms.group_filter import informative_groups
from ketch.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from ketch.algorithms.masked import masked_mean, masked_var, masked_whiten
from ketch.algorithms.overlong import filter_overlong, overlong_penalty, truncated
from ketch.algorithms.policy_losses import (
    cispo_loss,
    get_policy_loss,
    gspo_loss,
    gspo_token_loss,
    policy_loss_names,
    register_policy_loss,
)
from ketch.algorithms.ppo_losses import (
    AGG_MODES,
    agg_loss,
    compute_policy_loss,
    entropy_from_logits,
    policy_loss,
    value_loss,
)
from ketch.algorithms.preference import bradley_terry_loss, pairwise_accuracy
from ketch.algorithms.reward_mix import REWARD_SOURCES, RewardMixer, RunningMeanStd, last_valid_index
from ketch.algorithms.robust_advantage import NonFiniteError, robust_compute_advantage
from ketch.algorithms.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    TURN_KINDS,
    rollout_is_weights,
    rollout_mismatch_metrics,
    rollout_mismatch_terms,
    turn_masks,
)

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "REWARD_SOURCES",
    "ROLLOUT_IS_LEVELS",
    "TURN_KINDS",
    "AdaptiveKLController",
    "AdvEstimator",
    "FixedKLController",
    "KLController",
    "NonFiniteError",
    "RewardMixer",
    "RunningMeanStd",
    "agg_loss",
    "apply_kl_penalty",
    "bradley_terry_loss",
    "build_kl_controller",
    "cispo_loss",
    "compute_gae",
    "compute_gae_advantage_return",
    "compute_grpo_advantage",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_reinforce_pp_advantage",
    "compute_reinforce_pp_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "discounted_returns",
    "entropy_from_logits",
    "filter_overlong",
    "get_adv_estimator",
    "get_policy_loss",
    "group_centered_scores",
    "gspo_loss",
    "gspo_token_loss",
    "informative_groups",
    "kl_penalty",
    "last_valid_index",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "pairwise_accuracy",
    "policy_loss",
    "policy_loss_names",
    "register_adv_estimator",
    "register_policy_loss",
    "robust_compute_advantage",
    "rollout_is_weights",
    "rollout_mismatch_metrics",
    "rollout_mismatch_terms",
    "truncated",
    "turn_masks",
    "value_loss",
]
