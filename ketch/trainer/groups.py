"""Build the worker groups of a run (the local backend: every role in this process)."""

from __future__ import annotations

from ketch.config import BatchPlan, KetchConfig
from ketch.controller import LocalWorkerGroup
from ketch.workers import ActorRolloutRefWorker, CriticWorker


def build_worker_groups(config: KetchConfig, model_path: str, plan: BatchPlan, total_updates: int):
    """(actor_rollout group, critic group or None), each with its models loaded."""
    actor_rollout = LocalWorkerGroup(
        ActorRolloutRefWorker, config, model_path, plan, total_updates, role="actor_rollout"
    )
    actor_rollout.init_model()
    critic = None
    if config.use_critic:
        critic_updates = total_updates // plan.actor.num_mini_batches // plan.actor.epochs
        critic_updates *= plan.critic.num_mini_batches * plan.critic.epochs
        critic = LocalWorkerGroup(CriticWorker, config, model_path, plan, critic_updates, role="critic")
        critic.init_model()
    return actor_rollout, critic
