"""Build the worker groups of a run: in this process (local backend) or as Ray actors.

With Ray, the roles of a rank share one process per device (`trainer.placement=colocate`), or the critic
gets a resource pool of its own (`split`); so does the reward model with `reward.model.placement=split`, and
the rollout with `rollout.placement=standalone` (joined to the actor by a weight bridge).
Either way the trainer receives role groups with the same methods, so trainer code does not change with
placement.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ketch.config import BatchPlan, KetchConfig
from ketch.controller import LocalWorkerGroup
from ketch.controller.worker import freeze_long_lived
from ketch.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker, RolloutWorker

logger = logging.getLogger("ketch")


@dataclass
class WorkerGroups:
    """The role groups of a run and what must be shut down at the end."""

    actor_rollout: Any = None
    critic: Any = None
    reward_model: Any = None
    rollout: Any = None
    """A standalone rollout (`rollout.placement=standalone`); None when the actor's processes generate."""
    owned: list = field(default_factory=list)
    """The groups that hold worker processes or models, shut down together."""

    def shutdown(self) -> None:
        """Stop the groups, and let the collector see the driver's frozen objects again: a process that runs
        more than one run (a notebook, a sweep, the tests) would otherwise never collect cycles of the last."""
        for group in self.owned:
            group.shutdown()
        self.owned = []
        gc.unfreeze()

    def freeze_long_lived(self) -> None:
        """`freeze_long_lived` in the driver and in every worker process. After a run's first step, what survives
        lives as long as the run: models, compiled and CUDA graphs, data. Unfrozen, a full collection scanned it
        all again every so often, about 0.35 s on a GPU host in whichever step it fell (an actor update then took
        0.65 s instead of 0.33 s)."""
        freeze_long_lived()
        for group in (self.actor_rollout, self.critic, self.reward_model, self.rollout):
            if group is not None:
                group.freeze_long_lived()


def build_worker_groups(
    config: KetchConfig,
    model_path: str,
    plan: BatchPlan,
    actor_updates: int,
    critic_updates: int | None = None,
    reward_model_path: str | None = None,
) -> WorkerGroups:
    """Actor+rollout(+reference) and, when `critic_updates` is given, critic groups, and, when
    `reward_model_path` is given, a frozen reward model, and a standalone rollout joined to the actor by a weight
    bridge when the config asks for one; models loaded. The update counts size the learning-rate schedules."""
    specs = {"actor_rollout": (ActorRolloutRefWorker, config, model_path, plan, actor_updates)}
    if critic_updates is not None:
        specs["critic"] = (CriticWorker, config, model_path, plan, critic_updates)
    if reward_model_path is not None:
        tokenizer_path = config.reward.model.tokenizer_path or reward_model_path
        specs["reward_model"] = (RewardModelWorker, config, reward_model_path, tokenizer_path, None, model_path)
    if config.rollout.placement == "standalone":
        specs["rollout"] = (RolloutWorker, config, model_path)
    groups = _build(config, specs)
    if groups.rollout is not None:
        _join_weight_bridge(groups.actor_rollout, groups.rollout)
    return groups


def _join_weight_bridge(actor, rollout) -> None:
    """Open the weight bridge between the actor's ranks (rank 0 sends) and the standalone rollout's."""
    from ketch.controller.ray_group import get_together

    host, port = actor.rendezvous()
    get_together(
        [actor.async_join_weight_bridge(host, port, rollout.world_size), rollout.async_join_weight_bridge(host, port)]
    )


def build_reward_model_group(config: KetchConfig, model_path: str, total_updates: int) -> WorkerGroups:
    """The reward model alone, trainable (`ketch rm`): `model_path` is the backbone (or reward model) it
    starts from, with the tokenizer `model.tokenizer_path` or `model_path`."""
    tokenizer_path = config.model.tokenizer_path or model_path
    return _build(config, {"reward_model": (RewardModelWorker, config, model_path, tokenizer_path, total_updates)})


def _build(config: KetchConfig, specs: dict[str, tuple]) -> WorkerGroups:
    """Groups of the roles in `specs` (role -> (worker class, *init args)), then `init_model` on each."""
    if config.uses_ray(torch.cuda.is_available()):
        groups = _ray_groups(config, specs)
    else:
        local = {role: LocalWorkerGroup(*spec, role=role) for role, spec in specs.items()}
        groups = WorkerGroups(**local, owned=list(local.values()))
    for role in specs:
        getattr(groups, role).init_model()
    return groups


def _ray_groups(config: KetchConfig, specs: dict[str, tuple]) -> WorkerGroups:
    """The roles colocated in one group, except the critic (`trainer.placement=split`), the reward model
    (`reward.model.placement=split`) and a standalone rollout, which then get a resource pool each (the rollout's
    of `rollout.n_workers_per_node` processes per node)."""
    from ketch.controller.ray_group import RayClassWithInitArgs, RayWorkerGroup
    from ketch.controller.resource_pool import RayResourcePool

    t = config.trainer
    use_gpu = config.uses_gpu(torch.cuda.is_available())
    per_node = t.n_gpus_per_node if use_gpu else t.n_cpu_workers
    placements = {"critic": t.placement, "reward_model": config.reward.model.placement, "rollout": "split"}
    split = [role for role in specs if placements.get(role) == "split" and len(specs) > 1]
    sizes = {role: config.rollout.n_workers_per_node if role == "rollout" else per_node for role in specs}
    connect_ray(t.ray_address, bundles=t.nnodes * (per_node + sum(sizes[role] for role in split)))
    groups = WorkerGroups()
    for pool_roles in ([role for role in specs if role not in split], *([role] for role in split)):
        name = "ketch" if "actor_rollout" in pool_roles else f"ketch-{pool_roles[0]}"
        pool = RayResourcePool([sizes[pool_roles[0]]] * t.nnodes, use_gpu, name=name)
        group = RayWorkerGroup(pool, {r: RayClassWithInitArgs(*specs[r]) for r in pool_roles}, t.worker_timeout)
        for role in pool_roles:
            setattr(groups, role, group.role(role))
        groups.owned.append(group)
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
