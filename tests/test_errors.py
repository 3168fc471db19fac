"""Errors a user can act on: each failure says what, where and what to do, and a failed run stays readable
(docs/errors.md lists them). One test per pattern; every test fails on the code before issue 13, those of the model
export, torch's short write, the validation before training and reward.on_error=zero in validation on the code before
issue 40."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import resource
import shutil
import sys
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
from commands import cli_error, run_cli

from ketch.config import ConfigError, DataConfig, KetchConfig, load_config, to_yaml
from ketch.config.constraints import RANGES
from ketch.controller.errors import WorkerError
from ketch.data import DatasetError, RLHFDataset, build_char_tokenizer
from ketch.disk import size_text
from ketch.models import save_tiny_model
from ketch.rewards import RewardError
from ketch.tracking import read_metrics
from ketch.trainer.checkpoint import CheckpointManager
from ketch.trainer.loop import RunFailedError
from ketch.trainer.ppo import PPOTrainer
from ketch.workers import ActorRolloutRefWorker


def failure_events(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for line in lines if (r := json.loads(line)).get("event") == "failure"]


def test_a_worker_failure_carries_its_cause_everywhere_and_leaves_no_step_0_checkpoint(
    tiny_config, monkeypatch, caplog
):
    """The fault hook (as in test_faults.py): the actor's generate_sequences raises in the first step, locally."""

    @functools.wraps(ActorRolloutRefWorker.generate_sequences)
    def generate_sequences(self, prompts):
        raise ValueError("prompt 3 has no tokens (injected by a test)")

    monkeypatch.setattr(ActorRolloutRefWorker, "generate_sequences", generate_sequences)
    trainer = PPOTrainer(tiny_config())
    with caplog.at_level(logging.ERROR, logger="ketch"), pytest.raises(RunFailedError) as err:
        trainer.fit()
    cause = "generate_sequences raised ValueError: prompt 3 has no tokens (injected by a test)"
    worker_line = 'raise ValueError("prompt 3 has no tokens (injected by a test)")'  # the worker-side frame
    assert f"step 1: actor_rollout rank 0: {cause}" in str(err.value) and worker_line in str(err.value)
    (event,) = failure_events(trainer.run_dir)
    assert (event["step"], event["role"], event["rank"], event["error"]) == (1, "actor_rollout", 0, cause)
    assert worker_line in event["traceback"] and "test_errors.py" in event["traceback"]
    assert cause in caplog.text and worker_line in caplog.text
    summary = (trainer.run_dir / "summary.txt").read_text()
    assert f"failure at step 1: actor_rollout rank 0: {cause}" in summary and worker_line in summary
    assert "ValueError: prompt 3 has no tokens" in (trainer.run_dir / "report.html").read_text()
    # the untrained model is not saved as step 0, so the next plain run starts fresh instead of resuming from it
    assert trainer.checkpoints.complete() == []


@pytest.mark.slow
def test_a_failed_checkpoint_write_says_so_keeps_the_previous_checkpoint_and_writes_the_report(tiny_config, tmp_path):
    """A real failed write: the second run may write no file over 300 kB (RLIMIT_FSIZE); a checkpoint shard of the
    tiny model is ~460 kB, report.html ~160 kB."""
    config = tiny_config("trainer.total_steps=1")
    PPOTrainer(config).fit()  # global_step_1, written without a limit
    (tmp_path / "run.yaml").write_text(to_yaml(config).replace("total_steps: 1\n", "total_steps: 2\n"))
    result = run_cli("train", "--config-path", str(tmp_path / "run.yaml"), file_size_limit=300_000)
    run_dir = Path(config.trainer.default_local_dir) / config.trainer.experiment_name
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    message = result.stderr.split("ketch train: error: ", 1)[1]
    assert message.startswith(f"could not write the checkpoint of step 2 to {run_dir.resolve() / 'checkpoints'}")
    assert "File too large" in message and " bytes (" in message and "GiB) are free on" in message
    assert f"{run_dir / 'checkpoints' / 'global_step_1'} stays the latest checkpoint" in message
    assert (run_dir / "checkpoints" / "latest").read_text() == "global_step_1"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["global_step_1", "latest"]
    summary = (run_dir / "summary.txt").read_text()
    assert "failure at step 2: driver: CheckpointError: could not write the checkpoint of step 2" in summary
    assert "CheckpointError" in (run_dir / "report.html").read_text()


