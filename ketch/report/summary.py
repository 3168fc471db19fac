"""The text summary of a run: how it ended, validation and reward from start to end, where the time went."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np

from ketch.report.plots import VALIDATION
from ketch.report.run import RunRecord

WINDOW = 10
"""Steps averaged for the reward "at the start" and "at the end" (single steps are noisy)."""


def summarize(run: RunRecord) -> str:
    """A few lines, each one fact: status, validation, reward, length, time, failures."""
    lines = [f"run: {run.run_dir}", f"status: {status(run)}"]
    lines += _validation_lines(run)
    lines += _trend_line(run, "critic/score/mean", "reward (mean score)")
    lines += _trend_line(run, "response_length/mean", "response length (tokens)")
    lines += _trend_line(run, "actor/entropy", "entropy (nats/token)")
    lines += _trend_line(run, "multi_turn/tool_call_rate", "tool-call rate (trajectories with a call)")
    lines += _trend_line(run, "multi_turn/tool_error_rate", "tool error rate (errors per call)")
    lines += _trend_line(run, "multi_turn/num_turns/mean", "turns per trajectory")
    lines += _time_lines(run)
    failures = [e for e in run.events if e["event"] == "failure"]
    for f in failures:
        when, who = failure_place(f)
        lines.append(f"failure at {when}: {who}: {f.get('error')}")
        lines += [textwrap.indent(f["traceback"], "    ")] if f.get("traceback") else []
    return "\n".join(lines) + "\n"


def status(run: RunRecord) -> str:
    """finished / failed / stopped, with the last step reached (a resumed run is judged by its latest events)."""
    last = run.steps[-1]["step"] if run.steps else None
    of = f" of {run.total_steps}" if run.total_steps else ""
    latest = next((e["event"] for e in reversed(run.events) if e["event"] in ("end", "failure", "recovery")), None)
    if latest == "end":
        return f"finished: {last} steps{of}"
    if latest == "failure":
        failures, recoveries = run.count("failure"), run.count("recovery")
        when = f"after step {last}{of}" if run.steps else "before its first step"
        return f"failed {when}: {failures} failure(s), {recoveries} recovered (see below)"
    if not run.steps:
        return "no step recorded (the run stopped before its first step)"
    return f"stopped after step {last}{of} without an end record (crashed, killed, or still running)"


def failure_place(failure: dict[str, Any]) -> tuple[str, str]:
    """When and where a `failure` event happened, in words: (`step 3`, `step 0 (the validation before
    training)`, or `the export of the model after step 3`; `actor_rollout rank 1`, or `driver` for the driver's own
    failures, which have no rank)."""
    step, role, rank = failure.get("step"), failure.get("role"), failure.get("rank")
    when = "step 0 (the validation before training)" if step == 0 else f"step {step}"
    if failure.get("stage") == "export":
        when = f"the export of the model after step {step}"
    return when, role if rank is None else f"{role} rank {rank}"


def _validation_lines(run: RunRecord) -> list[str]:
    lines = []
    for key in (k for k in run.metric_names() if VALIDATION.match(k)):
        steps, values = run.series(key)
        if len(steps):
            best = int(np.nanargmax(values)) if not np.isnan(values).all() else 0
            lines.append(
                f"{key}: {values[0]:.3f} (step {steps[0]}) -> {values[-1]:.3f} (step {steps[-1]}); "
                f"best {values[best]:.3f} (step {steps[best]})"
            )
    return lines


def _trend_line(run: RunRecord, key: str, label: str) -> list[str]:
    """`label: <mean of the first WINDOW steps> -> <mean of the last WINDOW steps>`."""
    _, values = run.series(key)
    if len(values) == 0:
        return []
    n = min(WINDOW, len(values))
    return [f"{label}: {np.nanmean(values[:n]):.3f} (first {n} steps) -> {np.nanmean(values[-n:]):.3f} (last {n})"]


def _time_lines(run: RunRecord) -> list[str]:
    """Mean step time, total time, the share of each stage, and the mean throughput."""
    _, step_times = run.series("timing_s/step")
    if len(step_times) == 0:
        return []
    _, testing = run.series("timing_s/testing")
    total = step_times.sum() + testing.sum()
    shares = [(run.series(k)[1].sum() / step_times.sum(), k.removeprefix("timing_s/")) for k in run.stage_times()]
    shares.sort(reverse=True)
    lines = [
        f"time: {total:.1f} s in steps and validation; {step_times.mean():.2f} s per step "
        f"({', '.join(f'{name} {share:.0%}' for share, name in shares)})"
    ]
    _, throughput = run.series("perf/throughput")
    if len(throughput):
        lines.append(f"throughput: {np.nanmean(throughput):.0f} tokens/s per device (mean over steps)")
    return lines
