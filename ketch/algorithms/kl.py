"""KL between the actor and the reference policy: per-token estimators, coefficient controllers, reward penalty."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from ketch.algorithms._checks import check_same_shape, require
from ketch.algorithms.masked import masked_mean

if TYPE_CHECKING:
    from ketch.protocol import DataProto

_BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = _BASE_KINDS + tuple(f"{kind}+" for kind in _BASE_KINDS if kind not in ("mse", "k2"))


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(actor ‖ reference) from sampled-token log-probs, `[batch, response_len]`.

    With d = log_prob − ref_log_prob: `kl`/`k1` d; `abs` |d|; `mse`/`k2` d²/2; `low_var_kl`/`k3`
    exp(−d) + d − 1 clamped to [−10, 10] (Schulman's k3, unbiased and always ≥ 0; http://joschu.net/blog/kl-approx.html).
    A kind ending in `+` (e.g. `k3+`) has the value of its estimator and the gradient of k2, whose gradient is
    the unbiased one of the KL (straight-through), as verl's namesake.
    """
    if kind.endswith("+") and kind in KL_KINDS:
        value, k2 = kl_penalty(log_prob, ref_log_prob, kind[:-1]), 0.5 * (log_prob - ref_log_prob).square()
        return k2 - k2.detach() + value.detach()
    diff = log_prob - ref_log_prob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        # Beyond |d| = 20 the result is clamped anyway; bounding the exponent keeps the gradient finite.
        log_ratio = (-diff).clamp(-20, 20)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL kind {kind!r}; choose one of {', '.join(KL_KINDS)}")


class KLController(ABC):
    """A KL coefficient `value` that `update` may change after each batch; saved in checkpoints."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    @abstractmethod
    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt `value` after a batch of `n_steps` samples whose mean KL per valid token was `current_kl`."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A constant coefficient."""

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt: the coefficient stays `kl_coef`."""


class AdaptiveKLController(KLController):
    """Proportional control of the coefficient towards a target KL (Ziegler et al. 2019).

    error = clip(current_kl / target_kl − 1, −0.2, 0.2); value ← value · (1 + error · n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target_kl > 0 and horizon > 0 "
                f"(algorithm.kl_ctrl.target_kl / .horizon), got target_kl={target_kl}, horizon={horizon}"
            )
        super().__init__(init_kl_coef)
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def build_kl_controller(type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """`fixed` or `adaptive` controller, as configured in `algorithm.kl_ctrl`."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r} (algorithm.kl_ctrl.type); choose fixed or adaptive")


def apply_kl_penalty(batch: DataProto, kl_ctrl: KLController, kind: str = "kl") -> tuple[DataProto, dict[str, float]]:
    """A new batch with `token_level_rewards = token_level_scores − β·KL` at valid tokens, and metrics.

    KL is `kl_penalty(old_log_prob, ref_log_prob, kind)` `[batch, response_len]` and β the controller's value
    before this call. Metrics: `actor/reward_kl_penalty`, the masked mean KL per valid token of the batch, and
    `actor/reward_kl_penalty_coeff`, β. The controller is then updated with that mean and the batch size.
    """
    who = "apply_kl_penalty"
    scores = require(batch.batch, "token_level_scores", who, "the reward-function scores per token")
    old_log_prob = require(batch.batch, "old_log_prob", who, "the actor's log-probs of the sampled tokens")
    ref_log_prob = require(batch.batch, "ref_log_prob", who, "the reference model's log-probs")
    mask = require(batch.batch, "response_mask", who, "1 for response tokens, 0 for padding").bool()
    check_same_shape(
        who, token_level_scores=scores, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob, response_mask=mask
    )
    kl = torch.where(mask, kl_penalty(old_log_prob, ref_log_prob, kind), 0)
    beta = kl_ctrl.value
    current_kl = masked_mean(kl, mask).item()
    kl_ctrl.update(current_kl, n_steps=mask.shape[0])
    new_batch = type(batch)(
        batch={**batch.batch, "token_level_rewards": scores - beta * kl},
        non_tensor_batch=dict(batch.non_tensor_batch),
        meta_info=dict(batch.meta_info),
    )
    return new_batch, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
