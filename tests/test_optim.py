"""ShardedFusedAdamW: the fused AdamW step on each rank's local shards is torch's AdamW step, and a step skipped
on the device (a non-finite gradient norm) changes nothing. OffloadedAdamW (moments in host buffers, stepped in
chunks) steps as it does, and their checkpoints interchange, also through DCP over two ranks."""

from __future__ import annotations

import os
from functools import partial

import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from spawned import end_rank
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ketch.engine.distributed import free_port, init_process_group
from ketch.engine.engine import shard
from ketch.engine.optim import OffloadedAdamW, ShardedFusedAdamW, step_unless

CPU = torch.device("cpu")


def sharded_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(4, 4))
    return shard(model, CPU, None)


def test_steps_on_local_shards_equal_torch_fused_adamw_on_dtensors():
    init_process_group(CPU)
    models = [sharded_model(), sharded_model()]
    assert all(isinstance(p, DTensor) for p in models[0].parameters())
    kwargs = {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.05}
    optimizers = [
        ShardedFusedAdamW(models[0].parameters(), **kwargs),
        torch.optim.AdamW(models[1].parameters(), fused=True, **kwargs),
    ]
    start = [p.full_tensor().clone() for p in models[0].parameters()]
    for step in range(3):
        for model, optimizer in zip(models, optimizers, strict=True):
            for i, p in enumerate(model.parameters()):
                # the last layer's bias gets no gradient: it keeps its value and gets no state
                p.grad = None if i == 5 else torch.full_like(p, 0.5 + step) * (i + 1)
            optimizer.step()
    ours, torchs = ([p.full_tensor() for p in m.parameters()] for m in models)
    for mine, theirs in zip(ours, torchs, strict=True):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
    assert (ours[0] != start[0]).all()  # lr 0.1: every weight moved
    assert torch.equal(ours[5], start[5])
    states = [o.state_dict()["state"] for o in optimizers]
    assert sorted(states[0]) == sorted(states[1]) == [0, 1, 2, 3, 4]
    for key in states[1]:
        assert states[0][key]["step"].item() == states[1][key]["step"].item() == 3.0
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                states[0][key][moment].full_tensor(), states[1][key][moment].full_tensor(), atol=0, rtol=0
            )


def test_a_step_skipped_on_the_device_leaves_weights_moments_and_counts():
    """Three steps with a skipped one between them equal two plain steps, for both kinds of optimizer."""
    init_process_group(CPU)
    kwargs = {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.05}
    for kind in (ShardedFusedAdamW, torch.optim.AdamW):
        models = [sharded_model(), sharded_model()]
        skipping, plain = (kind(m.parameters(), **kwargs) for m in models)
        for step, skip in enumerate((False, True, False)):
            for p in models[0].parameters():
                p.grad = torch.full_like(p, float("nan") if skip else 0.5 + step)
            step_unless(skipping, torch.tensor(skip))
        for step in (0, 2):
            for p in models[1].parameters():
                p.grad = torch.full_like(p, 0.5 + step)
            plain.step()
        for mine, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor(), atol=0, rtol=0)
        for state in skipping.state_dict()["state"].values():
            assert state["step"].item() == 2.0
            assert torch.isfinite(state["exp_avg_sq"].full_tensor()).all()


