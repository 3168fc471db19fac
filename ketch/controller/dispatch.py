"""Dispatch modes: how a WorkerGroup splits one call's arguments over ranks and gathers the results.

A mode is a pair of functions: `dispatch(world_size, args, kwargs) -> (per-rank [(args, kwargs)], context)`
and `collect(results_of_owner_ranks, context) -> result`; `context` carries what the collect step needs to
know about the split (e.g. the padding added). Register new modes with `register_dispatch_mode`.

A data-parallel mode (`DP_COMPUTE_PROTO`) splits over the group's data-parallel ranks, not its processes: with
tensor or pipeline parallelism several processes form one data-parallel rank. They all get that rank's piece
(they compute it together), and one of them (`collect`) returns the result (`DataParallelLayout`).
`PROCESS_COMPUTE_PROTO` splits over every process, for work that needs no two processes to get the same piece:
generation, where each process holds a whole rollout model or, with a tensor-parallel rollout, its group
decodes the pieces of all its processes together and each returns its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ketch.protocol import DataProto, pad_to_divisor, unpad


@dataclass(frozen=True)
class DispatchMode:
    """How a worker group splits one call over its ranks and gathers the results.

    Attributes:
        name: The mode's registered name.
        dispatch: `dispatch(world_size, args, kwargs) -> (per-rank [(args, kwargs)], context)`.
        collect: `collect(results of the ranks that return, in rank order, context) -> result`.
    """

    name: str
    dispatch: Callable[[int, tuple, dict], tuple[list[tuple[tuple, dict]], dict]]
    collect: Callable[[list[Any], dict], Any]
    data_parallel: bool = False
    """Split over data-parallel ranks (`DataParallelLayout`) instead of processes."""


@dataclass(frozen=True)
class DataParallelLayout:
    """Each process's data-parallel rank and whether it returns that rank's results, indexed by process rank."""

    dp_rank: tuple[int, ...]
    collect: tuple[bool, ...]

    @classmethod
    def flat(cls, world: int) -> DataParallelLayout:
        """Every process its own data-parallel rank (FSDP, or no parallelism)."""
        return cls(tuple(range(world)), (True,) * world)

    @classmethod
    def from_ranks(cls, ranks: list[tuple[int, bool]], role: str = "worker") -> DataParallelLayout:
        """From each process's `Worker.dispatch_rank()`; every data-parallel rank 0..n-1 needs one collector."""
        layout = cls(tuple(r for r, _ in ranks), tuple(c for _, c in ranks))
        collectors = sorted(r for r, c in ranks if c)
        if collectors != list(range(layout.dp_size)) or set(layout.dp_rank) != set(collectors):
            raise ValueError(
                f"{role}: data-parallel ranks {list(layout.dp_rank)} with collectors at processes "
                f"{[i for i, c in enumerate(layout.collect) if c]}: each data-parallel rank 0..n-1 needs exactly "
                "one process that returns its results"
            )
        return layout

    @property
    def world_size(self) -> int:
        return len(self.dp_rank)

    @property
    def dp_size(self) -> int:
        return max(self.dp_rank) + 1

    def plan(self, mode: DispatchMode, args: tuple, kwargs: dict) -> tuple[list[tuple[tuple, dict]], dict]:
        """Per-process (args, kwargs) of one call, and the collect context."""
        if not mode.data_parallel:
            return mode.dispatch(self.world_size, args, kwargs)
        calls, context = mode.dispatch(self.dp_size, args, kwargs)
        return [calls[d] for d in self.dp_rank], context

    def gather(self, mode: DispatchMode, results: list[Any], context: dict) -> Any:
        """`mode`'s result from the per-process `results` (all processes, or the one that ran a rank-zero call)."""
        if mode.data_parallel and len(results) == self.world_size:
            by_dp = {self.dp_rank[p]: result for p, result in enumerate(results) if self.collect[p]}
            results = [by_dp[d] for d in range(self.dp_size)]
        return mode.collect(results, context)


_MODES: dict[str, DispatchMode] = {}


def register_dispatch_mode(mode: DispatchMode) -> DispatchMode:
    """Register `mode` under its name, replacing a mode registered under the same name.

    Args:
        mode: The mode.

    Returns:
        `mode`, for use with `@register(dispatch=...)`.
    """
    _MODES[mode.name] = mode
    return mode


def get_dispatch_mode(name: str) -> DispatchMode:
    if name not in _MODES:
        raise ValueError(f"unknown dispatch mode {name!r}; registered: {sorted(_MODES)}")
    return _MODES[name]


def _same_to_all(world: int, args: tuple, kwargs: dict) -> tuple[list[tuple[tuple, dict]], dict]:
    return [(args, kwargs)] * world, {}


def _one_per_rank(world: int, args: tuple, kwargs: dict) -> tuple[list[tuple[tuple, dict]], dict]:
    for value in (*args, *kwargs.values()):
        if not isinstance(value, list | tuple) or len(value) != world:
            raise ValueError(f"ALL_TO_ALL needs every argument to be a list of {world} per-rank values")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)], {}


def _split_protos(world: int, args: tuple, kwargs: dict) -> tuple[list[tuple[tuple, dict]], dict]:
    """Chunk every DataProto argument over ranks, padding it to a multiple of the world size; the pad is
    removed from the gathered result by `_concat_protos`."""
    pads = set()
    chunked_args = [_chunk(a, world, pads) for a in args]
    chunked_kwargs = {k: _chunk(v, world, pads) for k, v in kwargs.items()}
    if len(pads) > 1:
        raise ValueError("DP_COMPUTE_PROTO: the DataProto arguments of one call must have the same length")
    calls = [(tuple(c[r] for c in chunked_args), {k: c[r] for k, c in chunked_kwargs.items()}) for r in range(world)]
    return calls, {"pad": pads.pop() if pads else 0}


def _chunk(value: Any, world: int, pads: set[int]) -> list[Any]:
    if not isinstance(value, DataProto):
        return [value] * world
    padded, pad = pad_to_divisor(value, world)
    pads.add(pad)
    return padded.chunk(world)


def _concat_protos(results: list[Any], context: dict) -> Any:
    if not all(isinstance(r, DataProto) for r in results):
        return results
    merged = DataProto.concat(results)
    merged.meta_info["metrics"] = mean_metrics([r.meta_info.get("metrics", {}) for r in results])
    return unpad(merged, context.get("pad", 0))


def mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the ranks that report it."""
    keys = dict.fromkeys(k for m in per_rank for k in m)
    return {k: float(np.mean([m[k] for m in per_rank if k in m])) for k in keys}


ONE_TO_ALL = register_dispatch_mode(DispatchMode("ONE_TO_ALL", _same_to_all, lambda results, _: results))
ALL_TO_ALL = register_dispatch_mode(DispatchMode("ALL_TO_ALL", _one_per_rank, lambda results, _: results))
RANK_ZERO = register_dispatch_mode(DispatchMode("RANK_ZERO", _same_to_all, lambda results, _: results[0]))
DP_COMPUTE_PROTO = register_dispatch_mode(DispatchMode("DP_COMPUTE_PROTO", _split_protos, _concat_protos, True))
PROCESS_COMPUTE_PROTO = register_dispatch_mode(DispatchMode("PROCESS_COMPUTE_PROTO", _split_protos, _concat_protos))
"""Every process its own piece and its own result, tensor/pipeline peers included (each piece computed once)."""
