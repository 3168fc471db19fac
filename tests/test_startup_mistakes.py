"""The start-up mistakes of issue 55: each is one message naming the key and the fix, exit 2 and no traceback, before
any model loads (the model path does not exist, so a run that got that far would say so instead), and `ketch doctor`
flags each one instead of `ready to run`. docs/errors.md lists them."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from commands import ROOT, cli_error, ketch_env
from transformers import AutoConfig

from ketch.config import ConfigError, load_config
from ketch.controller.errors import HOST_MEMORY_FIX
from ketch.doctor import run_checks
from ketch.doctor.config_checks import host_memory_row


def start(capsys, tmp_path, task_files, *overrides: str) -> str:
    """`ketch train` on the task files with a model path that does not exist: the user error's message."""
    return cli_error(
        capsys,
        "train",
        f"model.path={tmp_path / 'no-model'}",
        f"data.train_files=[{task_files['train']}]",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
        *overrides,
    )


def doctor_row(name: str, *overrides: str):
    return next(row for row in run_checks(None, list(overrides)) if row.name == name)


def test_a_missing_tools_file_is_named(capsys, tmp_path, task_files):
    missing = tmp_path / "missing.py"
    overrides = ("rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{missing}]")
    message = start(capsys, tmp_path, task_files, *overrides)
    assert message == f"rollout.multi_turn.tools: the tools file {missing} does not exist\n"
    row = doctor_row("tools", *overrides)
    assert (row.status, row.detail) == ("FAIL", message.rstrip())


def test_an_unknown_tool_names_the_registered_ones(capsys, tmp_path, task_files):
    overrides = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]")
    message = start(capsys, tmp_path, task_files, *overrides)
    assert message == (
        "rollout.multi_turn.tools: unknown tool 'calculator'; registered tools: ['calculate', 'draw_dots', "
        "'python'], or give a path/to/tools.py file\n"
    )
    assert doctor_row("tools", *overrides).status == "FAIL"


def test_a_tools_file_with_a_syntax_error_names_the_file_and_the_error(capsys, tmp_path, task_files):
    broken = tmp_path / "broken_tools.py"
    broken.write_text("def add(a, b)\n    return a + b\n")
    overrides = ("rollout.multi_turn.enable=true", f"rollout.multi_turn.tools=[{broken}]")
    message = start(capsys, tmp_path, task_files, *overrides)
    assert message.startswith(f"rollout.multi_turn.tools: importing the tools file {broken} failed: SyntaxError: ")
    assert message.count("\n") == 1
    assert doctor_row("tools", *overrides).status == "FAIL"


def test_a_missing_environment_file_is_named(capsys, tmp_path, task_files):
    spec = f"{tmp_path / 'missing.py'}:Env"
    overrides = ("rollout.multi_turn.enable=true", f"rollout.multi_turn.environment={spec}")
    message = start(capsys, tmp_path, task_files, *overrides)
    assert message == (f"rollout.multi_turn.environment='{spec}': give path/to/env.py:ClassName of an existing file\n")
    assert doctor_row("tools", *overrides).status == "FAIL"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_2_without_flash_attn_names_the_key_and_sdpa(capsys, tmp_path, task_files):
    message = start(capsys, tmp_path, task_files, "model.attn_implementation=flash_attention_2")
    assert message == (
        "cannot start the run:\n  - model.attn_implementation=flash_attention_2, but flash_attn is not installed: "
        "pip install flash-attn, or set model.attn_implementation=sdpa\n"
    )
    row = doctor_row("attention", "model.attn_implementation=flash_attention_2")
    assert (row.status, row.fix) == ("FAIL", "pip install flash-attn, or set model.attn_implementation=sdpa")


def test_lora_target_modules_without_a_rank_say_that_lora_is_off(capsys, tmp_path, task_files):
    message = start(capsys, tmp_path, task_files, "actor.lora.target_modules=[nonexistent_proj]")
    assert message == (
        "invalid configuration:\n  - actor.lora.target_modules=[nonexistent_proj] is set, but actor.lora.rank=0: "
        "LoRA is off and every weight trains; set actor.lora.rank (e.g. 16) to train adapters, or drop "
        "actor.lora.target_modules\n"
    )
    assert doctor_row("config", "actor.lora.target_modules=[nonexistent_proj]").status == "FAIL"
    with pytest.raises(ConfigError, match=r"critic.lora.alpha=16.0 is set, but critic.lora.rank=0: LoRA is off"):
        load_config(overrides=["critic.lora.alpha=16"])