def test_offloaded_moments_step_in_chunks_as_sharded_fused_adamw_and_checkpoints_interchange():
    """Chunks of 7 columns cut through parameters and across them; the last layer's bias gets no gradient, and
    the second of three steps is skipped. Weights equal ShardedFusedAdamW's bit for bit, moments to float32
    rounding; the moments live in the host buffer; each optimizer takes a fourth step from the other's state
    dict as from its own."""
    init_process_group(CPU)
    models = [sharded_model(), sharded_model()]
    kwargs = {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.05}
    offloaded = OffloadedAdamW(models[0].parameters(), chunk_elements=7, **kwargs)
    plain = ShardedFusedAdamW(models[1].parameters(), **kwargs)
    assert offloaded.host[torch.float32].shape == (2, 8 * 16 + 16 + 16 * 4 + 4 + 4 * 4 + 4)

    def step(optimizers, step, skip=False):
        for model, optimizer in zip(models, optimizers, strict=True):
            for i, p in enumerate(model.parameters()):
                p.grad = None if i == 5 else torch.full_like(p, float("nan") if skip else 0.5 + step) * (i + 1)
            step_unless(optimizer, torch.tensor(skip))

    for n, skip in enumerate((False, True, False)):
        step((offloaded, plain), n, skip)
    for mine, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor(), atol=0, rtol=0)
    states = [o.state_dict()["state"] for o in (offloaded, plain)]
    assert sorted(states[0]) == sorted(states[1]) == [0, 1, 2, 3, 4]
    host = offloaded.host[torch.float32]
    for key in states[1]:
        assert states[0][key]["step"].item() == states[1][key]["step"].item() == 2.0
        for moment in ("exp_avg", "exp_avg_sq"):
            mine = states[0][key][moment]
            assert isinstance(mine, DTensor)
            assert host.untyped_storage().data_ptr() <= mine.to_local().data_ptr() < host.data_ptr() + host.nbytes
            # the CPU kernel's vector body and scalar tail round a moment's last bit apart where a chunk cuts in
            torch.testing.assert_close(mine.full_tensor(), states[1][key][moment].full_tensor(), atol=0, rtol=3e-7)

    swapped = [OffloadedAdamW(models[1].parameters(), chunk_elements=5, **kwargs)]
    swapped.append(ShardedFusedAdamW(models[0].parameters(), **kwargs))
    swapped[0].load_state_dict(plain.state_dict())
    swapped[1].load_state_dict(offloaded.state_dict())
    step((swapped[1], swapped[0]), 3)
    for mine, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(mine.full_tensor(), theirs.full_tensor(), atol=0, rtol=3e-7)
    assert swapped[0].state_dict()["state"][0]["step"].item() == 3.0


def _two_rank_checkpoints(rank: int, world: int, port: int, directory: str) -> None:
    """Both optimizers step twice on two ranks, each saves its state with DCP, and a fresh optimizer of the other
    kind loads it: its moments are the saved ones, whole, and a third step gives the same weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    init_process_group(CPU)
    kwargs = {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.05}
    kinds = {"offloaded": partial(OffloadedAdamW, chunk_elements=7), "plain": ShardedFusedAdamW}
    runs = {name: (model := sharded_model(), kind(model.parameters(), **kwargs)) for name, kind in kinds.items()}
    for name, (model, optimizer) in runs.items():
        for step in range(2):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.full_like(p, 0.5 + step) * (i + 1)
            optimizer.step()
        model_state, optim_state = get_state_dict(model, [optimizer])
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{directory}/{name}")
    for name, other in (("offloaded", "plain"), ("plain", "offloaded")):
        model = sharded_model()
        optimizer = kinds[other](model.parameters(), **kwargs)
        model_state, optim_state = get_state_dict(model, [optimizer])
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=f"{directory}/{name}")
        set_state_dict(model, [optimizer], model_state_dict=state["model"], optim_state_dict=state["optim"])
        saved = runs[name][1].state_dict()["state"]
        for key, entry in optimizer.state_dict()["state"].items():
            assert entry["step"].item() == 2.0
            for moment in ("exp_avg", "exp_avg_sq"):
                assert entry[moment].to_local().shape[0] == saved[key][moment].full_tensor().shape[0] // world
                torch.testing.assert_close(
                    entry[moment].full_tensor(), saved[key][moment].full_tensor(), atol=0, rtol=0
                )
        runs[f"{name} into {other}"] = (model, optimizer)
    for model, optimizer in runs.values():
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 2.5) * (i + 1)
        optimizer.step()
    weights = [[p.full_tensor() for p in model.parameters()] for model, _ in runs.values()]
    for other in weights[1:]:
        for mine, theirs in zip(weights[0], other, strict=True):
            torch.testing.assert_close(mine, theirs, atol=0, rtol=3e-7)
    end_rank()


def test_offloaded_state_checkpoints_with_dcp_over_two_ranks_and_interchanges(tmp_path):
    mp.start_processes(_two_rank_checkpoints, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