@pytest.mark.slow
def test_a_failed_model_export_leaves_no_model_dir_says_what_it_needs_and_writes_the_report(
    tiny_config, tmp_path, task_files
):
    """A real failed write of `model/`: the first run trains and checkpoints with no limit (its `model/` is then
    deleted); the same command again resumes the finished run, so it only exports, and may write no file over
    250 kB (RLIMIT_FSIZE). The actor's weights (hidden size 64, the tied output projection written too) are 87,104
    float32 numbers, 348,416 bytes: 351,152 bytes of model.safetensors with its header."""
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "max_positions": 128}
    model_dir = save_tiny_model(tmp_path / "model-64", build_char_tokenizer(), **sizes)
    config = tiny_config(f"model.path={model_dir}", "trainer.total_steps=1")
    trainer = PPOTrainer(config)
    trainer.fit()
    shutil.rmtree(trainer.run_dir / "model")
    (tmp_path / "run.yaml").write_text(to_yaml(config))
    result = run_cli("train", "--config-path", str(tmp_path / "run.yaml"), file_size_limit=250_000)
    run_dir, checkpoint = trainer.run_dir.resolve(), trainer.run_dir / "checkpoints" / "global_step_1"
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    message = result.stderr.split("ketch train: error: ", 1)[1]
    free = re.search(r"and (\d+) bytes \(\d+\.\d [KMGT]iB\) are free", message).group(1)
    assert message == (
        f"could not write the model to {run_dir / 'model'} (SafetensorError: Error while serializing: I/O error: "
        f"File too large (os error 27)); its weights need about 348416 bytes (340.2 KiB) and {size_text(int(free))} "
        f"are free on {run_dir}. the checkpoint {checkpoint} holds the trained model: "
        "free space (or set trainer.default_local_dir to a larger disk), then run the same command again: it resumes "
        "from global_step_1 and writes the model\n"
    )
    assert sorted(p.name for p in run_dir.iterdir() if "model" in p.name) == []  # no model/, no .tmp-model-*
    summary = (run_dir / "summary.txt").read_text()
    assert "status: failed after step 1 of 1: 1 failure(s), 0 recovered" in summary
    assert "failure at the export of the model after step 1: driver: ExportError: could not write the model" in summary
    assert "[ERROR] the export of the model after step 1 failed (driver): ExportError" in result.stderr
    assert "ExportError" in (run_dir / "report.html").read_text()
    again = run_cli("train", "--config-path", str(tmp_path / "run.yaml"))  # space freed: the same command
    assert again.returncode == 0, again.stderr
    assert (run_dir / "model" / "model.safetensors").stat().st_size == 351152


def test_a_short_write_of_torch_says_no_space_left_and_without_a_checkpoint_that_the_run_starts_again(tmp_path):
    """torch's zip writer reports a full disk as `unexpected pos N vs M`; the message says it in words, and with
    no earlier checkpoint it says where the next run starts (as the driver sees it: inside a worker's error)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    err = WorkerError("actor_rollout", 0, "save_checkpoint raised RuntimeError: ...", short_write)
    message = str(CheckpointManager(root).io_failure(2, err))
    free = re.search(r"; (\d+) bytes", message).group(1)
    assert message == (
        f"could not write the checkpoint of step 2 to {root / 'global_step_2'} (No space left on device; torch's "
        f"file writer stopped short: unexpected pos 704 vs 598); {size_text(int(free))} are "
        f"free on {root}. there is no earlier checkpoint. Free space (or set trainer.default_local_dir to a larger "
        "disk, or trainer.max_checkpoints_to_keep), then run the same command again: it starts again from step 1"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10**12, hard))  # a file size limit (ulimit -f) that nothing here hits
    try:
        message = str(CheckpointManager(root).io_failure(2, err))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (
        "(File too large: this process may write files of at most 1000000000000 bytes (ulimit -f); torch's" in message
    )


def test_a_reward_error_in_the_validation_before_training_is_labelled_so(tiny_config, tmp_path, caplog):
    """The driver's own failure has no rank, and the run failed before its first step, at the validation of step 0."""
    scorer = tmp_path / "my_reward.py"
    scorer.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n    return {}[ground_truth]\n")
    trainer = PPOTrainer(tiny_config(f"reward.function={scorer}:score", "trainer.val_before_train=true"))
    with caplog.at_level(logging.ERROR, logger="ketch"), pytest.raises(RewardError):
        trainer.fit()
    (event,) = failure_events(trainer.run_dir)
    assert (event["step"], event["role"], event["rank"]) == (0, "driver", None)
    cause = f"RewardError: reward scorer reward.function={scorer}:score failed on sample 0"
    assert f"step 0 (the validation before training) failed (driver): {cause}" in caplog.text
    summary = (trainer.run_dir / "summary.txt").read_text()
    assert "status: failed before its first step: 1 failure(s), 0 recovered (see below)\n" in summary
    assert f"failure at step 0 (the validation before training): driver: {cause}" in summary


