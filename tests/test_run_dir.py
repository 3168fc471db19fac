"""A run owns its directory: a second run on it stops at once with one line, and the lock dies with the process that
held it (issue 55). The lock is held by a small helper process where that proves the same thing as a training run;
two real `ketch train` processes prove the rest."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import ROOT, cli_error, ketch_env

from ketch.cli import main
from ketch.doctor import run_checks
from ketch.trainer.checkpoint import CheckpointManager
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.run_dir import removed_if_start_fails
from ketch.trainer.run_lock import LOCK_FILE, RunDirBusyError, RunDirLock, holder
from ketch.trainer.sft import SFTTrainer

HOLD = (
    "import sys, time; from ketch.trainer.run_lock import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
    "print('held', flush=True); time.sleep(float(sys.argv[2]))"
)


def hold(run_dir: Path, seconds: float = 600) -> subprocess.Popen:
    """A process that holds the lock of `run_dir` for `seconds` or until it is killed (returned once it holds it)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir), str(seconds)], stdout=subprocess.PIPE, text=True, env=ketch_env()
    )
    assert process.stdout.readline() == "held\n"
    return process


def busy_line(run_dir: Path, pid: int) -> str:
    return (
        f"the run directory {run_dir} is in use by another run, pid {pid} on host {socket.gethostname()} "
        "(python -c); set another trainer.experiment_name (or trainer.default_local_dir), or wait until that run "
        "ends\n"
    )


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
def test_a_second_run_on_a_held_directory_stops_before_any_model_loads(command, capsys, tmp_path):
    """The model path does not exist and the data files neither: the lock is what the run checks first."""
    run_dir = tmp_path / "runs" / "x"
    holding = hold(run_dir)
    try:
        message = cli_error(
            capsys,
            command,
            f"model.path={tmp_path / 'no-model'}",
            f"data.train_files=[{tmp_path / 'no-data.parquet'}]",
            f"trainer.default_local_dir={tmp_path / 'runs'}",
            "trainer.experiment_name=x",
        )
    finally:
        holding.kill()
        holding.wait()
    assert message == busy_line(run_dir, holding.pid)
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]


def test_the_lock_file_names_its_holder_and_a_killed_holder_leaves_no_lock(tmp_path):
    holding = hold(tmp_path)
    owner = holder(tmp_path)
    assert (owner["host"], owner["pid"], owner["command"]) == (socket.gethostname(), holding.pid, "python -c")
    with pytest.raises(RunDirBusyError):
        RunDirLock(tmp_path).acquire()
    holding.send_signal(signal.SIGKILL)
    holding.wait()
    assert holder(tmp_path) is None
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_lock_held_for_an_instant_does_not_stop_a_start(tmp_path):
    """`holder` (a starting run's own check, `ketch doctor`) takes the lock for an instant: a run starting then
    waits that instant out (`PROBE_GRACE_S`, 0.5 s) instead of calling the directory busy."""
    brief = hold(tmp_path, seconds=0.2)
    with RunDirLock(tmp_path):
        assert holder(tmp_path) is not None
    brief.wait()


def test_doctor_flags_a_run_directory_in_use(tmp_path):
    holding = hold(tmp_path / "x")
    try:
        rows = {
            r.name: r for r in run_checks(None, [f"trainer.default_local_dir={tmp_path}", "trainer.experiment_name=x"])
        }
    finally:
        holding.kill()
        holding.wait()
    row = rows["run dir"]
    assert row.status == "FAIL"
    assert row.detail == (
        f"the run directory {tmp_path / 'x'} is in use by another run, pid {holding.pid} on host "
        f"{socket.gethostname()} (python -c)"
    )
    assert row.fix == "set another trainer.experiment_name (or trainer.default_local_dir), or wait until that run ends"


