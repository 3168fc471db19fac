"""`report.html`: one self-contained page (inline CSS, plots as data URIs, no script, no network)."""

from __future__ import annotations

import base64
import json
from html import escape
from pathlib import Path

from ketch.report.plots import Plot
from ketch.report.run import RunRecord

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 76rem; padding: 0 1rem; color: #222; }
pre { background: #f6f6f6; padding: 0.8rem; overflow-x: auto; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(34rem, 1fr)); gap: 1rem; }
figure { margin: 0; } img { width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.9rem; }
td, th { border: 1px solid #ddd; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
td.text { font-family: monospace; white-space: pre-wrap; max-width: 30rem; }
"""


def render(run: RunRecord, summary: str, plots: list[tuple[Plot, Path]]) -> str:
    """The page: summary, plots, the last validation's samples, the last step's metrics, the config."""
    name = escape(run.run_dir.name)
    parts = [
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>ketch report: {name}</title>',
        f'<link rel="icon" href="data:,"><style>{STYLE}</style></head><body>',
        f"<h1>ketch run: {name}</h1>",
        f'<pre class="summary">{escape(summary)}</pre>',
        '<section class="plots">',
        *(_figure(plot, path) for plot, path in plots),
        "</section>",
        _samples(run),
        _last_metrics(run),
        "<h2>Configuration</h2>",
        f"<details><summary>config.json</summary><pre>{escape(json.dumps(run.config, indent=2))}</pre></details>",
        "</body></html>\n",
    ]
    return "\n".join(parts)


def _figure(plot: Plot, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{escape(plot.title)} over steps" src="data:image/png;base64,{data}">'
        f"<figcaption>{escape(plot.title)} (<code>plots/{escape(path.name)}</code>)</figcaption></figure>"
    )


def _samples(run: RunRecord) -> str:
    """The samples of the last validation step in `samples.jsonl` (the answer column when the scorer gave one)."""
    if not run.samples:
        return ""
    step = run.samples[-1]["step"]
    rows = [r for r in run.samples if r["step"] == step]
    columns = [("prompt", "prompt"), ("response", "response")]
    columns += [("answer", "pred")] if any("pred" in r for r in rows) else []
    columns += [("ground truth", "ground_truth"), ("score", "score")]
    header = "".join(f"<th>{title}</th>" for title, _ in columns)
    body = "".join(
        "<tr>" + "".join(f'<td class="text">{escape(str(r.get(key, "")))}</td>' for _, key in columns) + "</tr>"
        for r in rows
    )
    return f"<h2>Validation samples (step {step})</h2><table><tr>{header}</tr>{body}</table>"


def _last_metrics(run: RunRecord) -> str:
    if not run.steps:
        return ""
    last = run.steps[-1]
    body = "".join(
        f"<tr><td>{escape(k)}</td><td>{v:.6g}</td></tr>"
        if isinstance(v, int | float)
        else f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>"
        for k, v in last.items()
        if k != "step"
    )
    return f"<h2>Metrics of the last step ({last['step']})</h2><table>{body}</table>"