def test_tools_without_multi_turn_say_that_the_rollout_is_single_turn(capsys, tmp_path, task_files):
    message = start(capsys, tmp_path, task_files, "rollout.multi_turn.tools=[missing.py]")
    assert message == (
        "invalid configuration:\n  - rollout.multi_turn.tools=[missing.py] is set, but rollout.multi_turn.enable="
        "false: the rollout is single-turn and never uses it; set rollout.multi_turn.enable=true (or drop it)\n"
    )
    assert doctor_row("config", "rollout.multi_turn.tools=[missing.py]").status == "FAIL"
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.max_turns=6 is set, but rollout.multi_turn.enable="):
        load_config(overrides=["rollout.multi_turn.max_turns=6"])


def test_sequence_parallel_over_cpu_workers_points_to_trainer_device_cpu(capsys, tmp_path, task_files):
    overrides = ("actor.ulysses_sequence_parallel_size=3", "trainer.n_cpu_workers=3", "model.use_remove_padding=true")
    message = start(capsys, tmp_path, task_files, *overrides)
    assert message == (
        "invalid configuration:\n  - actor.ulysses_sequence_parallel_size=3 does not divide the 1 worker processes "
        "(trainer.nnodes x trainer.n_gpus_per_node) that trainer.device=auto starts where a GPU is visible; set "
        "trainer.device=cpu to use the 3 CPU workers of trainer.n_cpu_workers, or trainer.n_gpus_per_node to a "
        "multiple of 3\n"
    )
    assert doctor_row("config", *overrides).status == "FAIL"


def test_host_memory_exhausted_while_ray_starts_the_workers_is_one_line_with_the_figures(
    tmp_path, tiny_model_dir, task_files
):
    """Ray's memory monitor, told to kill above 1% of the host's memory, kills the first worker that starts: the
    same report as a host that is really full."""
    env = ketch_env(RAY_memory_usage_threshold="0.01", RAY_memory_monitor_refresh_ms="100")
    args = [
        f"model.path={tiny_model_dir}",
        "trainer.n_cpu_workers=2",
        "trainer.device=cpu",
        "trainer.experiment_name=x",
    ]
    args += [f"data.train_files=[{task_files['train']}]", f"trainer.default_local_dir={tmp_path / 'runs'}"]
    result = subprocess.run(
        [sys.executable, "-m", "ketch", "train", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith("ketch train: error: actor_rollout rank ")
    assert "worker process killed by Ray's memory monitor during start-up (node " in line
    assert "above Ray's kill threshold of 1% (RAY_memory_usage_threshold); the killed worker used " in line
    assert line.endswith(
        "each worker process holds its models in host memory while they load: start fewer (trainer.n_cpu_workers, "
        "trainer.n_gpus_per_node), load smaller weights (model.dtype=bfloat16), free the host's memory, or raise "
        "Ray's kill threshold (RAY_memory_usage_threshold, when nothing else needs the memory)"
    )
    assert not (tmp_path / "runs" / "x").exists()


def test_a_resume_path_that_does_not_exist_is_called_so(capsys, tmp_path, task_files):
    missing = tmp_path / "runs" / "old" / "checkpoints" / "global_step_3"
    message = start(capsys, tmp_path, task_files, f"trainer.resume_mode={missing}")
    assert message == (
        f"cannot start the run:\n  - trainer.resume_mode={missing}: no such checkpoint directory: give a checkpoint "
        "directory (<run dir>/checkpoints/global_step_N), or trainer.resume_mode=auto\n"
    )
    assert doctor_row("resume", f"trainer.resume_mode={missing}").status == "FAIL"


def test_doctor_flags_worker_processes_that_need_more_host_memory_than_is_available(tiny_model_dir):
    """4 CPU workers each load the tiny model's 21,920 float32 parameters (4 x 87,680 bytes), and the CPU training
    state adds 16 bytes per parameter (350,720): 701,440 bytes against 500,000 available."""
    config = load_config(overrides=[f"model.path={tiny_model_dir}", "trainer.n_cpu_workers=4", "trainer.device=cpu"])
    row = host_memory_row(config, AutoConfig.from_pretrained(tiny_model_dir), available=500_000)
    assert (row.status, row.fix) == ("FAIL", HOST_MEMORY_FIX)
    assert row.detail == (
        "about 701440 bytes (685.0 KiB) for 4 worker process(es) x 1 model(s) of 21,920 parameters; 500000 bytes "
        "(488.3 KiB) available"
    )
    assert host_memory_row(config, AutoConfig.from_pretrained(tiny_model_dir), available=10**9).status == "ok"
