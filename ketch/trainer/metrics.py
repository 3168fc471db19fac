"""Metrics of one step computed from the batch on the driver: scores, advantages, lengths, throughput."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

from ketch.algorithms import truncated
from ketch.protocol import DataProto
from ketch.rollout.multi_turn.metrics import trajectory_metrics


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
    metrics["response_length/clip_ratio"] = truncated_fraction(batch, max_response_length)
    metrics |= _stats("prompt_length", b["attention_mask"][:, : -b["responses"].shape[1]].sum(-1))
    metrics |= trajectory_metrics(batch.non_tensor_batch, lengths.numpy(), "multi_turn")
    return metrics


def truncated_fraction(batch: DataProto, max_response_length: int) -> float:
    """Fraction of the batch's responses that used every allowed token (cut off rather than stopped; `truncated`)."""
    b = batch.batch
    return truncated(b["response_mask"], b["attention_mask"], max_response_length).float().mean().item()


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


CORRECT_SCORE = 1.0
"""A validation response counts as correct (for pass@k and maj@k) when its score is at least this: full credit.
Partial credit (a format bonus of 0.1, say) is not a solved problem."""


def validation_metrics(
    data_sources: np.ndarray,
    scores: np.ndarray,
    lengths: np.ndarray,
    answers: Sequence[Any] | None = None,
    n: int = 1,
) -> dict[str, float]:
    """Per data source: `val/<source>/acc` (the mean of `scores` over every response, i.e. mean@1; the caller
    passes each response's correctness, see `validation.accuracies`) and, when `n` > 1,
    `val/<source>/pass@k` for k in `pass_k_values(n)` and, given `answers`, `val/<source>/maj@n`; then
    `val/response_length/mean`.

    Rows come in groups of `n` consecutive responses to one prompt. `answers` (one per row; None = no answer)
    are what the majority vote counts."""
    if n < 1 or len(scores) % n:
        raise ValueError(f"validation_metrics needs whole groups of n={n} responses per prompt; got {len(scores)} rows")
    per_prompt = np.asarray(scores, dtype=np.float64).reshape(-1, n)
    sources = np.array([str(s) for s in data_sources[::n]], dtype=object)
    metrics: dict[str, float] = {}
    for source in dict.fromkeys(sources):
        rows = np.flatnonzero(sources == source)
        metrics[f"val/{source}/acc"] = float(per_prompt[rows].mean())
        if n == 1:
            continue
        correct = per_prompt[rows] >= CORRECT_SCORE
        for k in pass_k_values(n):
            metrics[f"val/{source}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(1)]))
        if answers is not None:
            votes = [majority_correct(answers[p * n : (p + 1) * n], correct[i]) for i, p in enumerate(rows)]
            metrics[f"val/{source}/maj@{n}"] = float(np.mean(votes))
    metrics["val/response_length/mean"] = float(np.mean(lengths))
    return metrics


def pass_k_values(n: int) -> list[int]:
    """The k of pass@k logged for `n` samples per prompt: 2, 4, 8, ... below n, and n itself (none for n = 1;
    pass@1 is the mean accuracy `acc` for 0/1 scores)."""
    if n < 2:
        return []
    return [k for k in (2**i for i in range(1, n.bit_length())) if k < n] + [n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. 2021, 1 - C(n-c, k) / C(n, k): the chance that k responses
    drawn without replacement from `n`, of which `c` are correct, hold at least one correct one."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[Any], correct: Sequence[bool]) -> bool:
    """Whether the most frequent answer among one prompt's responses is a correct one (maj@k).

    None answers abstain; a tie goes to the answer given first; the answer's correctness is that of the first
    response giving it (a deterministic scorer scores equal answers alike). False when every response abstains."""
    votes: dict[Any, int] = {}
    first_correct: dict[Any, bool] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is None:
            continue
        key = answer if isinstance(answer, Hashable) else repr(answer)
        votes[key] = votes.get(key, 0) + 1
        first_correct.setdefault(key, bool(ok))
    if not votes:
        return False
    return first_correct[max(votes, key=votes.__getitem__)]
