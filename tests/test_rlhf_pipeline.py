"""The built-in RLHF pipeline of `examples/rlhf_pipeline/builtin/`, end to end: SFT on demonstrations of mixed
quality, a reward model on preference pairs, then PPO rewarded by the reward model alone (slow: about three
minutes on 2 CPU cores). The test validates only where it asserts, and trains the reward model half as long as
the example does."""

from __future__ import annotations

from pathlib import Path

import pytest

from ketch.config import load_config
from ketch.tracking import read_metrics
from ketch.trainer.builtin import resolve_model_path
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.rm import RMTrainer
from ketch.trainer.sft import SFTTrainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rlhf_pipeline" / "builtin"
ACC = "val/ketch/arithmetic/acc"


def step_config(step: str, command: str, runs: Path, *overrides: str):
    common = (f"trainer.default_local_dir={runs}", "trainer.logger=[jsonl]", "trainer.device=cpu")
    return load_config(EXAMPLE / f"{step}.yaml", [*common, *overrides], command=command)


@pytest.mark.slow
def test_ppo_with_a_reward_model_alone_raises_the_rule_based_accuracy(tmp_path):
    sft_config = step_config("sft", "sft", tmp_path, "trainer.test_freq=0")
    SFTTrainer(sft_config, resolve_model_path(sft_config)).fit()
    sft_model = tmp_path / "rlhf-sft" / "model"
    rm_steps = ("trainer.total_steps=500", "trainer.test_freq=500")
    rm_metrics = RMTrainer(step_config("rm", "rm", tmp_path, f"model.path={sft_model}", *rm_steps)).fit()
    # Measured: 0.912 after 500 steps (0.894 at 250, 0.934 at 1000): format and far misses are learned, near
    # misses stay hard for a tiny model.
    assert rm_metrics["val/pairwise_acc"] > 0.9

    rm_model = tmp_path / "rlhf-rm" / "model"
    ppo_overrides = (f"model.path={sft_model}", f"reward.model.path={rm_model}", "trainer.test_freq=60")
    ppo = PPOTrainer(step_config("ppo", "train", tmp_path, *ppo_overrides))
    ppo.fit()
    records = read_metrics(ppo.run_dir / "metrics.jsonl")
    assert all("reward/rule/mean" not in r for r in records) and "reward/model/mean" in records[1]
    first, last = records[0][ACC], records[-1][ACC]
    # Validation samples 4 answers per problem (the example's `rollout.val`). Measured: 0.259 -> 0.396 in 60 steps
    # (seed 2: 0.278 -> 0.392), the format learned from the reward model; greedy accuracy stayed 0.551 -> 0.555.
    assert last >= first + 0.06, f"sampled validation accuracy went from {first:.3f} to {last:.3f}"
