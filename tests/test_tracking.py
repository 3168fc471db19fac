"""Trackers write where they say, read back with each library's own reader: TensorBoard event files, an MLflow
file store, an offline wandb run; metrics.jsonl and samples.jsonl survive resumes and torn last lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ketch.tracking import Tracker, TrackerError, read_metrics, read_records
from ketch.tracking.backends import mlflow_key

STEPS = {1: {"critic/score/mean": 0.25, "val/a/pass@4": 0.5}, 2: {"critic/score/mean": 0.75, "val/a/pass@4": 1.0}}


def log_steps(tracker: Tracker) -> None:
    for step, metrics in STEPS.items():
        tracker.log(metrics | {"note": "text is kept out of the trackers"}, step)
    tracker.close()


def test_tensorboard_event_files_hold_every_scalar(tmp_path):
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra is not installed (pip install 'ketch[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(Tracker(tmp_path, ["jsonl", "tensorboard"], total_steps=2))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"critic/score/mean", "val/a/pass@4"}
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("val/a/pass@4")] == [(1, 0.5), (2, 1.0)]


def test_tensorboard_hides_the_steps_a_resumed_run_repeats(tmp_path):
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra is not installed (pip install 'ketch[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(Tracker(tmp_path, ["tensorboard"], total_steps=2))
    resumed = Tracker(tmp_path, ["tensorboard"], total_steps=2)
    resumed.truncate_after(1)
    resumed.log({"critic/score/mean": 0.5}, 2)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]


def test_mlflow_file_store_in_the_run_dir_receives_params_and_metrics(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'ketch[mlflow]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    config = {"actor": {"optim": {"lr": 0.001}}, "trainer": {"logger": ["mlflow"]}}
    log_steps(Tracker(tmp_path, ["mlflow"], 2, project="proj", experiment="exp", config=config))
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert run.data.params == {"actor.optim.lr": "0.001", "trainer.logger": "['mlflow']"}
    history = client.get_metric_history(run.info.run_id, "val/a/pass_4")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 1.0)]
    assert mlflow_key("val/a/pass@4") == "val/a/pass_4"


def test_wandb_offline_run_receives_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'ketch[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    log_steps(Tracker(tmp_path, ["wandb"], 2, project="proj", experiment="exp", config={"seed": 3}))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    inspect = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    lines = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h["critic/score/mean"], h["val/a/pass@4"]) for h in history] == [
        (1, 0.25, 0.5),
        (2, 0.75, 1.0),
    ]
    summary = subprocess.run([*inspect, "--summary"], capture_output=True, text=True, check=True).stdout
    assert json.loads(summary)["name"] == "exp" and json.loads(summary)["config"]["seed"] == 3


@pytest.mark.parametrize(
    ("logger", "module"),
    [("wandb", "wandb"), ("mlflow", "mlflow.tracking"), ("tensorboard", "torch.utils.tensorboard")],
)
def test_a_missing_library_names_the_install_command(tmp_path, monkeypatch, logger, module):
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a module that cannot be imported
    with pytest.raises(TrackerError, match=rf"pip install 'ketch\[{logger}\]'"):
        Tracker(tmp_path, ["jsonl", logger], total_steps=1)


def test_resume_drops_later_steps_and_samples_but_keeps_events(tmp_path):
    tracker = Tracker(tmp_path, ["jsonl"], total_steps=3)
    for step in (1, 2, 3):
        tracker.log({"x": step}, step)
        tracker.log_samples([{"prompt_id": 0, "response": f"r{step}"}], step)
    tracker.event("failure", step=3)
    tracker.truncate_after(1)
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert [r["event"] for r in read_records(tmp_path / "metrics.jsonl") if "event" in r] == ["failure"]
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [
        {"step": 1, "prompt_id": 0, "response": "r1"}
    ]


def test_a_last_line_cut_by_a_crash_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x"')
    assert read_records(path) == [{"step": 1, "x": 1}]
