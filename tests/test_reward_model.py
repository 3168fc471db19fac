"""The reward model: scores at the last valid token, re-encoding, Bradley–Terry steps, `ketch rm` end to end,
and reward-model scores in PPO (alone, combined with rules, normalised, in checkpoints)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from ketch.algorithms import bradley_terry_loss, pairwise_accuracy
from ketch.cli import main
from ketch.config import ConfigError, load_config
from ketch.controller import LocalWorkerGroup
from ketch.data import build_char_tokenizer, format_prompt
from ketch.data.batching import pad
from ketch.models import load_tokenizer
from ketch.protocol import DataProto
from ketch.rollout.base import assemble_sequences, response_mask_from_stops
from ketch.tracking import read_metrics
from ketch.trainer.groups import WorkerGroups
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.rm import RMTrainer
from ketch.workers import RewardModelWorker


def rm_config(tiny_config, preference_files, *overrides: str):
    files = [f"data.train_files=[{preference_files['train']}]", f"data.val_files=[{preference_files['val']}]"]
    return tiny_config(*files, "trainer.test_freq=3", "trainer.total_steps=3", *overrides)


def scorer(config, model_dir: Path, actor_tokenizer_dir: Path | None = None) -> LocalWorkerGroup:
    actor = str(actor_tokenizer_dir) if actor_tokenizer_dir else None
    group = LocalWorkerGroup(RewardModelWorker, config, str(model_dir), str(model_dir), None, actor)
    group.init_model()
    return group


def rollout_batch(tokenizer, prompts: list[str], replies: list[str], response_len: int = 8) -> DataProto:
    """Samples as the rollout returns them: prompts left-padded; replies + EOS right-padded (a reply of
    `response_len` characters or more is cut off with no EOS)."""
    prompt_ids = pad([torch.tensor(tokenizer.encode(p)) for p in prompts], tokenizer.pad_token_id, "left")
    ids = [([*tokenizer.encode(r), tokenizer.eos_token_id])[:response_len] for r in replies]
    responses = pad([torch.tensor(r) for r in ids], tokenizer.pad_token_id, "right")
    responses = torch.nn.functional.pad(responses, (0, response_len - responses.shape[1]))
    mask = response_mask_from_stops(responses, [tokenizer.eos_token_id])
    prompt_data = DataProto.from_dict({"input_ids": prompt_ids, "attention_mask": (prompt_ids != 0).long()})
    data = assemble_sequences(prompt_data, responses, mask)
    data.non_tensor_batch["raw_prompt"] = np.array(prompts, dtype=object)
    return data


def reference_scores(model_dir: Path, sequences: list[list[int]]) -> list[float]:
    """Each unpadded sequence scored alone by transformers' own sequence classifier."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]


def test_the_score_sits_at_the_last_valid_response_token(tiny_config, reward_model_dir):
    tokenizer = build_char_tokenizer()
    prompts, replies = ["1+2=", "13+24=", "7="], ["####3", "####37", "####7777777"]  # the last is cut off
    data = rollout_batch(tokenizer, prompts, replies)
    rm_scores = scorer(tiny_config(), reward_model_dir).compute_rm_score(data).batch["rm_scores"]
    assert data.batch["response_mask"].sum(-1).tolist() == [6, 7, 8]
    assert (rm_scores != 0).nonzero().tolist() == [[0, 5], [1, 6], [2, 7]]
    mask = data.batch["attention_mask"].bool()
    expected = reference_scores(
        reward_model_dir, [row[m].tolist() for row, m in zip(data.batch["input_ids"], mask, strict=True)]
    )
    assert rm_scores.sum(-1).tolist() == pytest.approx(expected, abs=1e-5)


