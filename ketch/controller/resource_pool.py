"""`RayResourcePool`: Ray placement groups holding one bundle per device, packed per node."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: its placement group and bundle, its node and its place on that node."""

    placement_group: PlacementGroup
    bundle_index: int
    node_index: int
    local_rank: int


class RayResourcePool:
    """`process_on_nodes[i]` worker processes on node i. A bundle is one GPU (and a CPU) with `use_gpu`,
    else one CPU. Up to `max_colocate_count` worker processes may share one bundle's device (1: all
    roles of a rank share one process, the memory-saving default). Ranks are ordered node by node, so
    the same cluster gives the same rank layout on every start."""

    def __init__(
        self, process_on_nodes: list[int], use_gpu: bool = False, max_colocate_count: int = 1, name: str = "ketch"
    ):
        """Describe the pool; its placement groups are created by the first `slots` call.

        Args:
            process_on_nodes: The number of worker processes on each node.
            use_gpu: Whether a bundle holds a GPU (and a CPU) or only a CPU.
            max_colocate_count: How many worker processes may share one bundle's device.
            name: The prefix of the placement groups' names.

        Raises:
            ValueError: If `process_on_nodes` is empty or lists fewer than one process for a node.
        """
        if not process_on_nodes or min(process_on_nodes) < 1:
            raise ValueError(f"process_on_nodes must list >= 1 process per node, got {process_on_nodes}")
        self.process_on_nodes, self.use_gpu = list(process_on_nodes), use_gpu
        self.max_colocate_count, self.name = max_colocate_count, f"{name}-{uuid.uuid4().hex[:8]}"
        self._groups: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        """The number of worker processes in all."""
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """The resources of one bundle, as Ray names them.

        Returns:
            `{"CPU": 1, "GPU": 1}` with `use_gpu`, else `{"CPU": 1}`.
        """
        return {"CPU": 1, "GPU": 1} if self.use_gpu else {"CPU": 1}

    def slots(self, timeout: float = 120.0) -> list[Slot]:
        """Where each rank runs, creating the placement groups (one per node entry) on first use.

        Args:
            timeout: Seconds to wait for Ray to place the bundles.

        Returns:
            One `Slot` per rank, node by node.

        Raises:
            RuntimeError: If Ray cannot place the bundles within `timeout`.
        """
        if self._groups is None:
            self._groups = self._create(timeout)
        return [
            Slot(group, local, node, local)
            for node, group in enumerate(self._groups)
            for local in range(self.process_on_nodes[node])
        ]

    def _create(self, timeout: float) -> list[PlacementGroup]:
        targets = _nodes_that_fit(self.bundle(), self.process_on_nodes)
        groups = [
            placement_group(
                [self.bundle()] * count, strategy="STRICT_PACK", name=f"{self.name}-{i}", _soft_target_node_id=target
            )
            for i, (count, target) in enumerate(zip(self.process_on_nodes, targets, strict=True))
        ]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout)
        if len(ready) < len(groups):
            self.release(groups)
            raise RuntimeError(
                f"Ray could not place {self.process_on_nodes} worker bundles of {self.bundle()} within {timeout:.0f}s; "
                f"the cluster offers {ray.available_resources()}. Lower trainer.n_gpus_per_node / n_cpu_workers / "
                "nnodes, or add nodes (ray start --address ...)"
            )
        return groups

    def release(self, groups: list[PlacementGroup] | None = None) -> None:
        """Remove placement groups.

        Args:
            groups: The groups to remove (None: the pool's own, which the next `slots` call creates again).
        """
        for group in groups or self._groups or []:
            remove_placement_group(group)
        if groups is None:
            self._groups = None


def _nodes_that_fit(bundle: dict[str, float], process_on_nodes: list[int]) -> list[str | None]:
    """A distinct alive node per entry that can hold its bundles (node ids sorted by address, so the
    choice is stable); `None` lets Ray choose when the cluster has fewer such nodes than entries."""
    nodes = sorted(
        (n for n in ray.nodes() if n.get("Alive")),
        key=lambda n: (n.get("NodeManagerAddress", ""), n.get("NodeManagerPort", 0), n["NodeID"]),
    )
    chosen: list[str | None] = []
    free = [n for n in nodes]
    for count in process_on_nodes:
        fit = next((n for n in free if all(n["Resources"].get(k, 0) >= v * count for k, v in bundle.items())), None)
        if fit is not None:
            free.remove(fit)
        chosen.append(fit["NodeID"] if fit else None)
    if len(process_on_nodes) > 1 and None in chosen:
        raise RuntimeError(
            f"trainer.nnodes={len(process_on_nodes)} needs {len(process_on_nodes)} Ray nodes that each hold "
            f"{max(process_on_nodes)} x {bundle}; the cluster has {len(nodes)} alive node(s). Start more with "
            "`ray start --address <head>:6379` or lower trainer.nnodes"
        )
    return chosen
