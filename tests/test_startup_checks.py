"""Start-up checks: what a run can check without a model fails before any model is built or warmed up (an empty cache
costs minutes of warm-up), each failure with one message; and a warm-up stopped half-way leaves nothing behind.
docs/errors.md lists the messages. Every test fails on the code before issue 40."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from commands import cli_error, ketch_env

from ketch.data import build_char_tokenizer


def test_a_missing_data_file_is_found_before_the_built_in_model_is_warmed_up(capsys, monkeypatch, tmp_path):
    """The default run on an empty cache would first warm up the built-in model (a minute or more)."""
    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path / "empty-cache"))
    missing = tmp_path / "missing.parquet"
    start = time.monotonic()
    runs = tmp_path / "runs"
    message = cli_error(capsys, "train", f"data.train_files=[{missing}]", f"trainer.default_local_dir={runs}")
    assert time.monotonic() - start < 10
    assert message == f"data file not found: {missing}; check data.train_files / data.val_files\n"
    assert not (tmp_path / "empty-cache" / "models").exists() and not runs.exists()


def test_an_unknown_data_source_is_named_at_the_start_with_its_file_and_row(capsys, tmp_path, task_files):
    """Row 3 of the training file names a data source that no scorer knows; the model path does not even exist,
    so the message proves the check runs before any model loads."""
    table = pq.read_table(task_files["train"])
    sources = table.column("data_source").to_pylist()
    sources[3] = "my/task"
    column = table.schema.get_field_index("data_source")
    pq.write_table(table.set_column(column, "data_source", pa.array(sources)), tmp_path / "train.parquet")
    message = cli_error(
        capsys,
        "train",
        f"model.path={tmp_path / 'no-model'}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
    )
    assert message == (
        f"data file {tmp_path / 'train.parquet'}, row 3: no reward scorer for data_source 'my/task'; known data "
        "sources: DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, gsm8k, ketch/arithmetic, "
        "ketch/calculator, ketch/dots, lighteval/MATH, math, openai/gsm8k. Score other data with your own function: "
        "reward.function=path/to/file.py:fn, fn(data_source, solution_str, ground_truth, extra_info) -> float\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_tokenizer_with_ids_beyond_the_models_embeddings_stops_the_start(
    capsys, tmp_path, tiny_model_dir, task_files
):
    """The character tokenizer (100 tokens, as many as the tiny model's embeddings) with 10 more special tokens:
    its ids go up to 109. Without the check, step 1 fails with `IndexError: index out of range in self`."""
    tokenizer_dir = tmp_path / "tokenizer"
    build_char_tokenizer(extra_specials=tuple(f"<x{i}>" for i in range(10))).save_pretrained(tokenizer_dir)
    message = cli_error(
        capsys,
        "train",
        f"model.path={tiny_model_dir}",
        f"model.tokenizer_path={tokenizer_dir}",
        f"data.train_files=[{task_files['train']}]",
        "data.train_batch_size=8",
        "trainer.device=cpu",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
    )
    assert message == (
        f"the tokenizer of {tokenizer_dir} (model.tokenizer_path) produces token ids up to 109, but the model "
        f"{tiny_model_dir} has 100 token embeddings (ids 0 to 99); resize the model's embeddings to 110 "
        "(model.resize_token_embeddings(110), then save the model) or use the model's own tokenizer (unset "
        "model.tokenizer_path)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_vllm_that_does_not_import_stops_the_start(capsys, monkeypatch, tmp_path):
    """A `vllm` package whose metadata says 0.32.0 (supported) but whose import fails, first on the path."""
    site = tmp_path / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(
        'raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")\n'
    )
    (site / "vllm-0.32.0.dist-info").mkdir()
    (site / "vllm-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    monkeypatch.syspath_prepend(str(site))
    message = cli_error(
        capsys,
        "train",
        "rollout.name=vllm",
        f"model.path={tmp_path / 'no-model'}",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
    )
    assert message == (
        "cannot start the run:\n  - vLLM 0.32.0 is installed, but `import vllm` fails with ImportError: "
        "libcudart.so.12: cannot open shared object file: No such file or directory: pip install --force-reinstall "
        "'vllm>=0.30,<0.33', or set rollout.name=hf\n"
    )


@pytest.mark.slow
def test_a_terminated_warm_up_leaves_nothing_and_a_warm_up_sweeps_what_killed_ones_left(tmp_path):
    """`ketch train` on a fresh cache warms up the built-in model; SIGTERM (`kill`, `timeout`) arrives during its
    SFT. Before that, the warm-up's start removes the directory of a warm-up of this machine whose process died (a
    SIGKILL leaves it), and keeps those of a running process and of another machine."""
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    host, gone = socket.gethostname(), subprocess.Popen(["true"])
    gone.wait()
    stale = models / f".warmup-{host}-{gone.pid}-0123abcd"
    (stale / "init").mkdir(parents=True)
    kept = [models / f".warmup-{host}-{os.getpid()}-89abcdef", models / f".warmup-elsewhere-{gone.pid}-00000000"]
    for path in kept:
        path.mkdir()
    with open(tmp_path / "stderr", "w") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "ketch", "train", f"trainer.default_local_dir={tmp_path / 'runs'}"],
            env=ketch_env(KETCH_CACHE_DIR=str(tmp_path / "cache")),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            deadline = time.monotonic() + 300
            while not list(models.glob(".warmup-*/warmup/metrics.jsonl")):  # its SFT is running
                assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
                time.sleep(0.1)
            assert not stale.exists()
            run.send_signal(signal.SIGTERM)
            assert run.wait(timeout=120) == -signal.SIGTERM
        finally:
            run.kill()  # when an assertion stopped the test before the process ended
            run.wait()
    assert sorted(models.iterdir()) == sorted(kept)
