"""`Worker`: the base of every role; it knows its place in the group from the environment."""

from __future__ import annotations

import os


class Worker:
    """Rank, world size, local rank and rendezvous address of this worker process.

    The controller sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT before the worker is
    built; without them (the local backend) the worker is rank 0 of a world of one."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.master_addr = os.environ.get("MASTER_ADDR")
        self.master_port = os.environ.get("MASTER_PORT")