def test_samples_are_re_encoded_when_the_actor_tokenizer_differs(
    tiny_config, reward_model_dir, tmp_path, shifted_tokenizer
):
    actor = shifted_tokenizer  # the same characters under other ids, and ChatML
    actor.save_pretrained(tmp_path / "actor")
    data = rollout_batch(actor, ["1+2=", "13+24="], ["####3", "####37"])
    rm_scores = scorer(tiny_config(), reward_model_dir, tmp_path / "actor").compute_rm_score(data).batch["rm_scores"]
    rm_tokenizer = load_tokenizer(str(reward_model_dir))
    sequences = [[*rm_tokenizer.encode(text), rm_tokenizer.eos_token_id] for text in ("1+2=####3", "13+24=####37")]
    assert rm_scores.sum(-1).tolist() == pytest.approx(reference_scores(reward_model_dir, sequences), abs=1e-5)
    never = scorer(tiny_config("reward.model.retokenize=never"), reward_model_dir, tmp_path / "actor")
    assert not torch.allclose(never.compute_rm_score(data).batch["rm_scores"], rm_scores)


def test_a_chat_prompt_is_rendered_with_the_reward_models_template(
    tiny_config, reward_model_dir, tmp_path, shifted_tokenizer
):
    actor = shifted_tokenizer
    actor.save_pretrained(tmp_path / "actor")
    chat = [{"role": "user", "content": "1+2="}]
    data = rollout_batch(actor, [format_prompt(chat, actor)], ["####3"])
    data.non_tensor_batch["raw_prompt"] = np.array([chat], dtype=object)
    rm_scores = scorer(tiny_config(), reward_model_dir, tmp_path / "actor").compute_rm_score(data).batch["rm_scores"]
    rm_tokenizer = load_tokenizer(str(reward_model_dir))  # its own template is `plain`: "user: 1+2=\nassistant: "
    sequence = [*rm_tokenizer.encode("user: 1+2=\nassistant: ####3"), rm_tokenizer.eos_token_id]
    assert rm_scores.sum().item() == pytest.approx(reference_scores(reward_model_dir, [sequence])[0], abs=1e-5)


def test_an_rm_step_reports_the_bradley_terry_loss_of_the_whole_step(tiny_config, preference_files, tiny_model_dir):
    # Micro-batches of 2 sequences (1 pair) each: the step's loss is still the mean over its 8 pairs.
    trainer = RMTrainer(rm_config(tiny_config, preference_files, "reward.model.micro_batch_size_per_device=2"))
    group = LocalWorkerGroup(RewardModelWorker, trainer.config, str(tiny_model_dir), str(tiny_model_dir), 3)
    group.init_model()
    batch = trainer.loader.next_batch()
    before = group.pairwise_eval(batch).batch
    metrics = group.rm_step(batch).meta_info["metrics"]
    chosen, rejected = before["chosen_scores"], before["rejected_scores"]
    assert metrics["rm/bt_loss"] == pytest.approx(bradley_terry_loss(chosen, rejected).item(), rel=1e-5)
    assert metrics["rm/pairwise_acc"] == pytest.approx(pairwise_accuracy(chosen, rejected).item())
    assert metrics["rm/margin"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-4, abs=1e-6)
    after = group.pairwise_eval(batch).batch
    assert bradley_terry_loss(after["chosen_scores"], after["rejected_scores"]) < bradley_terry_loss(chosen, rejected)


def test_ketch_rm_trains_validates_checkpoints_and_exports(tiny_config, preference_files, tmp_path, monkeypatch):
    frozen = []  # objects frozen by each run's one freeze after its first step (thawed at its end)
    freeze = WorkerGroups.freeze_long_lived
    monkeypatch.setattr(WorkerGroups, "freeze_long_lived", lambda g: (freeze(g), frozen.append(gc.get_freeze_count())))
    config = rm_config(tiny_config, preference_files, "reward.model.optim.lr=0.01")
    metrics = RMTrainer(config).fit()
    assert len(frozen) == 1 and frozen[0] > 10_000 and gc.get_freeze_count() == 0
    assert {"rm/bt_loss", "rm/pairwise_acc", "rm/grad_norm", "val/pairwise_acc", "val/bt_loss"} <= set(metrics)
    run_dir = Path(config.trainer.default_local_dir) / config.trainer.experiment_name
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert model.config.architectures == ["Qwen2ForSequenceClassification"] and model.config.num_labels == 1
    checkpoint = run_dir / "checkpoints" / "global_step_3"
    assert main(["export", str(checkpoint), str(tmp_path / "out"), "--role", "reward_model"]) == 0
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, exported.state_dict()[name]), name
    resumed = RMTrainer(rm_config(tiny_config, preference_files, "reward.model.optim.lr=0.01", "trainer.total_steps=4"))
    resumed.fit()
    assert len(frozen) == 2 and gc.get_freeze_count() == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert json.loads((run_dir / "checkpoints" / "global_step_4" / "trainer_state.json").read_text())["loader"] == {
        "epoch": 0, "batch_index": 4, "seed": 1,
    }  # fmt: skip


