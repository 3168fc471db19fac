"""The built-in model resolves through `ketch.trainer.builtin`; `SFTTrainer` takes the resolved path."""

from __future__ import annotations

import gc

import pytest
import torch

from ketch.config import load_config
from ketch.config.schema import BUILTIN_CALCULATOR_MODEL, BUILTIN_CALLER_MODEL, BUILTIN_MODEL
from ketch.data.builtin.calculator import CalculatorTask, demonstration, generate_calculator_task
from ketch.tracking import read_metrics
from ketch.trainer.builtin import WARMUP_LOG, WARMUPS, keep_warmup, resolve_model_path
from ketch.trainer.groups import WorkerGroups
from ketch.trainer.sft import SFTTrainer

ACC = "val/ketch/arithmetic/acc"


def test_sft_on_the_unresolved_builtin_model_says_how_to_resolve_it():
    with pytest.raises(ValueError, match=r"model.path=builtin:tiny-arithmetic must be resolved first"):
        SFTTrainer(load_config(command="sft"))


def test_a_local_model_path_resolves_to_its_absolute_path(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tiny_model_dir.parent)
    config = load_config(overrides=[f"model.path={tiny_model_dir.name}"])
    assert resolve_model_path(config) == str(tiny_model_dir.resolve())


def test_the_arithmetic_warm_up_stops_above_its_target_and_keeps_the_model_of_the_validation_before():
    warmup = WARMUPS[BUILTIN_MODEL]
    assert warmup.target == 0.2
    # The one-thread warm-up's validations at SFT steps 470-520 (measured): accuracy falls back between rises; the
    # model of step 510 (0.156) is the result.
    accuracies = [0.129, 0.184, 0.191, 0.152, 0.156, 0.234]
    assert [warmup.kept({ACC: acc}) for acc in accuracies] == [True, True, True, True, True, False]
    assert [warmup.reached({ACC: acc}) for acc in accuracies] == [False, False, False, False, False, True]
    assert warmup.kept({ACC: 0.2}) and not warmup.reached({ACC: 0.2})  # the target itself is under the bound


def test_a_warm_up_keeps_its_metrics_beside_the_model_it_made(tmp_path):
    """The warm-up's model replaces what a crashed warm-up left at the target, and its metrics (how the built-in
    model was made: each validation's accuracy) stay beside it."""
    run, target = tmp_path / "warmup", tmp_path / "models" / "tiny-arithmetic-0123"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 510, "val/ketch/arithmetic/acc": 0.156}\n')
    target.mkdir(parents=True)
    (target / "model.safetensors.tmp").write_text("")
    keep_warmup(run, target)
    assert sorted(path.name for path in target.iterdir()) == ["config.json", WARMUP_LOG]
    assert read_metrics(target / WARMUP_LOG) == [{"step": 510, "val/ketch/arithmetic/acc": 0.156}]
    assert not (run / "model").exists()


def test_the_calculator_model_is_two_fixed_length_warm_ups_calls_then_the_mix():
    calls, mixed = WARMUPS[BUILTIN_CALLER_MODEL], WARMUPS[BUILTIN_CALCULATOR_MODEL]
    assert (calls.start, calls.target, mixed.start, mixed.target) == (BUILTIN_MODEL, None, BUILTIN_CALLER_MODEL, None)
    assert "data.train_files=[builtin:calculator/train]" in calls.overrides
    assert "data.train_files=[builtin:calculator/mixed]" in mixed.overrides
    assert ("trainer.total_steps=1400" in calls.overrides, "trainer.total_steps=200" in mixed.overrides) == (True, True)


def test_the_mixed_calculator_split_has_the_training_problems_a_share_of_them_with_the_call():
    task = CalculatorTask(num_train=400, num_val=8)
    splits = generate_calculator_task(task)
    assert [r["prompt"] for r in splits["mixed"]] == [r["prompt"] for r in splits["train"]]
    calls = [r for r in splits["mixed"] if len(r["response"]) == 3]
    assert len(calls) == 117  # of 400 at call_share 0.3
    assert all(r["response"] == demonstration(*map(int, r["prompt"][0]["content"][:-1].split("*"))) for r in calls)
    direct = next(r for r in splits["mixed"] if len(r["response"]) == 1)
    assert direct["response"] == [{"role": "assistant", "content": f"#### {direct['answer']}"}]


def test_sft_keep_when_makes_the_last_kept_step_the_result(tiny_config):
    from safetensors.torch import load_file

    def weights(config, keep_when=None):
        sft = SFTTrainer(config, model_path=config.model.path)
        sft.fit(keep_when=keep_when)
        return load_file(sft.run_dir / "model" / "model.safetensors")

    sft = ("trainer.test_freq=1", "trainer.log_interval=1", "actor.optim.lr=1e-2")
    one_step = weights(tiny_config(*sft, "trainer.total_steps=1", "trainer.experiment_name=one"))
    kept = iter([True, False, False])
    three_steps = tiny_config(*sft, "trainer.total_steps=3", "trainer.experiment_name=three")
    first_kept = weights(three_steps, keep_when=lambda metrics: next(kept))
    assert first_kept.keys() == one_step.keys()
    assert all(torch.equal(first_kept[name], one_step[name]) for name in one_step)
    last = weights(tiny_config(*sft, "trainer.total_steps=3", "trainer.experiment_name=last"))
    assert not all(torch.equal(last[name], one_step[name]) for name in one_step)


def test_sft_validates_with_the_actors_own_rollout_when_the_config_has_a_standalone_one(tiny_config):
    config = tiny_config("rollout.placement=standalone", "trainer.total_steps=1", "trainer.test_freq=1")
    sft = SFTTrainer(config, model_path=config.model.path)
    metrics = sft.fit()
    assert sft.config.rollout.placement == "hybrid" and not sft.config.uses_ray(gpu_visible=False)
    assert 0.0 <= metrics[ACC] <= 1.0 and metrics["val/loss"] > 0


def test_sft_freezes_what_its_first_step_built_once_and_thaws_it_at_the_end(tiny_config, monkeypatch):
    frozen = []
    freeze = WorkerGroups.freeze_long_lived
    monkeypatch.setattr(WorkerGroups, "freeze_long_lived", lambda g: (freeze(g), frozen.append(gc.get_freeze_count())))
    config = tiny_config("trainer.total_steps=3", "trainer.test_freq=0")
    SFTTrainer(config, model_path=config.model.path).fit()
    assert len(frozen) == 1 and frozen[0] > 10_000 and gc.get_freeze_count() == 0
