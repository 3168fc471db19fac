"""Shared fixtures: a private cache, a tiny random model and a small arithmetic task, all built locally."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from ketch.config import load_config
from ketch.data import build_char_tokenizer
from ketch.data.builtin.arithmetic import ArithmeticTask, write_arithmetic_task
from ketch.models import load_reward_model, quiet_transformers, save_tiny_model

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