def test_reward_errors_in_validation_are_counted_with_on_error_zero(tiny_config, tmp_path):
    scorer = tmp_path / "my_reward.py"
    scorer.write_text("def score(data_source, solution_str, ground_truth, extra_info):\n    return {}[ground_truth]\n")
    config = tiny_config(
        f"reward.function={scorer}:score",
        "reward.on_error=zero",
        "trainer.val_before_train=true",
        "trainer.total_steps=1",
    )
    trainer = PPOTrainer(config)
    trainer.fit()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [(r["step"], r.get("val/reward/num_errors"), r.get("reward/num_errors")) for r in records] == [
        (0, 16.0, None),  # the 16 validation prompts
        (1, None, 8.0),  # the 8 prompts of a training batch
    ]


def test_an_unwritable_output_dir_stops_the_run_before_any_model_loads(capsys, tmp_path, task_files):
    blocker = tmp_path / "a-file"  # a directory cannot be made under a file, even by root
    blocker.write_text("")
    message = cli_error(
        capsys,
        "train",
        f"model.path={tmp_path / 'no-model'}",  # checked after the output dir: this error must not come first
        f"data.train_files=[{task_files['train']}]",
        f"trainer.default_local_dir={blocker / 'runs'}",
    )
    assert message.startswith(f"cannot start the run:\n  - cannot write in {blocker} (Not a directory)")
    assert "set trainer.default_local_dir to a directory you can write" in message


def test_an_unwritable_cache_dir_stops_the_run_before_anything_is_built(capsys, monkeypatch, tmp_path):
    """The default run builds its data and model in the cache directory: one that cannot be written is named."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KETCH_CACHE_DIR", str(blocker / "cache"))
    message = cli_error(capsys, "train", f"trainer.default_local_dir={tmp_path / 'runs'}")
    assert message == (
        f"cannot start the run:\n  - cannot write the ketch cache directory {blocker / 'cache'} (Not a directory): "
        "set KETCH_CACHE_DIR to a folder you can write (ketch keeps built-in data, models and compiled code there)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_rollout_vllm_without_vllm_stops_the_run_before_any_model_loads(capsys, monkeypatch, tmp_path):
    """Everything the run needs is imported already; the directories that hold vLLM's metadata leave sys.path."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not any(Path(p).glob("vllm*.dist-info"))])
    message = cli_error(
        capsys,
        "train",
        "rollout.name=vllm",
        f"model.path={tmp_path / 'no-model'}",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
    )
    assert message.startswith("cannot start the run:\n  - not installed, and rollout.name=vllm: pip install 'vllm>=")
    assert message.endswith("or set rollout.name=hf\n")
    assert not (tmp_path / "runs").exists()


def test_a_training_set_smaller_than_one_batch_is_a_one_line_error(capsys, tmp_path, tiny_model_dir, task_files):
    rows = pq.read_table(task_files["train"]).slice(0, 5)
    pq.write_table(rows, tmp_path / "five.parquet")
    message = cli_error(
        capsys,
        "train",
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{tmp_path / 'five.parquet'}]",
        "data.train_batch_size=8",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
    )
    assert message == (
        "the training set has 5 prompts, fewer than one batch (data.train_batch_size=8); lower the batch size "
        "or add data\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_start_that_fails_after_the_run_directory_was_made_removes_it(capsys, tmp_path, tiny_model_dir, task_files):
    """The workers start, then the checkpoint to resume from turns out not to be complete."""
    missing = tmp_path / "elsewhere" / "global_step_3"
    missing.mkdir(parents=True)
    message = cli_error(
        capsys,
        "train",
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{task_files['train']}]",
        "data.train_batch_size=8",
        "trainer.device=cpu",
        "trainer.val_before_train=false",
        f"trainer.resume_mode={missing}",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
    )
    assert message.startswith(f"{missing} is not a complete ketch checkpoint")
    assert not (tmp_path / "runs" / "arithmetic-ppo").exists()


def test_train_files_take_a_directory_of_shards_a_glob_and_say_when_a_path_does_not_exist(tmp_path, task_files):
    table = pq.read_table(task_files["train"]).slice(0, 9)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):  # rows 0-2, 3-5, 6-8
        pq.write_table(table.slice(3 * i, 3), shards / f"part-{i:02d}.parquet")
    (shards / "README.md").write_text("not data")
    tokenizer, config = build_char_tokenizer(), DataConfig()
    whole = RLHFDataset([str(shards)], tokenizer, config)
    assert len(whole) == 9 and whole.rows.locate(7) == f"{shards / 'part-02.parquet'}, row 1"
    unsharded = RLHFDataset([str(task_files["train"])], tokenizer, config)
    assert [whole[i]["raw_prompt"] for i in range(9)] == [unsharded[i]["raw_prompt"] for i in range(9)]
    picked = RLHFDataset([str(shards / "part-0[02].parquet")], tokenizer, config)
    assert len(picked) == 6 and picked.rows.files == [str(shards / "part-00.parquet"), str(shards / "part-02.parquet")]
    with fsspec.open("memory://bucket/data/a.parquet", "wb") as f:  # a URL directory (fsspec's in-memory store)
        pq.write_table(table.slice(0, 4), f)
    remote = RLHFDataset(["memory://bucket/data"], tokenizer, config)
    assert len(remote) == 4 and remote.rows.files == ["memory:///bucket/data/a.parquet"]  # fsspec's spelling
    with pytest.raises(DatasetError, match=rf"data file not found: {tmp_path / 'nope'}; check data.train_files"):
        RLHFDataset([str(tmp_path / "nope")], tokenizer, config)
    with pytest.raises(DatasetError, match=r"data file pattern .*part-9\*.parquet matches no file"):
        RLHFDataset([str(shards / "part-9*.parquet")], tokenizer, config)
    with pytest.raises(DatasetError, match=r"data directory .*empty holds no \*.parquet file"):
        (tmp_path / "empty").mkdir()
        RLHFDataset([str(tmp_path / "empty")], tokenizer, config)


