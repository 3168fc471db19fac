"""The built-in RLHF pipeline of `examples/rlhf_pipeline/builtin/`, end to end: SFT on demonstrations of mixed
quality, a reward model on preference pairs, then PPO rewarded by the reward model alone (slow: about two minutes
on 2 CPU cores once the built-in model is cached). The test validates only where it asserts, trains the reward
model 100 steps instead of the example's 1000, and runs PPO 30 steps instead of 60 at twice the example's learning
rate."""

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
    rm_steps = ("trainer.total_steps=100", "trainer.test_freq=100")
    rm_metrics = RMTrainer(step_config("rm", "rm", tmp_path, f"model.path={sft_model}", *rm_steps)).fit()
    # Measured after 100 steps: 0.896 (0.900 at step 100 of a 150-step run that ended at 0.902; seed 2: 0.879 at
    # 150); 0.957 after 500. The untrained score head scores 0.479 (seed 2: 0.459), and one that learned the badly
    # formatted replies alone (60% of the rejected ones) would score about 0.8: the bound needs far misses learned
    # too. Near misses stay hard for a tiny model.
    assert rm_metrics["val/pairwise_acc"] > 0.85

    rm_model = tmp_path / "rlhf-rm" / "model"
    ppo_overrides = (f"model.path={sft_model}", f"reward.model.path={rm_model}", "trainer.test_freq=30")
    ppo_overrides += ("trainer.total_steps=30", "actor.optim.lr=6e-5")
    ppo = PPOTrainer(step_config("ppo", "train", tmp_path, *ppo_overrides))
    ppo.fit()
    records = read_metrics(ppo.run_dir / "metrics.jsonl")
    assert all("reward/rule/mean" not in r for r in records) and "reward/model/mean" in records[1]
    first, last = records[0][ACC], records[-1][ACC]
    # Validation samples 4 answers per problem (the example's `rollout.val`). Measured: 0.203 -> 0.319 in 30 steps
    # from the 100-step reward model (from a 150-step one: 0.190 -> 0.283, seed 2: 0.131 -> 0.270; 40 steps 0.335),
    # the format learned from the reward model; the example's 60 steps at its learning rate gave 0.190 -> 0.349.
    assert last >= first + 0.06, f"sampled validation accuracy went from {first:.3f} to {last:.3f}"
