"""The run report: written at the end of a real run (with sampled validation, pass@k, maj@k and samples.jsonl),
for a crashed or failed run, by `ketch report`; the HTML loads in headless Chromium without console errors."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from ketch.cli import main
from ketch.config import load_config
from ketch.report import write_report
from ketch.report.run import RunRecord
from ketch.report.summary import summarize
from ketch.tracking import read_metrics
from ketch.trainer.loop import RunFailedError
from ketch.trainer.ppo import PPOTrainer
from ketch.workers import ActorRolloutRefWorker

TRACKERS = ("tensorboard", "mlflow")
PLOTS = {"reward", "validation", "kl", "entropy", "response_length", "timing", "throughput"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
GET_CHROMIUM = "Debian/Ubuntu: apt-get install chromium; macOS: brew install --cask chromium"
REQUIRE_CHROMIUM = os.environ.get("KETCH_REQUIRE_CHROMIUM") == "1"
"""Set by `.ci/run`, which installs Chromium: there the browser test fails rather than skips without it."""


def run_overrides(tiny_model_dir: Path, task_files: dict[str, Path], runs: Path) -> list[str]:
    return [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{task_files['train']}]",
        f"data.val_files=[{task_files['val']}]",
        "data.train_batch_size=8",
        "data.max_response_length=8",
        "algorithm.adv_estimator=gae",
        "rollout.n=1",
        "actor.ppo_mini_batch_size=null",
        "trainer.total_steps=3",
        "trainer.test_freq=3",
        "trainer.logger=[jsonl]",
        "trainer.device=cpu",
        f"trainer.default_local_dir={runs}",
    ]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, task_files, tmp_path_factory) -> Path:
    """A 3-step PPO run validating before step 1 and after step 3 with 2 sampled responses per prompt, logging
    to TensorBoard and MLflow too where those extras are installed."""
    overrides = run_overrides(tiny_model_dir, task_files, tmp_path_factory.mktemp("runs"))
    overrides += ["rollout.val.n=2", "rollout.val.do_sample=true", "trainer.val_samples_to_log=2"]
    loggers = ["jsonl", *(name for name in TRACKERS if importlib.util.find_spec(name))]
    overrides += [f"trainer.logger=[{','.join(loggers)}]"]
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        trainer = PPOTrainer(load_config(overrides=overrides))
        trainer.fit()
    return trainer.run_dir


def test_the_loop_names_the_run_for_the_trackers(finished_run):
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra is not installed (pip install 'ketch[tensorboard]')"
    )
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'ketch[mlflow]')")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(finished_run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val/ketch/arithmetic/pass@2")] == [0, 3]
    assert [e.step for e in events.Scalars("critic/score/mean")] == [1, 2, 3]
    client = MlflowClient(tracking_uri=(finished_run / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("ketch").experiment_id])
    assert run.info.run_name == "arithmetic-grpo" and run.info.status == "FINISHED"
    assert run.data.params["trainer.total_steps"] == "3" and run.data.params["rollout.val.n"] == "2"
    assert run.data.metrics["val/ketch/arithmetic/maj_2"] >= 0.0


def test_validation_logs_pass_and_maj_and_writes_samples(finished_run):
    records = read_metrics(finished_run / "metrics.jsonl")
    for record in (records[0], records[-1]):
        assert {"val/ketch/arithmetic/acc", "val/ketch/arithmetic/pass@2", "val/ketch/arithmetic/maj@2"} <= set(record)
        assert 0.0 <= record["val/ketch/arithmetic/acc"] <= record["val/ketch/arithmetic/pass@2"] <= 1.0
    samples = [json.loads(line) for line in (finished_run / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt_id"], s["sample"]) for s in samples] == [
        (step, prompt, sample) for step in (0, 3) for prompt in (0, 1) for sample in (0, 1)
    ]
    first = samples[0]
    assert first["data_source"] == "ketch/arithmetic" and first["prompt"].endswith("=")
    assert set(first) >= {"response", "ground_truth", "score"} and first["score"] in (0.0, 1.0)


def test_a_finished_run_has_its_report_plots_and_summary(finished_run):
    assert {p.stem for p in (finished_run / "plots").glob("*.png")} == PLOTS
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in (finished_run / "plots").glob("*.png"))
    summary = (finished_run / "summary.txt").read_text()
    assert "status: finished: 3 steps of 3" in summary
    assert "val/ketch/arithmetic/pass@2: " in summary and "(step 0) -> " in summary
    assert "reward (mean score): " in summary and " s per step (" in summary
    page = (finished_run / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(PLOTS)
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert "Validation samples (step 3)" in page


def test_ketch_report_on_a_crashed_run(finished_run, tmp_path, capsys):
    crashed = tmp_path / "crashed"
    shutil.copytree(finished_run, crashed)
    for name in ("report.html", "summary.txt"):
        (crashed / name).unlink()
    shutil.rmtree(crashed / "plots")
    lines = [line for line in (crashed / "metrics.jsonl").read_text().splitlines() if '"event"' not in line]
    (crashed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # steps 0-2, step 3 torn
    assert main(["report", str(crashed)]) == 0
    out = capsys.readouterr().out
    assert "status: stopped after step 2 of 3 without an end record" in out and f"{crashed / 'report.html'}" in out
    assert {p.stem for p in (crashed / "plots").glob("*.png")} == PLOTS
    assert (crashed / "summary.txt").read_text().startswith(f"run: {crashed}\n")


def test_ketch_report_on_a_directory_without_metrics(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path} has no metrics.jsonl, so it is not a ketch run directory" in capsys.readouterr().err


def test_a_run_that_fails_for_good_still_writes_its_report(tiny_model_dir, task_files, tmp_path, monkeypatch):
    original = ActorRolloutRefWorker.update_actor

    @functools.wraps(original)  # keeps the dispatch mode that @register put on the method
    def update_actor(self, data):
        if self.updates_seen == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by a test)")
        self.updates_seen += 1
        return original(self, data)

    monkeypatch.setattr(ActorRolloutRefWorker, "updates_seen", 0, raising=False)
    monkeypatch.setattr(ActorRolloutRefWorker, "update_actor", update_actor)
    trainer = PPOTrainer(load_config(overrides=run_overrides(tiny_model_dir, task_files, tmp_path)))
    with pytest.raises(RunFailedError):
        trainer.fit()
    summary = (trainer.run_dir / "summary.txt").read_text()
    assert "status: failed after step 1 of 3: 1 failure(s), 0 recovered" in summary
    assert (
        "failure at step 2: actor_rollout rank 0: update_actor raised OutOfMemoryError: CUDA out of memory" in summary
    )
    assert (trainer.run_dir / "report.html").is_file() and (trainer.run_dir / "plots" / "reward.png").is_file()


def test_the_report_is_rewritten_from_the_files_alone(finished_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    assert write_report(copy) == copy / "report.html"
    assert (copy / "summary.txt").read_text() == (finished_run / "summary.txt").read_text().replace(
        str(finished_run), str(copy)
    )


# ----------------------------------------------------------------- headless Chromium
@pytest.mark.skipif(CHROMIUM is None and not REQUIRE_CHROMIUM, reason=f"Chromium is not installed ({GET_CHROMIUM})")
def test_report_opens_in_headless_chromium_without_console_errors(finished_run, tmp_path):
    assert CHROMIUM is not None, f"KETCH_REQUIRE_CHROMIUM=1 but Chromium is not installed ({GET_CHROMIUM})"
    websocket = pytest.importorskip("websocket", reason="websocket-client is not installed (pip install 'ketch[test]')")
    bad = tmp_path / "bad.html"
    bad.write_text('<!doctype html><title>x</title><script>console.error("boom")</script><img src="missing.png">')
    with Chromium(tmp_path / "profile", websocket) as browser:
        errors, requests, images = browser.load(bad)
        assert any("boom" in e for e in errors), "the check must see console errors to be worth anything"
        errors, requests, images = browser.load(finished_run / "report.html")
    assert errors == []
    assert requests == [(finished_run / "report.html").as_uri()]
    assert images == {"count": len(PLOTS), "loaded": len(PLOTS)}


class Chromium:
    """Headless Chromium driven over the DevTools protocol: load a page, collect its console errors."""

    FLAGS = (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--remote-debugging-port=0",
    )

    def __init__(self, profile: Path, websocket_module):
        self.profile, self.websocket_module = profile, websocket_module

    def __enter__(self) -> Chromium:
        args = [CHROMIUM, *self.FLAGS, f"--user-data-dir={self.profile}", "about:blank"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = self._devtools_port()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            page = next(t for t in json.load(response) if t["type"] == "page")
        self.ws = self.websocket_module.create_connection(
            page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True
        )
        self.next_id, self.events = 0, []
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")
        return self

    def __exit__(self, *exc) -> None:
        self.ws.close()
        self.process.terminate()
        self.process.wait(timeout=20)

    def _devtools_port(self) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (marker.is_file() and marker.read_text().strip()):
            assert self.process.poll() is None and time.monotonic() < deadline, "Chromium did not start"
            time.sleep(0.1)
        return int(marker.read_text().splitlines()[0])

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while (message := json.loads(self.ws.recv())).get("id") != self.next_id:
            self.events.append(message)
        return message.get("result", {})

    def load(self, page: Path) -> tuple[list[str], list[str], dict]:
        """(console errors, URLs requested, images: count and loaded) of `page` once its load event fired."""
        self.events = []
        self.call("Page.navigate", url=page.as_uri())
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(json.loads(self.ws.recv()))
        check = "({count: document.images.length, loaded: [...document.images].filter(i => i.naturalWidth > 0).length})"
        images = self.call("Runtime.evaluate", expression=check, returnByValue=True)["result"]["value"]
        urls = [e["params"]["request"]["url"] for e in self._of("Network.requestWillBeSent")]
        return self._errors(), [u for u in urls if not u.startswith("data:")], images

    def _of(self, method: str) -> list[dict]:
        return [e for e in self.events if e.get("method") == method]

    def _errors(self) -> list[str]:
        errors = [json.dumps(e["params"]["exceptionDetails"]) for e in self._of("Runtime.exceptionThrown")]
        errors += [
            json.dumps(e["params"]["args"])
            for e in self._of("Runtime.consoleAPICalled")
            if e["params"]["type"] in ("error", "assert")
        ]
        errors += [
            e["params"]["entry"]["text"] for e in self._of("Log.entryAdded") if e["params"]["entry"]["level"] == "error"
        ]
        return errors


def test_the_summary_shows_the_tool_call_and_error_rates(tmp_path):
    steps = [
        {"step": s, "multi_turn/tool_call_rate": rate, "multi_turn/tool_error_rate": errors}
        for s, rate, errors in [(1, 0.5, 0.4), (2, 1.0, 0.2), (3, 1.0, 0.0)]
    ]
    text = summarize(RunRecord(tmp_path, steps, [], [], {}))
    # Means of the first and last (up to) ten steps: all three here.
    assert "tool-call rate (trajectories with a call): 0.833 (first 3 steps) -> 0.833 (last 3)" in text
    assert "tool error rate (errors per call): 0.200 (first 3 steps) -> 0.200 (last 3)" in text
