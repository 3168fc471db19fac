"""`WeightBridge`: a process group of the actor's rank 0 (bridge rank 0) and every process of a standalone
rollout (`rollout.placement=standalone`; bridge ranks 1..), apart from each worker group's own default group.
After each update the actor's rank 0 broadcasts the full weights over it, tensor by tensor, in the order that
the training engine yields them; the rollout processes receive them into fresh tensors and load them.

The names, shapes and dtypes (`WeightSpec`) go once, through the bridge's key-value store, when it opens.
`BridgeSender` is the actor worker's side.
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ketch.controller import ONE_TO_ALL, register

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


class BridgeSender:
    """The actor worker's calls that send its weights to a standalone rollout. The worker gives `rank`, `device`,
    `bridge` (None until rank 0 joins) and `_rollout_weights()`: the (HF name, full tensor) pairs of a hand-off."""

    @register(ONE_TO_ALL)
    def join_weight_bridge(self, host: str, port: int, rollout_processes: int) -> None:
        """Rank 0 opens bridge rank 0 (of 1 + `rollout_processes`) at `host:port` and publishes the weights' specs;
        every rank takes part in gathering them once."""
        specs = specs_of(self._rollout_weights())
        if self.rank == 0:
            self.bridge = WeightBridge(host, port, 0, 1 + rollout_processes, self.device)
            self.bridge.publish_specs(specs)

    @register(ONE_TO_ALL)
    def send_weights(self) -> float:
        """Gather the full weights (every rank) and broadcast them to the standalone rollout (rank 0); returns the
        seconds it took."""
        start = time.perf_counter()
        weights = self._rollout_weights()
        if self.bridge is not None:
            self.bridge.send(weights)
        else:
            deque(weights, maxlen=0)  # the other ranks' part of each gather
        return time.perf_counter() - start
