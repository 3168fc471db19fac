"""`WeightBridge` between processes that share no default process group (gloo here; tests/gpu runs NCCL): the
receivers get every tensor bit for bit, in its dtype, from specs published once; a sender whose weights do not
match the specs stops with both named."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ketch.engine.distributed import free_port
from ketch.workers.weight_bridge import WeightBridge, specs_of


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """Two tensors in two dtypes; `version` changes every value."""
    g = torch.Generator().manual_seed(version)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 4, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(4, generator=g)),
    ]


def bridge_rank(rank: int, size: int, port: int, device: str, out: str) -> None:
    """Rank 0 publishes the specs and sends versions 1 and 2, then a renamed tensor; the others receive them."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    bridge = WeightBridge("127.0.0.1", port, rank, size, dev)
    if rank == 0:
        bridge.publish_specs(specs_of(weights(1)))
        for version in (1, 2):
            bridge.send((name, t.to(dev)) for name, t in weights(version))
        try:
            bridge.send([("lm_head.weight", weights(3)[0][1])])
        except RuntimeError as err:
            Path(out, "error.txt").write_text(str(err))
    else:
        bridge.fetch_specs()
        received = [{name: t.cpu() for name, t in bridge.receive()} for _ in (1, 2)]
        torch.save(received, Path(out, f"rank{rank}.pt"))
    sys.stdout.flush()
    os._exit(0)  # see tests/spawned.py: no teardown at interpreter exit


def run_bridge(size: int, device: str, out: Path) -> None:
    mp.start_processes(bridge_rank, args=(size, free_port(), device, str(out)), nprocs=size, start_method="spawn")


def check_received(size: int, out: Path) -> None:
    for rank in range(1, size):
        received = torch.load(out / f"rank{rank}.pt")
        for version, got in zip((1, 2), received, strict=True):
            for name, tensor in weights(version):
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (rank, version, name)
    assert (out / "error.txt").read_text() == (
        "weight bridge: the actor yielded lm_head.weight (11, 4) torch.bfloat16 where the rollout expects "
        "model.embed_tokens.weight (11, 4) torch.bfloat16"
    )


def test_two_receivers_get_every_version_bit_for_bit_over_gloo(tmp_path):
    run_bridge(3, "cpu", tmp_path)
    check_received(3, tmp_path)
