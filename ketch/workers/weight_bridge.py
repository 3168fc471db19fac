"""`WeightBridge`: a process group of the actor's rank 0 (bridge rank 0) and every process of a standalone
rollout (`rollout.placement=standalone`; bridge ranks 1..), apart from each worker group's own default group.
After each update the actor's rank 0 broadcasts the full weights over it, tensor by tensor, in the order that
the training engine yields them; the rollout processes receive them into fresh tensors and load them.

The names, shapes and dtypes (`WeightSpec`) go once, through the bridge's key-value store, when it opens.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

SPECS_KEY = "ketch/weight_specs"
TIMEOUT = timedelta(minutes=10)
"""How long a bridge rank waits for the others: to open, for the specs, for each tensor."""


@dataclass(frozen=True)
class WeightSpec:
    """One tensor the bridge carries: its HF name, full shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightBridge:
    """Bridge rank `rank` of `size`, rendezvous at `host:port` (bridge rank 0 hosts the store); nccl between
    GPUs, gloo between CPUs."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: torch.device):
        self.rank, self.device = rank, device
        self.store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=TIMEOUT)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(self.store, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, size, TIMEOUT)
        self.specs: list[WeightSpec] | None = None

    def publish_specs(self, specs: list[WeightSpec]) -> None:
        """Rank 0: what every `send` will carry, in order."""
        self.specs = specs
        self.store.set(SPECS_KEY, pickle.dumps(specs))

    def fetch_specs(self) -> list[WeightSpec]:
        """Receivers: wait for rank 0's specs."""
        self.specs = pickle.loads(self.store.get(SPECS_KEY))
        return self.specs

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: broadcast each tensor (on this process's device); they must match the published specs."""
        for (name, tensor), spec in zip(named_tensors, self.specs, strict=True):
            if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise RuntimeError(
                    f"weight bridge: the actor yielded {name} {tuple(tensor.shape)} {tensor.dtype} where the "
                    f"rollout expects {spec.name} {spec.shape} {spec.dtype}"
                )
            self.group.broadcast([tensor.to(self.device).contiguous()], _root()).wait()

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks 1..: each tensor as rank 0 sends it, in a tensor of its own on this process's device."""
        for spec in self.specs:
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            self.group.broadcast([tensor], _root()).wait()
            yield spec.name, tensor


def _root() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def specs_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[WeightSpec]:
    """The specs of (name, tensor) pairs, in their order."""
    return [WeightSpec(name, tuple(t.shape), t.dtype) for name, t in named_tensors]
