"""The `ketch` command line: config show, and one clear line for bad input instead of a traceback."""

from __future__ import annotations

import subprocess
import sys

import yaml

from ketch.cli import main


def test_config_show_prints_the_resolved_yaml(capsys):
    assert main(["config", "show", "--data.train_batch_size", "32", "rollout.n=2"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["data"]["train_batch_size"] == 32 and shown["rollout"]["n"] == 2


def test_config_show_without_arguments_prints_the_builtin_runs_own_settings(capsys):
    assert main(["config", "show"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["rollout"]["n"], shown["trainer"]["total_steps"], shown["actor"]["optim"]["lr"]) == (16, 190, 1.5e-4)


def test_unknown_key_exits_2_with_a_suggestion(capsys):
    assert main(["train", "trainer.total_step=3"]) == 2
    err = capsys.readouterr().err
    assert "ketch train: error: unknown config key 'trainer.total_step'" in err
    assert "did you mean trainer.total_steps" in err


def test_missing_model_is_reported_without_a_traceback(capsys, tmp_path):
    assert main(["train", f"model.path={tmp_path / 'missing'}"]) == 2
    assert "model path" in capsys.readouterr().err


def test_missing_data_file_names_the_file(capsys, tiny_model_dir, tmp_path):
    missing = tmp_path / "nope.parquet"
    assert main(["train", f"model.path={tiny_model_dir}", f"data.train_files={missing}"]) == 2
    assert str(missing) in capsys.readouterr().err


def test_python_dash_m_ketch_runs_the_same_cli():
    result = subprocess.run(
        [sys.executable, "-m", "ketch", "config", "show", "--trainer.total_steps", "7"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "total_steps: 7" in result.stdout
