"""Batch-size arithmetic, derived once from the config by pure functions (the config is never mutated).

A step takes `data.train_batch_size` prompts and samples `rollout.n` responses for each. An update role
(actor or critic) splits those sequences into mini-batches (one optimizer step each), each mini-batch
over the data-parallel ranks, and each rank's share into micro-batches (one forward/backward each).
"""

from __future__ import annotations

from dataclasses import dataclass

from ketch.config.schema import KetchConfig


class BatchError(ValueError):
    """Batch sizes that do not divide: the message names the keys and the numbers."""


@dataclass(frozen=True)
class UpdatePlan:
    """How one role's update walks a step's sequences."""

    mini_batch_size: int
    """Sequences per optimizer step, over all ranks."""
    num_mini_batches: int
    """Optimizer steps per epoch."""
    mini_batch_per_device: int
    """Sequences of one mini-batch on one rank."""
    micro_batch_per_device: int
    """Sequences per forward/backward on one rank (a cap when a token budget is used)."""
    grad_accum_steps: int
    """Micro-batches per mini-batch on one rank (fixed-count splitting)."""
    epochs: int


@dataclass(frozen=True)
class BatchPlan:
    """Every size the trainer and workers need, for one world size."""

    prompts_per_step: int
    samples_per_prompt: int
    sequences_per_step: int
    world_size: int
    sequences_per_device: int
    actor: UpdatePlan
    critic: UpdatePlan | None


def recompute_old_log_prob(config: KetchConfig, plan: BatchPlan) -> bool:
    """Whether `old_log_prob` needs its own forward pass (see `actor.recompute_old_log_prob`), when it does not
    come from the rollout (`KetchConfig.old_log_prob_from_rollout`, which the trainer checks first)."""
    if config.actor.recompute_old_log_prob is not None:
        return config.actor.recompute_old_log_prob
    needed_by = config.algorithm.use_kl_in_reward or config.actor.rollout_is is not None
    return plan.actor.epochs > 1 or plan.actor.num_mini_batches > 1 or needed_by


def derive_batch_plan(config: KetchConfig, world_size: int = 1) -> BatchPlan:
    """Derive all batch sizes for `world_size` data-parallel ranks; raises `BatchError` when they do not divide."""
    prompts, n = config.data.train_batch_size, config.rollout.n
    if prompts < 1 or n < 1 or world_size < 1:
        raise BatchError(
            f"data.train_batch_size={prompts}, rollout.n={n} and the world size {world_size} must all be >= 1"
        )
    sequences = prompts * n
    if sequences % world_size:
        raise BatchError(
            f"data.train_batch_size x rollout.n = {prompts} x {n} = {sequences} sequences do not split evenly "
            f"over {world_size} ranks; make the product a multiple of {world_size}"
        )
    actor = _update_plan("actor", config.actor, prompts, n, world_size)
    critic = _update_plan("critic", config.critic, prompts, n, world_size) if config.use_critic else None
    return BatchPlan(prompts, n, sequences, world_size, sequences // world_size, actor, critic)


def _update_plan(role: str, section, prompts: int, n: int, world_size: int) -> UpdatePlan:
    mini_prompts = section.ppo_mini_batch_size or prompts
    if mini_prompts < 1 or prompts % mini_prompts:
        raise BatchError(
            f"{role}.ppo_mini_batch_size={mini_prompts} must divide data.train_batch_size={prompts} "
            f"(each step is split into whole mini-batches); try one of {_divisors(prompts)}"
        )
    mini = mini_prompts * n
    if mini % world_size:
        raise BatchError(
            f"{role}.ppo_mini_batch_size x rollout.n = {mini_prompts} x {n} = {mini} sequences do not split "
            f"over {world_size} ranks; make it a multiple of {world_size}"
        )
    per_device = mini // world_size
    micro = section.ppo_micro_batch_size_per_device or per_device
    if micro < 1 or per_device % micro:
        raise BatchError(
            f"{role}.ppo_micro_batch_size_per_device={micro} must divide the {per_device} sequences of one "
            f"mini-batch on one rank ({role}.ppo_mini_batch_size={mini_prompts} x rollout.n={n} / "
            f"{world_size} ranks); try one of {_divisors(per_device)}"
        )
    return UpdatePlan(mini, prompts // mini_prompts, per_device, micro, per_device // micro, section.ppo_epochs)


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]
