"""Build the worker groups of a run: in this process (local backend) or as Ray actors.

With Ray, the roles of a rank share one process per device (`trainer.placement=colocate`), or the critic
gets a resource pool of its own (`split`). Either way the trainer receives role groups with the same
methods, so trainer code does not change with placement.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ketch.config import BatchPlan, KetchConfig
from ketch.controller import LocalWorkerGroup
from ketch.workers import ActorRolloutRefWorker, CriticWorker

logger = logging.getLogger("ketch")


@dataclass
class WorkerGroups:
    """The role groups of a run and what must be shut down at the end."""

    actor_rollout: Any
    critic: Any = None
    owned: list = field(default_factory=list)
    """The groups that hold worker processes or models, shut down together."""

    def shutdown(self) -> None:
        for group in self.owned:
            group.shutdown()
        self.owned = []


def build_worker_groups(
    config: KetchConfig, model_path: str, plan: BatchPlan, actor_updates: int, critic_updates: int | None = None
) -> WorkerGroups:
    """Actor+rollout(+reference) and, when `critic_updates` is given, critic groups, models loaded.
    The update counts size the learning-rate schedules."""
    actor = (ActorRolloutRefWorker, config, model_path, plan, actor_updates)
    critic = (CriticWorker, config, model_path, plan, critic_updates) if critic_updates is not None else None
    if config.uses_ray(torch.cuda.is_available()):
        groups = _ray_groups(config, actor, critic)
    else:
        local_actor = LocalWorkerGroup(*actor, role="actor_rollout")
        local_critic = LocalWorkerGroup(*critic, role="critic") if critic else None
        groups = WorkerGroups(local_actor, local_critic, [g for g in (local_actor, local_critic) if g])
    groups.actor_rollout.init_model()
    if groups.critic is not None:
        groups.critic.init_model()
    return groups


def _ray_groups(config: KetchConfig, actor: tuple, critic: tuple | None) -> WorkerGroups:
    from ketch.controller.ray_group import RayClassWithInitArgs, RayWorkerGroup
    from ketch.controller.resource_pool import RayResourcePool

    t = config.trainer
    use_gpu = config.uses_gpu(torch.cuda.is_available())
    per_node = t.n_gpus_per_node if use_gpu else t.n_cpu_workers
    split = critic is not None and t.placement == "split"
    connect_ray(t.ray_address, bundles=per_node * t.nnodes * (2 if split else 1))
    specs = {"actor_rollout": RayClassWithInitArgs(*actor)}
    if critic is not None and not split:
        specs["critic"] = RayClassWithInitArgs(*critic)
    main = RayWorkerGroup(RayResourcePool([per_node] * t.nnodes, use_gpu, name="ketch"), specs, t.worker_timeout)
    groups = WorkerGroups(main.role("actor_rollout"), main.roles.get("critic"), [main])
    if split:
        pool = RayResourcePool([per_node] * t.nnodes, use_gpu, name="ketch-critic")
        critic_group = RayWorkerGroup(pool, {"critic": RayClassWithInitArgs(*critic)}, t.worker_timeout)
        groups.critic = critic_group.role("critic")
        groups.owned.append(critic_group)
    return groups


def connect_ray(address: str | None, bundles: int) -> None:
    """Join the cluster at `address`, or start a local Ray instance with room for `bundles` CPU workers."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        cpus = max(os.cpu_count() or 1, bundles)
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    logger.info("Ray: %s", {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")})
