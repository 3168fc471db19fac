"""The `reward` section: reward functions and scorer arguments, a reward model, DAPO's overlong buffer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ketch.config.sections.model import LoraConfig, OptimConfig


@dataclass(frozen=True)
class RewardModelConfig:
    path: str | None = None
    """A reward model directory or hub id (`ketch rm` output, or any HF `*ForSequenceClassification` with one
    label) that scores each PPO response at its last valid token; None = no reward model."""
    tokenizer_path: str | None = None
    """The reward model's tokenizer; None = reward.model.path."""
    retokenize: Literal["auto", "always", "never"] = "auto"
    """Re-encode prompt + response for the reward model (decode with the actor's tokenizer, format with the
    reward model's chat template, encode with its tokenizer); auto = when the tokenizers or templates differ."""
    chat_template: str | None = None
    """A built-in chat template (`chatml`, ...) for chat prompts when re-encoding; None = the reward model's own."""
    micro_batch_size_per_device: int | None = None
    """Sequences per reward-model forward on one device (in `ketch rm` a pair is two sequences, so it must be
    even); None = all at once."""
    placement: Literal["colocate", "split"] = "colocate"
    """Ray: the reward model in the actor's processes (colocate), or on a resource pool of its own (split)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Optimizer of `ketch rm` (the default suits the built-in tiny model; use ~1e-5 for large models)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """`ketch rm`: train LoRA adapters on the backbone, with the score head trained whole (a frozen PPO reward
    model takes none: give reward.model.path the merged `model/` that `ketch rm` writes)."""


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13): a response longer than
    data.max_response_length - len loses up to penalty_factor, linearly over the last `len` tokens."""

    enable: bool = False
    """Add the length penalty to every training score (validation accuracy is not changed)."""
    len: int = 4
    """The buffer: tokens before data.max_response_length where the penalty grows from 0 to penalty_factor."""
    penalty_factor: float = 1.0
    """The penalty of a response that uses every allowed token."""


@dataclass(frozen=True)
class RewardConfig:
    function: str | None = None
    """A user scorer `path/to/file.py:fn` with signature fn(data_source, solution_str, ground_truth, extra_info)."""
    on_error: Literal["raise", "zero"] = "raise"
    """When a scorer raises on a sample: stop the run, or log it and score the sample 0."""
    scorer_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword arguments, per data source, of the function that scores its samples (reward.function or the
    registered scorer), in training and validation, e.g. {ketch/arithmetic: {digit_credit: 0.5}}: partial credit
    for the right digits of a wrong answer, while validation accuracy stays exact match (the scorer's `acc`)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The reward model that scores PPO responses, and the settings of `ketch rm`."""
    weights: dict[str, float] | None = None
    """Weights of the score sources `rule` (reward.function or the scorer of each data_source) and `model`
    (reward.model.path), e.g. {rule: 1.0, model: 0.5}; a missing source weighs 0. None = the reward model
    alone when reward.model.path is set, else the rule-based scorers alone. Validation always uses the rules."""
    clip: float | None = None
    """Clip reward-model scores to [-clip, clip] (after normalisation); None disables."""
    normalize: bool = False
    """Normalise reward-model scores by their running mean and std over the run (kept in checkpoints)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping."""

    @property
    def source_weights(self) -> dict[str, float]:
        """`weights` resolved: {"rule": w, "model": w}, with the default described there."""
        if self.weights is None:
            return {"rule": 0.0, "model": 1.0} if self.model.path else {"rule": 1.0, "model": 0.0}
        return {"rule": 0.0, "model": 0.0} | {k: float(v) for k, v in self.weights.items()}
