"""Metrics of one step computed from the batch on the driver: scores, advantages, lengths, throughput."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from ketch.protocol import DataProto


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    std = values.std().item() if values.numel() > 1 else 0.0
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/std": std,
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def data_metrics(batch: DataProto, max_response_length: int) -> dict[str, float]:
    """Scores and rewards per sequence, advantages/returns/values over valid tokens, lengths."""
    b = batch.batch
    mask = b["response_mask"].bool()
    lengths = b["response_mask"].sum(-1)
    metrics = _stats("critic/score", b["token_level_scores"].sum(-1))
    metrics |= _stats("critic/rewards", b["token_level_rewards"].sum(-1))
    metrics |= _stats("critic/advantages", b["advantages"][mask])
    metrics |= _stats("critic/returns", b["returns"][mask])
    if "values" in b:
        metrics |= _stats("critic/values", b["values"][mask])
        metrics["critic/vf_explained_var"] = explained_variance(b["values"][mask], b["returns"][mask])
    if "entropy" in b:
        metrics["actor/entropy"] = b["entropy"][mask].mean().item()
    metrics |= _stats("response_length", lengths)
    metrics["response_length/clip_ratio"] = truncated_fraction(b["responses"], b["response_mask"], max_response_length)
    metrics |= _stats("prompt_length", b["attention_mask"].sum(-1) - lengths)
    return metrics


def truncated_fraction(responses: torch.Tensor, response_mask: torch.Tensor, max_response_length: int) -> float:
    """Fraction of responses that used every allowed token (cut off rather than stopped)."""
    return (response_mask.sum(-1) >= max_response_length).float().mean().item()


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): how much of the return the critic predicts."""
    var = returns.var()
    if returns.numel() < 2 or var.item() == 0:
        return float("nan")
    return (1 - (returns - values).var() / var).item()


def throughput_metrics(batch: DataProto, step_seconds: float, world_size: int) -> dict[str, float]:
    """Tokens (prompt + response, real tokens only) per second of step time, per device."""
    tokens = batch.batch["attention_mask"].sum().item()
    return {
        "perf/total_num_tokens": tokens,
        "perf/throughput": tokens / step_seconds / world_size,
    }


def validation_metrics(data_sources: np.ndarray, scores: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    """`val/<data_source>/acc` (mean score) per source and the mean response length."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(data_sources, scores, strict=True):
        by_source[str(source)].append(float(score))
    metrics = {f"val/{source}/acc": float(np.mean(values)) for source, values in by_source.items()}
    metrics["val/response_length/mean"] = float(np.mean(lengths))
    return metrics
