"""The built-in model: a tiny Qwen2 warmed up by a short SFT on the built-in task, cached per settings.

A random model cannot do arithmetic, so `ketch train` with no arguments first fine-tunes the tiny model
to a partly-correct state (once per machine; the result is cached under the user cache directory, keyed
by the task, model and warm-up settings) and starts PPO from there, leaving RL room to improve it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

from ketch.cache import cache_dir
from ketch.config import KetchConfig, load_config
from ketch.config.schema import BUILTIN_MODEL, BUILTIN_TASK
from ketch.data import build_char_tokenizer
from ketch.data.builtin.arithmetic import DATA_SOURCE, ArithmeticTask
from ketch.models import local_or_hub, save_tiny_model, tiny_qwen2_config
from ketch.trainer.sft import SFTTrainer

logger = logging.getLogger("ketch")

_FORMAT_VERSION = 2
"""Bump when the cached model changes for the same settings (2: its tokenizer keeps spaces), to rebuild it."""

WARMUP_OVERRIDES = (
    f"data.train_files=[{BUILTIN_TASK}/train]",
    f"data.val_files=[{BUILTIN_TASK}/val]",
    "data.train_batch_size=64",
    "actor.optim.lr=0.002",
    "actor.optim.warmup_steps=20",
    "trainer.total_steps=1500",
    "trainer.test_freq=50",
    "trainer.log_interval=50",
    "trainer.seed=0",
)
"""The warm-up SFT run: it validates every 50 steps and stops once greedy accuracy reaches WARMUP_TARGET."""

WARMUP_TARGET = 0.2
"""Validation accuracy at which the warm-up stops: partly correct, so that PPO has room to improve it."""


def resolve_model_path(config: KetchConfig) -> str:
    """`model.path`, or for the built-in model the cached warmed-up directory (built on first use)."""
    if config.model.path != BUILTIN_MODEL:
        return local_or_hub(config.model.path)
    target = cache_dir() / "models" / f"tiny-arithmetic-{_settings_hash()}"
    if not (target / "config.json").is_file():
        _warm_up(target, config.trainer.device)
    return str(target)


def _settings_hash() -> str:
    tokenizer = build_char_tokenizer()
    model = tiny_qwen2_config(tokenizer)
    settings = {
        "task": ArithmeticTask().settings_hash(),
        "model": model.to_dict(),
        "warmup": [WARMUP_OVERRIDES, WARMUP_TARGET],
        "format": _FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _warm_up(target: Path, device: str) -> None:
    logger.info("warming up the built-in tiny model with a short SFT (once; cached in %s)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".warmup-") as tmp:
        init = Path(tmp) / "init"
        save_tiny_model(init, build_char_tokenizer(), seed=0)
        overrides = [*WARMUP_OVERRIDES, f"model.path={init}", f"trainer.default_local_dir={tmp}"]
        overrides += ["trainer.experiment_name=warmup", f"trainer.device={device}", "trainer.logger=[jsonl]"]
        accuracy = f"val/{DATA_SOURCE}/acc"
        SFTTrainer(load_config(overrides=overrides)).fit(stop_when=lambda m: m.get(accuracy, 0.0) >= WARMUP_TARGET)
        if not (target / "config.json").is_file():
            shutil.rmtree(target, ignore_errors=True)
            (Path(tmp) / "warmup" / "model").rename(target)
