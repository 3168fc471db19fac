"""Metrics of a batch of multi-turn trajectories, from the rollout's per-trajectory columns, and the console
warnings that make failing tools visible."""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("ketch")

ERROR_PREFIX = "error: "
"""How a failed tool call's reply starts (`ToolEnvironment`)."""


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


class ToolFailureWatch:
    """Failing tools on the console, as reward errors are: one warning at the first failed call, with its error, and
    a summary after every `window` training steps in which more than `threshold` of the calls failed. The model
    reads each failure as the tool's reply, so a tool that always fails trains nothing useful without a word."""

    def __init__(self, threshold: float = 0.5, window: int = 10):
        self.threshold, self.window = threshold, window
        self.warned = False
        self.first_step, self.steps, self.calls, self.errors = 0, 0, 0.0, 0.0

    def __call__(self, non_tensor_batch: dict[str, np.ndarray], step: int) -> None:
        """Count the tool calls and failures of one training step's trajectories (no-op without multi-turn ones)."""
        c = non_tensor_batch
        if "tool_calls" not in c:
            return
        calls, errors = float(np.sum(c["tool_calls"])), float(np.sum(c["tool_errors"]))
        if errors and not self.warned:
            self._warn_first(step, c.get("messages"))
        self.first_step = self.first_step if self.steps else step
        self.steps, self.calls, self.errors = self.steps + 1, self.calls + calls, self.errors + errors
        if self.steps == self.window:
            self._summarise(step)

    def _warn_first(self, step: int, messages: np.ndarray | None) -> None:
        self.warned = True
        logger.warning(
            "a tool call failed at step %d: %s; the model reads the error as the tool's reply (multi_turn/"
            "tool_error_rate counts the failures; a summary follows when more than %.0f%% of the calls of %d steps "
            "fail)",
            step,
            first_error(messages),
            100 * self.threshold,
            self.window,
        )

    def _summarise(self, step: int) -> None:
        """Warn when more than `threshold` of the window's calls failed; start the next window."""
        if self.errors > self.threshold * self.calls:
            logger.warning(
                "tools failed in %d of %d calls (%.0f%%) in steps %d-%d: check the tools (rollout.multi_turn.tools) "
                "and the calls the model writes (samples.jsonl, multi_turn/tool_error_rate)",
                self.errors,
                self.calls,
                100 * self.errors / self.calls,
                self.first_step,
                step,
            )
        self.steps, self.calls, self.errors = 0, 0.0, 0.0


def first_error(messages: np.ndarray | None) -> str:
    """The first failed tool call's reply in the trajectories' `messages` (`<tool>: error: ...`)."""
    for conversation in messages if messages is not None else []:
        for message in conversation:
            content = str(message.get("content", ""))
            if message.get("role") == "tool" and content.startswith(ERROR_PREFIX):
                return f"{message.get('name')}: {content}"
    return "the environment counted a failed call (its stats' tool_errors)"
