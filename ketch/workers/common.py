"""What the actor and critic workers share: process set-up and the epoch/mini-batch/micro-batch walk."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from ketch.config.batch import UpdatePlan
from ketch.controller import ONE_TO_ALL, register
from ketch.engine.distributed import init_process_group, resolve_device
from ketch.engine.megatron.grid import RankGrid
from ketch.engine.micro import split_micro_batches
from ketch.models.vision import load_image_processor, vision_family
from ketch.protocol import DataProto
from ketch.rollout import Rollout, build_rollout
from ketch.rollout.multi_turn import with_multi_turn

if TYPE_CHECKING:
    from ketch.config.schema import ActorConfig, CriticConfig, KetchConfig


def rollout_engine(
    config: KetchConfig, model_path: str, tokenizer, dtype: torch.dtype, device: torch.device, seed: int
) -> Rollout:
    """The generation backend named by `rollout.name`, inside the turn loop when `rollout.multi_turn.enable` (with a
    vision-language model's processor, for the images of the prompts and the environment's answers)."""
    backend = build_rollout(config, model_path, tokenizer, dtype, device, seed)
    vision = config.rollout.multi_turn.enable and vision_family(model_path) is not None
    return with_multi_turn(backend, config, tokenizer, load_image_processor(model_path, tokenizer) if vision else None)


def setup_process(device_name: str, seed: int) -> torch.device:
    """Pick the device, join the process group and seed every RNG (per rank); returns the device."""
    device = resolve_device(device_name)
    rank, _ = init_process_group(device)
    seed_everything(seed + rank)
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def shuffle_seed(worker, update_count: int) -> int:
    """The seed of one update's mini-batch shuffle: shared by tensor/pipeline peers (Megatron needs every peer
    to see the same rows in the same order) and different between data-parallel ranks."""
    return worker.config.trainer.seed + 7919 * update_count + worker.dispatch_rank()[0]


def token_budget(actor: ActorConfig) -> int | None:
    """Real tokens per micro-batch (`actor.use_dynamic_bsz`) of the actor's, reference's and critic's passes, else
    None (micro-batches count sequences)."""
    return actor.ppo_max_token_len_per_device if actor.use_dynamic_bsz else None


def mini_batches(
    data: DataProto, plan: UpdatePlan, shuffle: bool, seed: int, max_tokens: int | None = None
) -> Iterator[list[DataProto]]:
    """For each epoch and each mini-batch of this rank's share, its list of micro-batches.

    With `shuffle`, rows are permuted each epoch by a generator seeded with `seed` and the epoch."""
    for epoch in range(plan.epochs):
        order = torch.arange(len(data))
        if shuffle:
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for mini in data.reorder(order).split(plan.mini_batch_per_device):
            yield split_micro_batches(mini, plan.micro_batch_per_device, max_tokens)


def mean_over_steps(step_metrics: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Average per-optimizer-step metrics and name them `prefix/<name>`."""
    sums: dict[str, list[float]] = defaultdict(list)
    for metrics in step_metrics:
        for key, value in metrics.items():
            sums[key].append(value)
    return {f"{prefix}/{k}": float(np.mean(v)) for k, v in sums.items()}


def token_share(micro: DataProto, num_tokens: torch.Tensor) -> torch.Tensor:
    """This micro-batch's fraction of the mini-batch's valid tokens (weights metrics so they sum exactly)."""
    return micro.batch["response_mask"].sum() / num_tokens.clamp(min=1)


class DeviceMemory:
    """A worker mixin: the peak accelerator memory of this process, as the benchmarks read it from each rank."""

    @register(ONE_TO_ALL)
    def peak_device_memory(self, reset: bool = False) -> dict[str, float]:
        """`allocated_gib` and `reserved_gib` peaks since the start (or the last reset) on this process's GPU,
        and its `device` name; zeros on a CPU. `reset` starts a new peak after reading."""
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {"allocated_gib": 0.0, "reserved_gib": 0.0, "device": "cpu"}
        peaks = {
            "allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "device": f"cuda:{torch.cuda.current_device()}",
        }
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return peaks


def role_dispatch_rank(
    rank: int, world_size: int, role: ActorConfig | CriticConfig, sequence_parallel: int = 1
) -> tuple[int, bool]:
    """(data-parallel rank, whether this process returns its results) of a process of `role`: under
    `strategy=megatron` tensor/pipeline peers share a data-parallel rank (see `RankGrid`), so do the
    `sequence_parallel` consecutive ranks of a sequence-parallel group (the first answers), else each is its own."""
    if role.strategy != "megatron":
        return rank // sequence_parallel, rank % sequence_parallel == 0
    m = role.megatron
    return RankGrid(rank, world_size, m.tensor_model_parallel_size, m.pipeline_model_parallel_size).dispatch_rank()
