"""Metrics of a batch of multi-turn trajectories, from the rollout's per-trajectory columns."""

from __future__ import annotations

import numpy as np


def trajectory_metrics(non_tensor_batch: dict[str, np.ndarray], sampled_tokens: np.ndarray, prefix: str) -> dict:
    """`{prefix}/num_turns/mean`, `tool_calls/mean`, `tool_call_rate` (share of trajectories with a call),
    `tool_error_rate` (errors per call), `tool_timeouts`, `tool_time_s`, `cut_by_max_turns`, `cut_by_length`,
    `turn_length/mean` (sampled tokens per turn); `sampled_tokens` `[batch]`. Empty without multi-turn columns."""
    c = non_tensor_batch
    if "num_turns" not in c:
        return {}
    turns, calls, errors = (np.asarray(c[k], dtype=np.float64) for k in ("num_turns", "tool_calls", "tool_errors"))
    return {
        f"{prefix}/num_turns/mean": float(turns.mean()),
        f"{prefix}/tool_calls/mean": float(calls.mean()),
        f"{prefix}/tool_call_rate": float((calls > 0).mean()),
        f"{prefix}/tool_error_rate": float(errors.sum() / max(calls.sum(), 1.0)),
        f"{prefix}/tool_timeouts": float(np.sum(c["tool_timeouts"])),
        f"{prefix}/tool_time_s": float(np.sum(c["tool_time"])),
        f"{prefix}/cut_by_max_turns": float(np.mean(c["cut_by_max_turns"])),
        f"{prefix}/cut_by_length": float(np.mean(c["cut_by_length"])),
        f"{prefix}/turn_length/mean": float((sampled_tokens / np.maximum(turns, 1)).mean()),
    }
