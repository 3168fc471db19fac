"""The score of a rollout sample from several sources: rule-based scorers and a reward model.

Per sequence, score = w_rule · rule + w_model · f(model), placed at the last valid response token. The
reward model's scale is arbitrary, so `f` may normalise its scores by their running mean and standard
deviation over the run and clip them to [−clip, clip] (in that order); rule scores are used as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch

REWARD_SOURCES = ("rule", "model")
"""The score sources `RewardMixer` weighs: rule-based scorers and the reward model."""


class RunningMeanStd:
    """Mean and (population) standard deviation of every value seen so far, merged batch by batch with
    the parallel update of Chan et al. (1979); its state goes into checkpoints."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        """Add `values` (any shape) to the statistics."""
        if values.numel() == 0:
            return
        batch = values.detach().double().flatten()
        n, batch_mean = batch.numel(), batch.mean().item()
        delta, total = batch_mean - self.mean, self.count + n
        self.m2 += ((batch - batch_mean) ** 2).sum().item() + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 1.0

    def normalize(self, values: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """(values − mean) / (std + eps), same shape and dtype."""
        return (values - self.mean) / (self.std + eps)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


class RewardMixer:
    """Weighs rule-based and reward-model scores into token-level scores (see the module docstring).

    `weights` maps sources in `REWARD_SOURCES` to floats (a missing source weighs 0); `clip` and
    `normalize` act on the reward-model scores."""

    def __init__(self, weights: dict[str, float], clip: float | None = None, normalize: bool = False) -> None:
        unknown = sorted(set(weights) - set(REWARD_SOURCES))
        if unknown:
            raise ValueError(f"unknown reward sources {unknown} in the weights; the sources are {REWARD_SOURCES}")
        if clip is not None and clip <= 0:
            raise ValueError(f"the reward clip must be > 0, got {clip}")
        self.weights = {source: float(weights.get(source, 0.0)) for source in REWARD_SOURCES}
        self.clip = clip
        self.stats = RunningMeanStd() if normalize else None

    def __call__(
        self,
        response_mask: torch.Tensor,
        rule_scores: torch.Tensor | None = None,
        model_scores: torch.Tensor | None = None,
        update_stats: bool = True,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """`response_mask` `[batch, response_len]`; `rule_scores` and `model_scores` (`rm_scores`) are token-level
        `[batch, response_len]` (each row sums to its sequence's score), each needed when its weight is not 0.
        `update_stats=False` normalises without adding the scores to the running statistics (e.g. for a
        baseline). Returns `token_level_scores` `[batch, response_len]` float32, zero but at each row's last
        valid token, and metrics `reward/<source>/...`."""
        total = torch.zeros(response_mask.shape[0], dtype=torch.float32, device=response_mask.device)
        metrics: dict[str, float] = {}
        if self.weights["rule"]:
            rule = _sequence_scores(rule_scores, "rule", response_mask)
            metrics["reward/rule/mean"] = rule.mean().item()
            total += self.weights["rule"] * rule
        if self.weights["model"]:
            raw = _sequence_scores(model_scores, "model", response_mask)
            metrics |= {"reward/model/mean": raw.mean().item(), "reward/model/std": raw.std(correction=0).item()}
            total += self.weights["model"] * self._transform(raw, update_stats, metrics)
        scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
        scores[torch.arange(len(total), device=total.device), last_valid_index(response_mask)] = total
        return scores, metrics

    def _transform(self, scores: torch.Tensor, update_stats: bool, metrics: dict[str, float]) -> torch.Tensor:
        """Normalise (running mean/std) then clip `[batch]` reward-model scores; adds their metrics."""
        if self.stats is not None:
            if update_stats:
                self.stats.update(scores)
            scores = self.stats.normalize(scores)
            metrics |= {"reward/model/running_mean": self.stats.mean, "reward/model/running_std": self.stats.std}
        if self.clip is not None:
            metrics["reward/model/clipfrac"] = (scores.abs() > self.clip).float().mean().item()
            scores = scores.clamp(-self.clip, self.clip)
        return scores

    def state_dict(self) -> dict[str, Any]:
        """The running statistics of the reward-model scores (empty without normalisation)."""
        return {"stats": self.stats.state_dict()} if self.stats is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.stats is not None and state.get("stats") is not None:
            self.stats.load_state_dict(state["stats"])


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """`[batch]` index of the last nonzero entry of each row of `mask` `[batch, len]` (0 for an empty row)."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask != 0) * positions).amax(dim=-1).clamp(min=1) - 1


def _sequence_scores(scores: torch.Tensor | None, source: str, response_mask: torch.Tensor) -> torch.Tensor:
    if scores is None:
        raise ValueError(f"the {source} reward has a non-zero weight but no {source} scores were given")
    if scores.shape != response_mask.shape:
        raise ValueError(
            f"{source} scores {tuple(scores.shape)} must have the shape of response_mask {tuple(response_mask.shape)}"
        )
    return scores.float().sum(-1)
