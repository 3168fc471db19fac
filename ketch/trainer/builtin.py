"""The built-in models: a tiny Qwen2 warmed up by a short SFT on a built-in task, cached per settings
(`builtin:tiny-arithmetic` on arithmetic; `builtin:tiny-calculator-calls` from it on demonstrations of the
`calculate` tool, and `builtin:tiny-calculator` from that on a mix of those and direct answers); and a tiny
Qwen2-VL warmed up on the built-in visual task (`builtin:tiny-dots`).

A random model cannot do arithmetic, so `ketch train` with no arguments first fine-tunes the tiny model
to a partly-correct state (once per machine; the result is cached under the user cache directory, keyed
by the task, model and warm-up settings) and starts PPO from there, leaving RL room to improve it. A warm-up
works in a directory of its own next to the cached models, removed when it ends, also when it is interrupted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ketch.cache import cache_dir
from ketch.config import KetchConfig, load_config
from ketch.config.schema import (
    BUILTIN_CALCULATOR_MODEL,
    BUILTIN_CALLER_MODEL,
    BUILTIN_DOTS_MODEL,
    BUILTIN_MODEL,
    BUILTIN_TASK,
)
from ketch.data import build_char_tokenizer
from ketch.data.builtin.arithmetic import DATA_SOURCE, ArithmeticTask
from ketch.data.builtin.calculator import BUILTIN_CALCULATOR_TASK, CalculatorTask
from ketch.data.builtin.calculator import DATA_SOURCE as CALCULATOR_DATA_SOURCE
from ketch.data.builtin.dots import BUILTIN_DOTS_TASK, DotsTask
from ketch.data.builtin.dots import DATA_SOURCE as DOTS_DATA_SOURCE
from ketch.models import local_or_hub, save_tiny_model, tiny_qwen2_config
from ketch.models.gguf import cached_gguf_model, is_gguf
from ketch.models.tiny_vlm import QWEN_VISION_TOKENS, save_tiny_vlm, tiny_qwen2_vl_config
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
    "trainer.test_freq=10",
    "trainer.log_interval=10",
    "trainer.seed=0",
)
"""The warm-up SFT run: it validates every 10 steps and ends at WARMUP_TARGET (it climbs from 0.1 to 0.5 in about
200 steps, so more steps between validations overshoot the target)."""

WARMUP_TARGET = 0.2
"""The most validation accuracy the warm-up ends with: partly correct, so that RL has room to improve it. The
warm-up stops at the first validation above it, and its result is the model of the validation before."""


def _calculator_sft(split: str, *schedule: str) -> tuple[str, ...]:
    """The overrides of a calculator warm-up that trains on `builtin:calculator/{split}` with `schedule` (learning
    rate, steps, validation and log intervals), validated on the `val` split with the tool in the loop."""
    data = (f"data.train_files=[{BUILTIN_CALCULATOR_TASK}/{split}]", f"data.val_files=[{BUILTIN_CALCULATOR_TASK}/val]")
    data += ("data.max_prompt_length=32", "data.max_response_length=128", "data.train_batch_size=32")
    tools = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculate]")
    return (*data, *schedule, "trainer.seed=0", *tools)


CALLER_WARMUP_OVERRIDES = _calculator_sft(
    "train",
    "actor.optim.lr=0.003",
    "actor.optim.warmup_steps=30",
    "actor.optim.lr_scheduler=cosine",
    "actor.optim.min_lr_ratio=0.2",
    "trainer.total_steps=1400",
    "trainer.test_freq=100",
    "trainer.log_interval=100",
)
"""The first calculator warm-up (`builtin:tiny-calculator-calls`): SFT of `builtin:tiny-arithmetic` on
demonstrations of the call format, validated with the tool in the loop, for a fixed 1400 steps. The call format
is learned in ~100 steps; copying the operands into the call and the tool's result into the answer comes slowly,
and then greedy accuracy climbs steeply at a step that moves with floating-point rounding (325-400 with one CPU
thread, 475-600 on an H200, 800-950 with two CPU threads; 1100-1200 with one thread from another build of the
arithmetic model). It does not stop on accuracy but runs a fixed schedule past that climb, so that the model copies
whatever the rounding (0.0 at step 1000, 0.27 at 1200, 0.625 at 1400 in the last case); how well it copies still
varies (benchmarks/results/2026-12-03_cpu_tool_calculator_mix.json)."""

CALCULATOR_WARMUP_OVERRIDES = _calculator_sft(
    "mixed", "actor.optim.lr=0.0006", "trainer.total_steps=200", "trainer.test_freq=50", "trainer.log_interval=50"
)
"""The second calculator warm-up (`builtin:tiny-calculator`): SFT of `builtin:tiny-calculator-calls` for a fixed
200 steps at its final learning rate on `builtin:calculator/mixed`, where 30% of the rows call the tool and the
rest answer directly. The model keeps copying but now answers directly when greedy (almost always wrong: it
cannot multiply in its head), and calls in about a quarter of the samples at temperature 0.7. What GRPO then
learns is a decision, to call, rewarded whenever the call's result is copied right; earlier warm-ups that ended
part-way up the steep copying curve left GRPO a gain that moved with where rounding put that curve (+32 points
in 100 steps from one start, at most +5 from others: benchmarks/results/2026-12-03_cpu_tool_calculator_starts.json)."""


DOTS_WARMUP_OVERRIDES = (
    f"data.train_files=[{BUILTIN_DOTS_TASK}/train]",
    f"data.val_files=[{BUILTIN_DOTS_TASK}/val]",
    "data.max_prompt_length=32",
    "data.max_response_length=3",
    "data.train_batch_size=32",
    "model.freeze_vision_tower=false",
    "actor.optim.lr=0.0005",
    "actor.optim.warmup_steps=20",
    "trainer.total_steps=1500",
    "trainer.test_freq=10",
    "trainer.log_interval=10",
    "trainer.seed=0",
)
"""The warm-up SFT of the tiny vision-language model (`builtin:tiny-dots`), its vision tower trained too (it starts
random). It validates every 10 steps and ends at DOTS_WARMUP_TARGET."""

DOTS_WARMUP_TARGET = 0.4
"""The most greedy validation accuracy the dots warm-up ends with."""


@dataclass(frozen=True)
class TinyModel:
    """The random model a warm-up starts from: `settings()` describes it (hashed into the cached model's name),
    `save(path)` writes it with its tokenizer (and a vision-language model's image processor)."""

    settings: Callable[[], dict[str, Any]]
    save: Callable[[Path], Any]


TINY_QWEN2 = TinyModel(
    lambda: tiny_qwen2_config(build_char_tokenizer()).to_dict(),
    lambda path: save_tiny_model(path, build_char_tokenizer(), seed=0),
)
"""The built-in tiny Qwen2 (`ketch.models.tiny`) with the character tokenizer."""

TINY_QWEN2_VL = TinyModel(
    lambda: {
        **tiny_qwen2_vl_config(build_char_tokenizer(QWEN_VISION_TOKENS)).to_dict(),
        "image_size": DotsTask().size,
    },
    lambda path: save_tiny_vlm(path, build_char_tokenizer(QWEN_VISION_TOKENS), DotsTask().size, seed=0),
)
"""The tiny Qwen2-VL (`ketch.models.tiny_vlm`) with the character tokenizer and Qwen's vision tokens, taking the
built-in visual task's images as they are."""


@dataclass(frozen=True)
class Warmup:
    """How a built-in model is made: a short SFT of the tiny model (or of the built-in model `start`). Without a
    `target` it runs all its steps and the result is the last step's model. With one, the result stays under
    `target` of `metric` (an accuracy): the SFT stops at the first validation above it and the result is the model
    of the last validation at or under it. On the steep part of the SFT curve greedy accuracy jumps by
    several points between validations and falls back by a few: the last model under the bound is the most
    trained one, and RL learned faster from it than from an earlier model whose accuracy was closer to the bound
    (benchmarks/results/2026-12-01_cpu_default_run_0.6.json)."""

    task_hash: str
    overrides: tuple[str, ...]
    metric: str
    target: float | None = None
    start: str | None = None
    init: TinyModel = TINY_QWEN2
    """The random model of a warm-up without `start`."""

    def reached(self, metrics: dict[str, float]) -> bool:
        """Whether the validation `metrics` of a step are above the bound (the warm-up's `stop_when`)."""
        return metrics.get(self.metric, 0.0) > self.target

    def kept(self, metrics: dict[str, float]) -> bool:
        """Whether the model of a validation is the result so far (the warm-up's `keep_when`): every one up to
        the target is, so the result is the last one before the stop."""
        return metrics.get(self.metric, math.inf) <= self.target


WARMUPS = {
    BUILTIN_MODEL: Warmup(ArithmeticTask().settings_hash(), WARMUP_OVERRIDES, f"val/{DATA_SOURCE}/acc", WARMUP_TARGET),
    BUILTIN_CALLER_MODEL: Warmup(
        CalculatorTask().settings_hash(),
        CALLER_WARMUP_OVERRIDES,
        f"val/{CALCULATOR_DATA_SOURCE}/acc",
        start=BUILTIN_MODEL,
    ),
    BUILTIN_CALCULATOR_MODEL: Warmup(
        CalculatorTask().settings_hash(),
        CALCULATOR_WARMUP_OVERRIDES,
        f"val/{CALCULATOR_DATA_SOURCE}/acc",
        start=BUILTIN_CALLER_MODEL,
    ),
    BUILTIN_DOTS_MODEL: Warmup(
        DotsTask().settings_hash(),
        DOTS_WARMUP_OVERRIDES,
        f"val/{DOTS_DATA_SOURCE}/acc",
        DOTS_WARMUP_TARGET,
        init=TINY_QWEN2_VL,
    ),
}
"""The built-in models by `model.path`."""


def resolve_model_path(config: KetchConfig) -> str:
    """`model.path`, or for a built-in model the cached warmed-up directory (built on first use), or for a
    `.gguf` file its cached conversion to a Hugging Face directory (converted on first use)."""
    name = config.model.path
    if is_gguf(name):
        return str(cached_gguf_model(name))
    if name not in WARMUPS:
        return local_or_hub(name)
    return str(_built_model(name, config.trainer.device))


def _built_model(name: str, device: str) -> Path:
    """The cached directory of the built-in model `name`, warmed up first if missing."""
    target = cached_builtin_model(name)
    if target is None:
        target = _cache_target(name)
        _warm_up(target, WARMUPS[name], device)
    return target


def cached_builtin_model(name: str) -> Path | None:
    """The cached directory of the built-in model `name` (a key of `WARMUPS`) where a run has built it, else None."""
    target = _cache_target(name)
    return target if (target / "config.json").is_file() else None


def _cache_target(name: str) -> Path:
    return cache_dir() / "models" / f"{name.removeprefix('builtin:')}-{_settings_hash(WARMUPS[name])}"


def _settings_hash(warmup: Warmup) -> str:
    settings = {
        "task": warmup.task_hash,
        "model": warmup.init.settings(),
        "warmup": [warmup.overrides, warmup.target],
        "format": _FORMAT_VERSION,
    }
    if warmup.start:
        settings["start"] = _settings_hash(WARMUPS[warmup.start])
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


def warmup_config(warmup: Warmup, start: Path | str, runs: Path | str, device: str, *overrides: str) -> KetchConfig:
    """The SFT config of `warmup` from the model at `start`, writing its run `warmup` under `runs` on `device`
    (metrics to JSONL only; no validation before the first step, whose untrained model `Warmup.kept` would keep),
    with `overrides` on top (a benchmark's variations of a warm-up)."""
    run = [f"model.path={start}", f"trainer.default_local_dir={runs}", "trainer.experiment_name=warmup"]
    run += [f"trainer.device={device}", "trainer.logger=[jsonl]", "trainer.val_before_train=false"]
    return load_config(overrides=[*warmup.overrides, *run, *overrides])


def _warm_up(target: Path, warmup: Warmup, device: str) -> None:
    logger.info("warming up the built-in tiny model with a short SFT (once; cached in %s)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _warmup_dir(target.parent) as tmp:
        init = tmp / "init"
        if warmup.start:
            shutil.copytree(_built_model(warmup.start, device), init)
        else:
            warmup.init.save(init)
        sft = SFTTrainer(warmup_config(warmup, init, tmp, device))
        if warmup.target is None:
            sft.fit()
        else:
            sft.fit(stop_when=warmup.reached, keep_when=warmup.kept)
        if not (tmp / "warmup" / "model" / "config.json").is_file():
            raise RuntimeError(
                f"the warm-up of {target.name} kept no model: none of its validations had {warmup.metric} at or "
                f"under {warmup.target} (its log lines show them); validate more often or train longer "
                "(trainer.test_freq, trainer.total_steps of the warm-up)"
            )
        if not (target / "config.json").is_file():
            keep_warmup(tmp / "warmup", target)


WARMUP_LOG = "warmup_metrics.jsonl"
"""The metrics of the SFT that made a built-in model (its losses and validations), kept in the model's directory."""


def keep_warmup(run: Path, target: Path) -> None:
    """Move the model of the warm-up run directory `run` to `target` (replacing what a crashed warm-up left there),
    with the run's `metrics.jsonl` as `WARMUP_LOG` beside it."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copyfile(run / "metrics.jsonl", run / "model" / WARMUP_LOG)
    (run / "model").rename(target)


_WARMUP_DIR = re.compile(r"^\.warmup-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")
"""A warm-up's directory: `.warmup-<host>-<pid>-<8 hex digits>`, named after the process that works in it."""


class _Terminated(BaseException):
    """SIGTERM arrived during a warm-up: raised in the main thread, so that the warm-up's directory is removed
    before the process ends as SIGTERM ends it."""


@contextmanager
def _warmup_dir(parent: Path) -> Iterator[Path]:
    """A fresh warm-up directory in `parent`, removed when the block ends: normally, on an error, on Ctrl-C, and on
    SIGTERM (`kill`, `timeout`, a scheduler's preemption), whose default would end the process at once. First the
    directories of warm-ups that died with their process (SIGKILL, a crash of the machine) are swept."""
    _remove_stale(parent)
    path = parent / f".warmup-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    previous = _raise_on_sigterm()
    try:
        yield path
    except _Terminated:
        shutil.rmtree(path, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)  # ends the process (the default), or runs the handler there was
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(path, ignore_errors=True)


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise `_Terminated`; returns the handler it replaces, or None when it cannot (outside the main
    thread, or a handler that was not set from Python and could not be put back) or should not (SIGTERM ignored)."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous in (None, signal.SIG_IGN):
        return None

    def raise_terminated(signum, frame) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, raise_terminated)
    return previous


def _remove_stale(parent: Path) -> None:
    """Remove the warm-up directories in `parent` whose process, on this machine, is gone; those of running warm-ups
    and of other machines (a shared cache directory) stay."""
    host = socket.gethostname()
    for path in parent.glob(".warmup-*"):
        match = _WARMUP_DIR.match(path.name)
        if match and match["host"] == host and not _is_running(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by a warm-up that was stopped", path)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
