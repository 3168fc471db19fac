"""Where a process sits in the Megatron grid of tensor x data x pipeline ranks (no megatron import).

Megatron-Core orders ranks tensor-innermost and pipeline-outermost (its default order `tp-cp-ep-dp-pp`, with no
context or expert parallelism here): rank = tp_rank + tp * (dp_rank + dp * pp_rank). The engine checks that
`parallel_state` agrees, so the controller can place data from the config alone before any model exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankGrid:
    rank: int
    world: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    def dispatch_rank(self) -> tuple[int, bool]:
        """(data-parallel rank, returns results): outputs live on the last pipeline stage; tensor rank 0 answers."""
        return self.dp_rank, self.tp_rank == 0 and self.pp_rank == self.pp - 1
