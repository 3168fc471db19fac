"""torch.distributed set-up: one process group per worker process, gloo on CPU and nccl on GPU."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port that was free a moment ago on this host."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_device(name: str) -> torch.device:
    """`auto` is the process's CUDA device when one is visible, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but torch sees no GPU; use trainer.device=cpu (or auto)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def init_process_group(device: torch.device) -> tuple[int, int]:
    """Join (or create) the default process group; returns (rank, world_size).

    Reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as set by the controller; without them this process
    is a world of one (the local backend)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if device.type == "cuda" else None)
    return rank, world


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (a no-op in a world of one)."""
    return _all_reduce(value, dist.ReduceOp.SUM)


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of a tensor over all ranks (a no-op in a world of one)."""
    return _all_reduce(value, dist.ReduceOp.MAX)


def _all_reduce(value: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=op)
    return value
