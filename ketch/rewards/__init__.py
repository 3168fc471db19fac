"""Rewards: scorers by data source, user reward functions, and batch scoring into token-level scores."""

from ketch.rewards import arithmetic, dots, gsm8k, math  # noqa: F401  (register the built-in scorers)
from ketch.rewards.custom import RewardFunctionError, load_reward_function
from ketch.rewards.registry import UnknownDataSourceError, compute_score, known_data_sources, register_scorer
from ketch.rewards.scorer import RewardError, RewardScorer

__all__ = [
    "RewardError",
    "RewardFunctionError",
    "RewardScorer",
    "UnknownDataSourceError",
    "compute_score",
    "known_data_sources",
    "load_reward_function",
    "register_scorer",
]
