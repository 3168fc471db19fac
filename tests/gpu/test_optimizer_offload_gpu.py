"""On one GPU: AdamW with its moments offloaded to pinned host memory steps as the on-device fused AdamW, bit for
bit, while the GPU holds only its two chunk buffers of moments."""

from __future__ import annotations

import torch
from torch import nn

from ketch.engine.optim import OffloadedAdamW, ShardedFusedAdamW, step_unless

KWARGS = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.05}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1000, 3001), nn.Linear(3001, 999), nn.Linear(999, 7)).cuda()


def test_streamed_chunks_step_as_fused_adamw_on_the_device_and_hold_only_two_chunks():
    """6,009,999 float32 parameters in chunks of 300,007 (21 chunks, cutting through and across tensors), six
    steps with the third skipped: the same weights and moments as ShardedFusedAdamW's with all moments on the GPU."""
    models = [model(), model()]
    before = torch.cuda.memory_allocated()
    offloaded = OffloadedAdamW(models[0].parameters(), chunk_elements=300_007, **KWARGS)
    chunk_bytes = 2 * 2 * 300_007 * 4  # two buffers of both moments
    assert chunk_bytes <= torch.cuda.memory_allocated() - before < chunk_bytes + 512  # rounded up to 512 bytes
    plain = ShardedFusedAdamW(models[1].parameters(), **KWARGS)
    assert offloaded.host[torch.float32].is_pinned()
    for step in range(6):
        for m in models:
            for i, p in enumerate(m.parameters()):
                g = torch.Generator(device="cuda").manual_seed(step * 10 + i)
                p.grad = torch.randn(p.shape, device="cuda", generator=g) * (float("nan") if step == 2 else 1.0)
        skip = torch.tensor(step == 2, device="cuda")
        held = torch.cuda.memory_allocated()
        step_unless(offloaded, skip)
        assert torch.cuda.memory_allocated() - held <= 6 * 512  # the step counts, at the first step
        step_unless(plain, skip)
    for mine, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(mine, theirs)
    states = [o.state_dict()["state"] for o in (offloaded, plain)]
    for key in range(6):
        assert states[0][key]["step"].item() == states[1][key]["step"].item() == 5.0
        for moment in ("exp_avg", "exp_avg_sq"):
            assert states[0][key][moment].device.type == "cpu"
            assert torch.equal(states[0][key][moment], states[1][key][moment].cpu())
