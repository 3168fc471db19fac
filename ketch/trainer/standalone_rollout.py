"""`StandaloneRollout`: the driver's side of a rollout on processes of its own (`rollout.placement=standalone`).

After each actor update the driver has the actor's ranks send their weights over the weight bridge while the
rollout's processes receive them. With `rollout.staleness=1` the driver also starts the next step's generation
(and scoring) in a thread as soon as this step's batch is taken, so that it runs on the rollout's devices while
this step's log-probs and updates run on the actor's; the weights sent after this step's update wait for it.
Step t's responses therefore come from the weights before update t - 1 (one step off-policy), and a resumed or
recovered run's first step is generated afresh from the current weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ketch.workers.actor import CHECKED_WEIGHT, check_weight_norms

logger = logging.getLogger("ketch")


class StandaloneRollout:
    """`actor` and `rollout` are the role groups joined by the weight bridge (see `trainer.groups`)."""

    def __init__(self, actor, rollout, check_weight_sync: bool = False):
        self.actor, self.rollout, self.check_weight_sync = actor, rollout, check_weight_sync
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ketch-rollout")
        self.pending: tuple[int, Future] | None = None

    def start(self, step: int, produce: Callable[..., Any], *args: Any) -> None:
        """Run `produce(*args)` in the driver's rollout thread now, for `step` to `take`."""
        self.pending = (step, self.pool.submit(produce, *args))

    def take(self, step: int, produce: Callable[..., Any], *args: Any) -> Any:
        """The result of what was started for `step`, else of `produce(*args)` run now."""
        if self.pending is None or self.pending[0] != step:
            return produce(*args)
        future, self.pending = self.pending[1], None
        return future.result()

    def send_weights(self) -> dict[str, float]:
        """Wait for a generation in flight (it finishes with the weights it began with), then move the actor's
        weights to the rollout; returns the seconds of each (`wait_gen`, `weight_sync`)."""
        from ketch.controller.ray_group import get_together  # Ray is imported where it is used

        start = time.perf_counter()
        if self.pending is not None:
            self.pending[1].result()
        sent = time.perf_counter()
        get_together([self.actor.async_send_weights(), self.rollout.async_receive_weights()])
        if self.check_weight_sync:
            actor_norm = self.actor.weight_norm(CHECKED_WEIGHT)[0]
            for norm in self.rollout.weight_norm(CHECKED_WEIGHT):
                check_weight_norms(norm, actor_norm, CHECKED_WEIGHT)
        return {"wait_gen": sent - start, "weight_sync": time.perf_counter() - sent}

    def close(self) -> None:
        """Let a generation in flight end (its groups may be gone: its error is only logged) and stop the thread."""
        if self.pending is not None:
            try:
                self.pending[1].result()
            except Exception as err:  # the run has already failed or ended; this result has no step to serve
                logger.info("a generation started ahead ended with %s", type(err).__name__)
            self.pending = None
        self.pool.shutdown()
