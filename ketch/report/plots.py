"""PNG plots of a run over its steps, drawn with matplotlib's object API on the Agg canvas (no display needed)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ketch.report.run import RunRecord

VALIDATION = re.compile(r"^val/.+/(acc|pass@\d+|maj@\d+)$")
KL_KEYS = ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")


@dataclass(frozen=True)
class Plot:
    name: str
    """File name without `.png`."""
    title: str
    ylabel: str
    draw: Callable[[Axes, RunRecord], bool]
    """Draws on the axes; False when the run has none of the plot's metrics."""


def write_plots(run: RunRecord, out_dir: Path) -> list[tuple[Plot, Path]]:
    """Every plot the run has data for, as `out_dir/<name>.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for plot in PLOTS:
        figure = Figure(figsize=(7.0, 3.4), dpi=100)
        figure.subplots_adjust(
            left=0.11, right=0.98, top=0.9, bottom=0.15
        )  # fixed margins: a layout engine doubles the time
        ax = figure.add_subplot()
        if not plot.draw(ax, run):
            continue
        ax.set(title=plot.title, xlabel="step", ylabel=plot.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize="small")
        path = out_dir / f"{plot.name}.png"
        figure.savefig(path)
        written.append((plot, path))
    return written


def _smoothed(values: np.ndarray) -> np.ndarray:
    """A centred moving average over about 1/20 of the points (edges average what they have)."""
    window = max(1, len(values) // 20)
    kernel = np.ones(window)
    return np.convolve(values, kernel, "same") / np.convolve(np.ones_like(values), kernel, "same")


def _curve(ax: Axes, run: RunRecord, key: str, label: str | None = None) -> bool:
    """The raw values faintly and their moving average; False when `key` has no values."""
    steps, values = run.series(key)
    if len(steps) == 0:
        return False
    if len(steps) > 25:
        (line,) = ax.plot(steps, values, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _smoothed(values), color=line.get_color(), label=label or key)
    else:
        ax.plot(steps, values, marker=".", label=label or key)
    return True


def _band(ax: Axes, run: RunRecord, low_key: str, high_key: str) -> None:
    steps, low = run.series(low_key)
    high_steps, high = run.series(high_key)
    if len(steps) and np.array_equal(steps, high_steps):
        ax.fill_between(steps, low, high, alpha=0.12, linewidth=0)


def _reward(ax: Axes, run: RunRecord) -> bool:
    """The mean score of each step's responses (before any KL penalty, which the KL plot shows)."""
    return _curve(ax, run, "critic/score/mean")


def _validation(ax: Axes, run: RunRecord) -> bool:
    keys = [k for k in run.metric_names() if VALIDATION.match(k)]
    values = [run.series(key) for key in keys]
    for key, (steps, value) in zip(keys, values, strict=True):
        ax.plot(steps, value, marker="o", markersize=4, label=key.removeprefix("val/"))
    if all(((v >= 0) & (v <= 1)).all() for _, v in values):
        ax.set_ylim(-0.02, 1.02)  # accuracies of 0/1 scores: the whole range, so that progress reads true
    return bool(keys)


def _kl(ax: Axes, run: RunRecord) -> bool:
    return any([_curve(ax, run, key) for key in KL_KEYS])


def _entropy(ax: Axes, run: RunRecord) -> bool:
    return _curve(ax, run, "actor/entropy", "mean token entropy")


def _length(ax: Axes, run: RunRecord) -> bool:
    _band(ax, run, "response_length/min", "response_length/max")
    drawn = _curve(ax, run, "response_length/mean", "training responses (mean; band: min-max)")
    steps, values = run.series("val/response_length/mean")
    if len(steps):
        ax.plot(steps, values, marker="o", markersize=4, label="validation responses (mean)")
    return drawn or bool(len(steps))


def _timing(ax: Axes, run: RunRecord) -> bool:
    """Seconds per stage, stacked: the height is the step time."""
    stages = run.stage_times()
    steps = np.array([r["step"] for r in run.steps if any(k in r for k in stages)])
    if not stages or len(steps) == 0:
        return False
    by_step = {r["step"]: r for r in run.steps}
    seconds = [[float(by_step[s].get(k, 0.0)) for s in steps] for k in stages]
    ax.stackplot(steps, seconds, labels=[k.removeprefix("timing_s/") for k in stages], alpha=0.85)
    return True


def _throughput(ax: Axes, run: RunRecord) -> bool:
    return _curve(ax, run, "perf/throughput", "tokens / s / device")


PLOTS = (
    Plot("reward", "Reward", "score", _reward),
    Plot("validation", "Validation", "accuracy", _validation),
    Plot("kl", "KL divergence", "KL", _kl),
    Plot("entropy", "Policy entropy", "nats / token", _entropy),
    Plot("response_length", "Response length", "tokens", _length),
    Plot("timing", "Time per stage", "seconds", _timing),
    Plot("throughput", "Throughput", "tokens / s / device", _throughput),
)
