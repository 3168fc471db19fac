"""The `algorithm` section: the advantage estimator, the KL penalty in the reward, DAPO's dynamic sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient or the adaptive controller of Ziegler et al. 2019."""
    kl_coef: float = 0.001
    """KL coefficient (initial value for adaptive)."""
    target_kl: float = 0.1
    """Adaptive controller target KL per token."""
    horizon: int = 10000
    """Adaptive controller horizon in samples."""


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476): drop the groups whose samples all have the same
    `metric` (their group advantages are all zero) and generate more prompts until data.train_batch_size
    informative groups are collected."""

    enable: bool = False
    """Filter groups (needs rollout.n >= 2 and sampling)."""
    metric: str = "seq_reward"
    """What must differ within a group: seq_reward (each sample's summed score, overlong penalty included) or a
    field of the dict the reward function returns (e.g. acc)."""
    gen_batch_size: int | None = None
    """Prompts generated per round; None = data.train_batch_size. Larger rounds (verl's gen_batch_size) fill a
    batch in fewer rounds when some groups are dropped; the informative groups beyond the batch are discarded."""
    max_num_gen_batches: int = 10
    """Generation rounds one step may use before it stops with an error; 0 = no limit."""

    def round_size(self, train_batch_size: int) -> int:
        """Prompts per generation round: gen_batch_size when filtering, else data.train_batch_size."""
        return self.gen_batch_size if self.enable and self.gen_batch_size is not None else train_batch_size


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, gae (PPO with a critic), rloo, reinforce_plus_plus, reinforce_plus_plus_baseline,
    remax (or any registered one)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda (Schulman et al. 2016)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (False = Dr. GRPO)."""
    normalize_advantage: bool = True
    """Whiten advantages over the batch's valid tokens (GAE and REINFORCE++)."""
    clip_advantage: float | None = None
    """Clip advantages to [-clip, clip] after whitening; None disables."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || reference) from the token-level reward (InstructGPT style)."""
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    """KL estimator used in the reward."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL coefficient controller for the in-reward penalty."""
    non_finite: Literal["raise", "zero"] = "raise"
    """A NaN/inf in rewards, values or advantages: stop with a message, or zero those entries and count them."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""
    overlong_filtering: bool = False
    """Leave the responses that used every allowed token (cut off by data.max_response_length, not stopped) out of
    the actor's loss (DAPO's overlong filtering): their rewards still enter their groups' advantages;
    `response_length/clip_ratio` logs their share."""
