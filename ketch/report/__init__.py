"""The run report: `report.html` (self-contained), PNG plots in `plots/` and `summary.txt`, from a run directory.

Written at the end of every run and when a run fails for good; `ketch report RUN_DIR` writes it for any run,
also one that crashed (partial metrics, no end record).
"""

from __future__ import annotations

from pathlib import Path

from ketch.report.html import render
from ketch.report.plots import write_plots
from ketch.report.run import ReportError, RunRecord
from ketch.report.summary import summarize

__all__ = ["ReportError", "RunRecord", "summarize", "write_report"]


def write_report(run_dir: str | Path) -> Path:
    """Write `summary.txt`, `plots/*.png` and `report.html` into `run_dir`; returns the path of the HTML."""
    run = RunRecord.load(run_dir)
    summary = summarize(run)
    plots = write_plots(run, run.run_dir / "plots")
    (run.run_dir / "summary.txt").write_text(summary)
    path = run.run_dir / "report.html"
    path.write_text(render(run, summary, plots))
    return path
