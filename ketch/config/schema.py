"""The typed configuration schema: one frozen dataclass per section (in `ketch.config.sections`), every field
documented, joined here into `KetchConfig` with the defaults of the commands and of the built-in run.

Sizes follow one convention: `*_batch_size` without a suffix counts prompts, `*_per_device` counts
sequences (prompt + response) on one device. A prompt expands to `rollout.n` sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ketch.config.sections.algorithm import AlgorithmConfig, FilterGroupsConfig, KLControlConfig
from ketch.config.sections.model import (
    BUILTIN_CALCULATOR_MODEL,
    BUILTIN_CALLER_MODEL,
    BUILTIN_DOTS_MODEL,
    BUILTIN_MODEL,
    BUILTIN_PREFERENCE_TASK,
    BUILTIN_TASK,
    DataConfig,
    LoraConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
)
from ketch.config.sections.reward import OverlongBufferConfig, RewardConfig, RewardModelConfig
from ketch.config.sections.roles import ActorConfig, CriticConfig, RefConfig
from ketch.config.sections.rollout import MultiTurnConfig, PartialRolloutConfig, RolloutConfig, ValSamplingConfig
from ketch.config.sections.trainer import TrainerConfig

__all__ = [
    "BUILTIN_CALCULATOR_MODEL",
    "BUILTIN_CALLER_MODEL",
    "BUILTIN_DOTS_MODEL",
    "BUILTIN_MODEL",
    "BUILTIN_PREFERENCE_TASK",
    "BUILTIN_RUN_DEFAULTS",
    "BUILTIN_TASK",
    "COMMAND_DEFAULTS",
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "KetchConfig",
    "LoraConfig",
    "MegatronConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PartialRolloutConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "TrainerConfig",
    "ValSamplingConfig",
]


COMMAND_DEFAULTS: dict[str, tuple[str, ...]] = {
    "sft": ("trainer.experiment_name=arithmetic-sft", "data.train_batch_size=128"),
    "rm": (
        f"data.train_files=[{BUILTIN_PREFERENCE_TASK}/train]",
        f"data.val_files=[{BUILTIN_PREFERENCE_TASK}/val]",
        "data.train_batch_size=128",
        "trainer.experiment_name=arithmetic-rm",
        "trainer.total_steps=1000",
        "trainer.test_freq=250",
        "reward.model.optim.lr=5e-4",
    ),
}
"""Where `ketch sft` and `ketch rm` differ from the defaults below (those of `ketch train`): with no
arguments, `ketch rm` trains a reward model on the built-in preference pairs. A YAML file and overrides
still win."""

BUILTIN_RUN_DEFAULTS: tuple[str, ...] = (
    "rollout.n=16",
    "trainer.total_steps=190",
    "actor.optim.lr=1.5e-4",
    "actor.optim.lr_scheduler=cosine",
    "actor.optim.min_lr_ratio=0.1",
    "actor.old_log_prob_from_rollout=true",
)
"""The built-in demo's settings: where `ketch train` with no YAML file, on the built-in task and model (the
overrides leave data.train_files and model.path as they are), differs from the defaults below. From its
warm-up, the tiny model gained more per CPU-second with 16 samples per prompt than with 8; the learning rate
decays to a tenth over the run (with a constant one, greedy accuracy jumps by ±0.05 between validations at
the end); the rollout's log-probs serve as `old_log_prob` (the hf rollout on the CPU gives the training
engine's to 1e-5), which saves 15% of a step, so 190 steps fit the demo's 3 minutes on a 2-core CPU. Real
models are usually trained with fewer samples per prompt. Overrides still win."""


@dataclass(frozen=True)
class KetchConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """The prompts: files, columns, lengths, batch size, chat template."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model: where it loads from, its dtype, and how its training forwards run."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy's training: engine, optimizer, mini- and micro-batches, clipping, policy loss, KL loss."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of PPO with a critic (algorithm.adv_estimator=gae)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy, loaded when a KL term needs it."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: backend, sampling, placement, validation sampling and multi-turn tool use."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring: a reward function, scorer arguments, a reward model, and how their scores mix."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The advantage estimator, the KL penalty in the reward, and DAPO's dynamic sampling."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The run: steps, validation, checkpoints, resume, retries, trackers, devices and processes."""

    @property
    def use_critic(self) -> bool:
        """Whether a value model is trained (explicit critic.enable, else only for GAE)."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    def uses_gpu(self, gpu_visible: bool) -> bool:
        """Whether the workers run on GPUs (`gpu_visible`: does this machine see one, for device=auto)."""
        return self.trainer.device == "cuda" or (self.trainer.device == "auto" and gpu_visible)

    def num_processes(self, gpu_visible: bool) -> int:
        """Worker processes over all nodes (one per device)."""
        t = self.trainer
        return t.nnodes * (t.n_gpus_per_node if self.uses_gpu(gpu_visible) else t.n_cpu_workers)

    @property
    def model_parallel_size(self) -> int:
        """Processes that share one data-parallel rank's micro-batches: the Megatron tensor x pipeline size, else
        actor.ulysses_sequence_parallel_size (1 without sequence parallelism)."""
        roles = [self.actor] + ([self.critic] if self.use_critic else [])
        sequence_parallel = self.actor.ulysses_sequence_parallel_size
        return max(r.megatron.model_parallel_size if r.strategy == "megatron" else sequence_parallel for r in roles)

    def world_size(self, gpu_visible: bool) -> int:
        """Data-parallel ranks over all nodes: processes / model_parallel_size (rounded down; validation
        requires that it divides)."""
        return max(1, self.num_processes(gpu_visible) // self.model_parallel_size)

    def rollout_processes(self, gpu_visible: bool) -> int:
        """Processes that run the rollout engine: a standalone rollout's over all nodes, else the workers'."""
        if self.rollout.placement == "standalone":
            return self.trainer.nnodes * self.rollout.n_workers_per_node
        return self.num_processes(gpu_visible)

    def uses_ray(self, gpu_visible: bool) -> bool:
        """The backend that `trainer.backend` resolves to (see its documentation)."""
        if self.trainer.backend != "auto":
            return self.trainer.backend == "ray"
        t = self.trainer
        many = self.num_processes(gpu_visible) > 1 or t.nnodes > 1 or self.rollout.placement == "standalone"
        return many or t.ray_address is not None

    @property
    def old_log_prob_from_rollout(self) -> bool:
        """Whether `old_log_prob` is the rollout's log-probs, with no forward of the training engine:
        `actor.old_log_prob_from_rollout`, or `rollout.exact_log_probs` (where the two are equal)."""
        return self.actor.old_log_prob_from_rollout or self.rollout.exact_log_probs

    @property
    def use_reference(self) -> bool:
        """Whether reference log-probs are needed (KL in the reward or in the loss)."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss
