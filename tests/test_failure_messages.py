"""The smaller failures of issue 55, each said as it is: sizes in a unit that suits them, `ketch export` on a full
disk with the fix, `ketch doctor` counting the shards of a data directory, and a second `ketch sft` (or a PPO run
that starts again at step 1) in one run directory saying that it replaces the first one's steps."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from commands import run_cli

from ketch.disk import size_text
from ketch.doctor import run_checks
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.sft import SFTTrainer


def test_sizes_are_said_in_a_unit_that_suits_them():
    assert size_text(512) == "512 bytes"
    assert size_text(4 * 1024**2) == "4194304 bytes (4.0 MiB)"
    assert size_text(348_416) == "348416 bytes (340.2 KiB)"
    assert size_text(3 * 1024**3 // 2) == "1610612736 bytes (1.5 GiB)"


def test_ketch_export_on_a_full_disk_says_what_to_do(tiny_config, tmp_path):
    """The export may write no file over 100 kB (RLIMIT_FSIZE, as a full disk); the tiny model's weights are more."""
    config = tiny_config("trainer.total_steps=1")
    trainer = PPOTrainer(config)
    trainer.fit()
    checkpoint = trainer.run_dir / "checkpoints" / "global_step_1"
    result = run_cli("export", str(checkpoint), str(tmp_path / "exported"), file_size_limit=100_000)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.split("ketch export: error: ", 1)[1]
    assert message.startswith(f"could not write the model to {(tmp_path / 'exported').resolve()} (")
    assert message.endswith(
        f"The checkpoint {checkpoint} is unchanged: free space, or give `ketch export` an out_dir on a larger "
        "disk, then run it again\n"
    )
    assert not (tmp_path / "exported").exists()


def test_doctor_counts_the_shards_of_a_data_directory(tmp_path, task_files):
    table = pq.read_table(task_files["train"])
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        pq.write_table(table.slice(i * 80, 80), shards / f"part-{i}.parquet")
    rows = {r.name: r for r in run_checks(None, [f"data.train_files=[{shards}]"])}
    assert rows["data.train_files"].detail == "240 prompts in 3 file(s); data_source: ketch/arithmetic"


def test_a_second_sft_run_that_does_not_resume_says_that_it_replaces_the_first_ones_steps(tiny_config, caplog):
    config = tiny_config("trainer.total_steps=2")
    SFTTrainer(config, model_path=config.model.path).fit()
    run_dir = Path(config.trainer.default_local_dir) / config.trainer.experiment_name
    again = tiny_config("trainer.total_steps=2", "trainer.resume_mode=disable")
    with caplog.at_level(logging.WARNING, logger="ketch"):
        SFTTrainer(again, model_path=config.model.path).fit()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"{run_dir / 'metrics.jsonl'} holds steps up to 2 of an earlier run; trainer.resume_mode=disable, so this run "
        "starts again at step 1 and replaces them (set another trainer.experiment_name to keep both)"
    ]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "event" not in r] == [1, 2]
    shutil.rmtree(run_dir)


def test_a_ppo_run_that_starts_again_over_an_earlier_runs_steps_says_so(tiny_config, caplog):
    """The earlier run's `metrics.jsonl`: three steps and an event, the last line cut short by a kill."""
    again = PPOTrainer(tiny_config("trainer.total_steps=1", "trainer.resume_mode=disable"))
    again.run_dir.mkdir(parents=True)
    earlier = [{"step": 1, "actor/pg_loss": 0.1}, {"step": 2}, {"event": "checkpoint", "step": 2}, {"step": 3}]
    (again.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"step": 4, "a')
    with caplog.at_level(logging.WARNING, logger="ketch"):
        again.fit()
    metrics = again.run_dir / "metrics.jsonl"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"{metrics}: the last line is incomplete (the run stopped while writing it); skipped",
        f"{metrics} holds steps up to 3 of an earlier run; trainer.resume_mode=disable, so this run starts again at "
        "step 1 and replaces them (set another trainer.experiment_name to keep both)",
    ]
    records = [json.loads(line) for line in metrics.open()]  # the cut line is gone, not glued to the next record
    assert [r["step"] for r in records if "event" not in r] == [1]