def test_a_failed_start_removes_a_directory_that_held_only_its_lock(tmp_path):
    run_dir = tmp_path / "x"
    with RunDirLock(run_dir), pytest.raises(ValueError), removed_if_start_fails(run_dir):
        raise ValueError("the start failed")
    assert not run_dir.exists()


def ketch_train(tiny_model_dir: Path, task_files: dict[str, Path], runs: Path, *extra: str) -> subprocess.Popen:
    args = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{task_files['train']}]",
        "data.train_batch_size=8",
        "data.max_response_length=8",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=null",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.device=cpu",
        f"trainer.default_local_dir={runs}",
        "trainer.experiment_name=x",
        *extra,
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "ketch", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ketch_env(),
        cwd=ROOT,
    )


def test_two_ketch_train_started_together_one_stops_and_the_other_finishes_untouched(
    tiny_model_dir, task_files, tmp_path
):
    runs = tmp_path / "runs"
    first = ketch_train(tiny_model_dir, task_files, runs, "trainer.total_steps=3", "trainer.seed=1")
    second = ketch_train(tiny_model_dir, task_files, runs, "trainer.total_steps=3", "trainer.seed=2")
    outputs = {p.pid: p.communicate(timeout=300)[1] for p in (first, second)}
    codes = {p.pid: p.returncode for p in (first, second)}
    assert sorted(codes.values()) == [0, 2], outputs
    winner, loser = sorted(codes, key=codes.get)
    line = busy_line(runs / "x", winner).replace("(python -c)", "(ketch train)")
    assert outputs[loser] == f"ketch train: error: {line}"
    seed = json.loads((runs / "x" / "config.json").read_text())["trainer"]["seed"]
    assert seed == (1 if winner == first.pid else 2)
    records = map(json.loads, (runs / "x" / "metrics.jsonl").open())
    assert [r["step"] for r in records if "event" not in r] == [1, 2, 3]
    assert "finished 3 steps" in outputs[winner] and (runs / "x" / "model" / "config.json").is_file()


def test_after_a_kill_9_the_next_run_resumes(tiny_model_dir, task_files, tmp_path):
    runs = tmp_path / "runs"
    first = ketch_train(tiny_model_dir, task_files, runs, "trainer.total_steps=40", "trainer.save_freq=1")
    deadline = time.monotonic() + 300
    while not (runs / "x" / "checkpoints" / "global_step_1" / "trainer_state.json").is_file():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert holder(runs / "x") is None
    latest = CheckpointManager(runs / "x" / "checkpoints").latest()
    step = int(latest.name.removeprefix("global_step_"))
    again = ketch_train(tiny_model_dir, task_files, runs, f"trainer.total_steps={step + 1}")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert f"resumed from {latest} at step {step}" in err + out and f"finished {step + 1} steps" in err + out


def test_export_and_report_read_a_held_run_directory(tiny_config, tmp_path, capsys):
    """A live run's checkpoint exports, and its report is written, while the run holds its directory."""
    trainer = PPOTrainer(tiny_config("trainer.total_steps=1"))
    trainer.fit()
    holding = hold(trainer.run_dir)
    try:
        checkpoint = trainer.run_dir / "checkpoints" / "global_step_1"
        assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
        assert main(["report", str(trainer.run_dir)]) == 0
    finally:
        holding.kill()
        holding.wait()
    assert (tmp_path / "exported" / "model.safetensors").is_file() and (trainer.run_dir / "report.html").is_file()
    assert holder(trainer.run_dir) is None


def test_sft_holds_its_run_directory_while_it_trains_and_gives_it_up_at_the_end(tiny_config):
    config = tiny_config("trainer.total_steps=1", "trainer.test_freq=1")
    sft = SFTTrainer(config, model_path=config.model.path)
    held = []
    sft.fit(stop_when=lambda metrics: held.append(holder(sft.run_dir)) or False)
    assert [h["pid"] for h in held] == [os.getpid()]
    assert holder(sft.run_dir) is None
