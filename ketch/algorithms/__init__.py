"""RL algorithms on tensors: advantage estimators, KL penalties and controllers, policy and value losses,
the Bradley–Terry loss of reward models and the mixing of reward sources.

This package imports no other ketch module: batches are used through `.batch`, `.non_tensor_batch` and
`.meta_info` only, so it can be tested and reused on its own.
"""

from ketch.algorithms.advantage import NonFiniteError, robust_compute_advantage
from ketch.algorithms.estimators import (
    AdvEstimator,
    compute_gae,
    compute_grpo_advantage,
    compute_reinforce_pp_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    discounted_returns,
    get_adv_estimator,
    register_adv_estimator,
)
from ketch.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from ketch.algorithms.losses import (
    AGG_MODES,
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from ketch.algorithms.masked import masked_mean, masked_var, masked_whiten
from ketch.algorithms.preference import bradley_terry_loss, pairwise_accuracy
from ketch.algorithms.reward_mix import REWARD_SOURCES, RewardMixer, RunningMeanStd, last_valid_index

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "REWARD_SOURCES",
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
    "compute_gae",
    "compute_grpo_advantage",
    "compute_reinforce_pp_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "discounted_returns",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_policy_loss",
    "kl_penalty",
    "last_valid_index",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "pairwise_accuracy",
    "policy_loss",
    "register_adv_estimator",
    "register_policy_loss",
    "robust_compute_advantage",
    "value_loss",
]
