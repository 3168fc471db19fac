"""Build the worker groups of a run (the local backend: every role in this process)."""

from __future__ import annotations

from ketch.config import BatchPlan, KetchConfig
from ketch.controller import LocalWorkerGroup
from ketch.workers import ActorRolloutRefWorker, CriticWorker


def build_actor_group(config: KetchConfig, model_path: str, plan: BatchPlan, total_updates: int):
    """The actor + rollout (+ reference) group, models loaded; `total_updates` sizes the lr schedule."""
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, model_path, plan, total_updates, role="actor_rollout")
    group.init_model()
    return group


def build_critic_group(config: KetchConfig, model_path: str, plan: BatchPlan, total_updates: int):
    """The critic group, model loaded."""
    group = LocalWorkerGroup(CriticWorker, config, model_path, plan, total_updates, role="critic")
    group.init_model()
    return group
