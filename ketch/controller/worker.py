"""`Worker`: the base of every role; it knows its place in the group from the environment."""

from __future__ import annotations

import gc
import os

from ketch.controller.decorator import register
from ketch.controller.dispatch import ONE_TO_ALL


class Worker:
    """Rank, world size, local rank and rendezvous address of this worker process.

    The controller sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (the last two may arrive
    after construction, before `init_model`); without them (the local backend) the worker is rank 0 of a
    world of one."""

    @property
    def rank(self) -> int:
        """This process's rank in its group (`RANK`; 0 without it)."""
        return int(os.environ.get("RANK", 0))

    @property
    def world_size(self) -> int:
        """The number of processes in the group (`WORLD_SIZE`; 1 without it)."""
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def local_rank(self) -> int:
        """This process's rank on its node, the index of its device (`LOCAL_RANK`; 0 without it)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def master_addr(self) -> str | None:
        """The address of rank 0's node for torch.distributed (`MASTER_ADDR`; None until it is set)."""
        return os.environ.get("MASTER_ADDR")

    @property
    def master_port(self) -> str | None:
        """The rendezvous port on rank 0's node (`MASTER_PORT`; None until it is set)."""
        return os.environ.get("MASTER_PORT")

    def dispatch_rank(self) -> tuple[int, bool]:
        """This process's place for data-parallel dispatch (`DataParallelLayout`).

        Every process is its own data-parallel rank unless a role with tensor or pipeline parallelism overrides
        this; asked once when a group starts, so it must not need `init_model`.

        Returns:
            (the data-parallel rank of this process, whether it returns that rank's results).
        """
        return self.rank, True

    @register(ONE_TO_ALL)
    def freeze_long_lived(self) -> None:
        """`freeze_long_lived` in this worker's process."""
        freeze_long_lived()


def freeze_long_lived() -> None:
    """Collect this process's garbage, then move what survives into the permanent generation, which Python's
    collector no longer scans (`gc.freeze`; `gc.unfreeze` undoes it). Frozen objects are still freed when their
    last reference goes; only cycles among them are not collected."""
    gc.collect()
    gc.freeze()
