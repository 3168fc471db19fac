"""AdamW and the learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import math

import torch

from ketch.config.schema import OptimConfig


def build_optimizer(params, config: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over `params` (fused kernels on GPU)."""
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=tuple(config.betas),
        weight_decay=config.weight_decay,
        fused=device.type == "cuda",
    )


def lr_factor(step: int, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based) of `total_steps`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_scheduler == "constant":
        return 1.0
    span = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, total_steps))
