"""The gradients of a training engine's next optimizer step, recorded before the step (which frees them)."""

from __future__ import annotations

import torch

from ketch.engine.engine import TrainEngine


def record_grads(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """A dict that the engine's next optimizer step fills with each trained parameter's full gradient, by name."""
    grads = {}

    def record(*_):
        named = engine.module.named_parameters()
        grads.update({n: p.grad.full_tensor().clone() for n, p in named if p.grad is not None})

    engine.optimizer.register_step_pre_hook(record)
    return grads