def test_values_out_of_range_are_named_at_load_time(capsys):
    message = cli_error(capsys, "config", "show", "actor.optim.lr=-1e-5", "algorithm.gamma=1.5", "rollout.top_p=0")
    assert message == (
        "invalid configuration:\n"
        "  - actor.optim.lr=-1e-05 must be > 0\n"
        "  - rollout.top_p=0.0 must be in (0, 1] (1 disables nucleus sampling)\n"
        "  - algorithm.gamma=1.5 must be in [0, 1]\n"
    )
    inside = ["algorithm.gamma=1", "algorithm.lam=0", "rollout.top_p=1", "actor.clip_ratio_c=3", "reward.clip=null"]
    assert load_config(overrides=inside).algorithm.gamma == 1.0
    for bad, bound in [
        ("actor.clip_ratio_low=1.0", "must be in [0, 1)"),  # 1 - clip_ratio_low would be 0
        ("actor.clip_ratio_c=1", "must be > 1"),
        ("critic.optim.betas=[0.9,1.0]", "must be in [0, 1)"),
        ("rollout.temperature=.nan", "must be > 0"),
        ("trainer.worker_timeout=0", "must be > 0"),
        ("actor.megatron.tensor_model_parallel_size=0", "must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(f"{bad.split('=')[0]}=") + r".* " + re.escape(bound)):
            load_config(overrides=[bad])


def numeric_keys(section, prefix: str = "") -> list[str]:
    """Every int/float key of the schema (lists of numbers and optional numbers included), dotted."""
    keys = []
    for f in dataclasses.fields(section):
        value, kinds = getattr(section, f.name), re.findall(r"\b(int|float)\b", str(f.type))
        if dataclasses.is_dataclass(value):
            keys += numeric_keys(value, f"{prefix}{f.name}.")
        elif kinds and "dict" not in str(f.type):
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_numeric_key_has_a_range():
    config = KetchConfig()
    missing = []
    for key in numeric_keys(config):
        *sections, name = key.split(".")
        section = functools.reduce(getattr, sections, config)
        if name not in RANGES.get(type(section), {}):
            missing.append(key)
    assert missing == [], "give these keys a line in ketch/config/constraints.py RANGES"
    assert len(numeric_keys(config)) > 60  # the walk finds the schema's keys (a sanity check of the helper)


def test_a_key_given_twice_is_reported(capsys, tmp_path, caplog):
    (tmp_path / "run.yaml").write_text("trainer:\n  total_steps: 3\n")
    with caplog.at_level(logging.INFO, logger="ketch"):
        config = load_config(tmp_path / "run.yaml", ["trainer.total_steps=7"])
    assert config.trainer.total_steps == 7
    assert f"trainer.total_steps=7 from the command line replaces 3 from {tmp_path / 'run.yaml'}" in caplog.text
    twice = "trainer.total_steps is given twice on the command line (3, then 4); give it once\n"
    assert cli_error(capsys, "config", "show", "trainer.total_steps=3", "--trainer.total_steps", "4") == twice
    assert cli_error(capsys, "config", "show", "trainer={total_steps: 3}", "trainer.total_steps=4") == twice
    (tmp_path / "run.yaml").write_text(
        "trainer:\n  total_steps: 3\n  seed: 2\ndata:\n  shuffle: false\ntrainer:\n  seed: 5\n"
    )
    message = cli_error(capsys, "config", "show", "--config-path", str(tmp_path / "run.yaml"))
    assert message == f"config file {tmp_path / 'run.yaml'} gives trainer twice (lines 1 and 6); give each key once\n"
    (tmp_path / "run.yaml").write_text("trainer:\n  total_steps: 3\n  total_steps: 4\n")
    message = cli_error(capsys, "config", "show", "--config-path", str(tmp_path / "run.yaml"))
    assert message.endswith("gives trainer.total_steps twice (lines 2 and 3); give each key once\n")


def test_a_reward_function_that_raises_shows_its_traceback_and_the_sample(capsys, tmp_path, tiny_config, task_files):
    scorer = tmp_path / "my_reward.py"
    scorer.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    rules = {}\n"
        "    return rules[ground_truth]\n"
    )
    config_file = tmp_path / "run.yaml"
    config_file.write_text(to_yaml(tiny_config(f"reward.function={scorer}:score")))
    message = cli_error(capsys, "train", "--config-path", str(config_file))
    head, sample, scorer_traceback = re.split(r"\nthe sample:\n|\nthe scorer's traceback:\n", message)
    assert re.fullmatch(
        rf"reward scorer reward.function={scorer}:score failed on sample 0 "
        r"\(data_source='ketch/arithmetic'\): KeyError: '\d+'",
        head,
    )
    fields = dict(re.findall(r"  ([a-z_ ]+): (.*)", sample))
    assert list(fields) == ["data file", "data_source", "prompt", "response", "ground truth"]
    file, row = re.fullmatch(r"(.*), row (\d+)", fields["data file"]).groups()
    assert file == str(task_files["train"])
    stored = pq.read_table(file).slice(int(row), 1).to_pylist()[0]  # the row the message names holds the sample
    assert fields["prompt"] == repr(stored["prompt"]) and fields["ground truth"] == repr(stored["answer"])
    assert head.endswith(f"KeyError: {stored['answer']!r}")
    assert scorer_traceback.startswith(
        f'Traceback (most recent call last):\n  File "{scorer}", line 3, in score\n    return rules[ground_truth]\n'
    )
    assert scorer_traceback.endswith("set reward.on_error=zero to score such samples 0\n")