def test_ppo_adds_weighted_rule_and_model_scores(tiny_config, reward_model_dir):
    config = tiny_config(f"reward.model.path={reward_model_dir}", "reward.weights={rule: 1.0, model: 0.5}")
    trainer = PPOTrainer(config)
    trainer._open()
    batch = trainer._generate(trainer._expand(trainer.loader.next_batch()), 1)
    batch, metrics = trainer._score(batch)
    rule, _ = trainer.reward(batch)
    expected = rule.sum(-1) + 0.5 * batch.batch["rm_scores"].sum(-1)
    assert batch.batch["token_level_scores"].sum(-1).tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert metrics["reward/rule/mean"] == pytest.approx(rule.sum(-1).mean().item())
    assert metrics["reward/model/mean"] == pytest.approx(batch.batch["rm_scores"].sum(-1).mean().item(), rel=1e-5)
    trainer.groups.shutdown()


def test_a_reward_model_path_alone_means_model_scores_only(tiny_config, reward_model_dir):
    trainer = PPOTrainer(tiny_config(f"reward.model.path={reward_model_dir}", "trainer.total_steps=1"))
    trainer.reward = lambda batch: pytest.fail("the rule-based scorer must not be called in training")
    trainer._validate = lambda step: {}
    metrics = trainer.fit()
    assert "reward/model/mean" in metrics and "reward/rule/mean" not in metrics
    assert metrics["critic/score/mean"] == pytest.approx(metrics["reward/model/mean"], rel=1e-5)


def test_normalisation_statistics_are_checkpointed_and_resumed(tiny_config, reward_model_dir):
    overrides = (f"reward.model.path={reward_model_dir}", "reward.normalize=true", "reward.clip=3.0")
    trainer = PPOTrainer(tiny_config(*overrides, "trainer.total_steps=1"))
    metrics = trainer.fit()
    assert {"reward/model/running_mean", "reward/model/running_std", "reward/model/clipfrac"} <= set(metrics)
    state = json.loads((trainer.run_dir / "checkpoints" / "global_step_1" / "trainer_state.json").read_text())
    assert state["reward_mixer"]["stats"]["count"] == 8
    resumed = PPOTrainer(tiny_config(*overrides, "trainer.total_steps=2"))
    resumed._open()
    assert resumed.mixer.state_dict() == state["reward_mixer"]
    resumed.groups.shutdown()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.weights={rule: 1, human: 1}"], "reward.weights has unknown sources ['human']"),
        (["reward.weights={model: 1.0}"], "gives the reward model a weight, but reward.model.path is not set"),
        (["reward.clip=5"], "reward.clip and reward.normalize act on reward-model scores"),
        (["reward.model.path=x", "reward.weights={rule: 0, model: 0}"], "every source weight 0"),
    ],
)
def test_reward_settings_that_cannot_run_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_ketch_rm_names_a_missing_column(capsys, tiny_model_dir, task_files):
    argv = ["rm", f"model.path={tiny_model_dir}", f"data.train_files=[{task_files['train']}]", "trainer.device=cpu"]
    assert main(argv) == 2
    assert f"data file {task_files['train']} has no column 'chosen' (data.chosen_key)" in capsys.readouterr().err
