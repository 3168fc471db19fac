"""DAPO in the trainer: dynamic sampling (`algorithm.filter_groups`) and overlong shaping (`reward.overlong_buffer`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ketch.config.loader import ConfigError
from ketch.config.schema import FilterGroupsConfig
from ketch.protocol import DataProto
from ketch.tracking import read_metrics
from ketch.trainer.dynamic_sampling import DynamicSamplingError, fill_with_informative_groups, metric_values
from ketch.trainer.ppo import PPOTrainer

# Prompts with an even answer score 0 whatever the response (an all-equal group); the others score the parity
# of the response's length, which differs within most groups.
REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    acc = 0.0 if int(ground_truth) % 2 == 0 else float(len(solution_str) % 2)
    return {"score": acc, "acc": acc}
"""
CONSTANT_REWARD = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


class RecordingTrainer(PPOTrainer):
    """Keeps every batch that goes to the actor update."""

    def _for_update(self, batch: DataProto) -> DataProto:
        self.updated = [*getattr(self, "updated", []), batch]
        return super()._for_update(batch)


@pytest.fixture
def dapo_config(tiny_config, tmp_path):
    def make(reward: str, *overrides: str):
        path = tmp_path / "reward.py"
        path.write_text(reward)
        grpo = ("algorithm.adv_estimator=grpo", "rollout.n=4", "algorithm.filter_groups.enable=true")
        return tiny_config(f"reward.function={path}:score", *grpo, *overrides)

    return make


def test_no_update_batch_holds_a_group_whose_advantages_are_all_zero(dapo_config):
    trainer = RecordingTrainer(dapo_config(REWARD, "trainer.total_steps=2", "algorithm.filter_groups.metric=acc"))
    # rounds of the default size, data.train_batch_size = 8 prompts
    trainer.fit()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert len(trainer.updated) == 2
    for batch in trainer.updated:
        uids = batch.non_tensor_batch["uid"]
        assert len(batch) == 8 * 4 and len(set(uids)) == 8  # data.train_batch_size full groups of rollout.n
        assert all(int(t) % 2 == 1 for t in batch.non_tensor_batch["ground_truth"])  # even answers: all equal
        advantages = batch.batch["advantages"].abs() * batch.batch["response_mask"]
        for uid in set(uids):
            assert advantages[torch.as_tensor(uids == uid)].sum() > 0, f"group {uid} has all-zero advantages"
    for r in records:  # about half the prompts have an even answer: one round of 8 cannot fill the batch
        assert r["dynamic_sampling/gen_rounds"] >= 2
        assert r["dynamic_sampling/groups_generated"] == 8 * r["dynamic_sampling/gen_rounds"]
        assert r["dynamic_sampling/groups_informative"] >= 8


def test_larger_rounds_of_gen_batch_size_prompts_still_give_a_batch_of_train_batch_size_groups(dapo_config):
    config = dapo_config(REWARD, "trainer.total_steps=1", "algorithm.filter_groups.gen_batch_size=20")
    trainer = RecordingTrainer(config)
    trainer._open()
    metrics = trainer._train_step(trainer.loader.next_batch(), 1)
    trainer.groups.shutdown()
    assert metrics["dynamic_sampling/groups_generated"] == 20 * metrics["dynamic_sampling/gen_rounds"]
    assert metrics["dynamic_sampling/groups_informative"] >= 8
    assert len(trainer.updated[0]) == 8 * 4


def test_groups_that_never_differ_stop_after_max_num_gen_batches_naming_the_keys(dapo_config):
    trainer = PPOTrainer(dapo_config(CONSTANT_REWARD, "algorithm.filter_groups.max_num_gen_batches=2"))
    trainer._open()
    with pytest.raises(DynamicSamplingError) as err:
        trainer._train_step(trainer.loader.next_batch(), 1)
    trainer.groups.shutdown()
    message = str(err.value)
    assert "found 0 of the data.train_batch_size=8 informative groups" in message
    assert "max_num_gen_batches=2 rounds of generation (16 groups)" in message
    assert "algorithm.filter_groups.max_num_gen_batches" in message and "rollout.n" in message


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("rollout.n=1",), "rollout.n=1 and rollout.do_sample=true they never can"),
        (("rollout.n=4", "rollout.do_sample=false"), "rollout.do_sample=false they never can"),
        (("rollout.n=4", "algorithm.filter_groups.max_num_gen_batches=-1"), "max_num_gen_batches=-1 must be >= 0"),
        (("rollout.n=4", "algorithm.filter_groups.gen_batch_size=0"), "gen_batch_size=0 must be >= 1"),
        (
            (
                "rollout.n=4",
                "algorithm.filter_groups.gen_batch_size=3",
                "algorithm.filter_groups.max_num_gen_batches=2",
            ),
            r"max_num_gen_batches=2 rounds of gen_batch_size=3 prompts generate fewer groups than the "
            r"data.train_batch_size=8 .* raise algorithm.filter_groups.max_num_gen_batches",
        ),
    ],
)
def test_filter_settings_that_can_never_fill_a_batch_stop_at_load(tiny_config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config("algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true", *overrides)


def test_the_filter_metric_is_the_summed_score_or_a_reward_field():
    batch = DataProto.from_dict(
        {"token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -0.5]])},
        {"reward_extra/acc": np.array([1.0, 0.0])},
    )
    assert metric_values(batch, "seq_reward").tolist() == [1.0, -0.5]
    assert metric_values(batch, "acc").tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"metric='pass' is not seq_reward nor a field .*\(fields: \['acc'\]\)"):
        metric_values(batch, "pass")


def test_overlong_penalty_lands_on_the_last_response_token(tiny_config, tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(CONSTANT_REWARD)
    overlong = ("reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4")
    trainer = PPOTrainer(tiny_config(f"reward.function={path}:score", *overlong))
    # data.max_response_length = 8, buffer 4: lengths 3, 6 and 8 → penalties 0, (4 − 6) / 4 = −0.5, −1
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    batch = DataProto.from_dict(
        {"responses": torch.full((3, 8), 5) * mask, "response_mask": mask},
        {"data_source": np.array(["x"] * 3, dtype=object), "ground_truth": np.array(["1"] * 3, dtype=object)},
    )
    trainer._open()
    batch, metrics = trainer._score(batch)
    trainer.groups.shutdown()
    expected = torch.zeros(3, 8)
    expected[0, 2], expected[1, 5], expected[2, 7] = 1.0, 0.5, 0.0
    torch.testing.assert_close(batch.batch["token_level_scores"], expected)
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.5)
    assert metrics["reward/overlong_fraction"] == pytest.approx(2 / 3)


def _round(prompts: list[list[int]], scores: list[float]) -> DataProto:
    """One scored round of two samples per prompt: prompt ids [rows, width], one response token each."""
    ids = torch.tensor([p for p in prompts for _ in range(2)])
    rows, width = ids.shape
    return DataProto(
        {
            "prompts": ids,
            "input_ids": torch.cat([ids, torch.full((rows, 1), 7)], dim=1),
            "attention_mask": torch.ones(rows, width + 1, dtype=torch.long),
            "position_ids": torch.arange(width + 1).expand(rows, -1),
            "token_level_scores": torch.tensor(scores).unsqueeze(1),
        },
        {"uid": np.array([f"{width}-{i // 2}" for i in range(rows)], dtype=object)},
    )


def test_rounds_with_prompts_of_other_widths_are_left_padded_to_the_widest():
    # Round 1 (prompts 2 wide): group 0 informative (scores 0, 1), group 1 not (1, 1). Round 2 (3 wide): group 0
    # informative. The batch of 2 groups holds round 1's group 0, padded by one pad id (9) on the left, then round 2's.
    rounds = iter([_round([[5, 6, 8]], [1.0, 0.0])])
    first = _round([[3, 4], [1, 2]], [0.0, 1.0, 1.0, 1.0])
    batch, _ = fill_with_informative_groups(
        first, lambda prompts: (prompts, {}), lambda: next(rounds), FilterGroupsConfig(enable=True), 2, 2, 9
    )
    assert batch.batch["prompts"].tolist() == [[9, 3, 4], [9, 3, 4], [5, 6, 8], [5, 6, 8]]
    assert batch.batch["input_ids"].tolist() == [[9, 3, 4, 7], [9, 3, 4, 7], [5, 6, 8, 7], [5, 6, 8, 7]]
    assert batch.batch["attention_mask"].tolist() == [[0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2
    assert batch.batch["position_ids"].tolist() == [[0, 0, 1, 2]] * 2 + [[0, 1, 2, 3]] * 2


class UpdateRecordingTrainer(PPOTrainer):
    """Keeps each step's batch before and after `_for_update`."""

    def _for_update(self, batch: DataProto) -> DataProto:
        update = super()._for_update(batch)
        self.updates = [*getattr(self, "updates", []), (batch, update)]
        return update


FIRST_CHARACTER_REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ord(solution_str[0]) % 2) if solution_str else 0.0
"""


@pytest.mark.parametrize("length", [4, 1])
def test_overlong_filtering_leaves_cut_off_responses_out_of_the_actor_update(tiny_config, tmp_path, length):
    """GRPO, 8 prompts x 4 responses scored by their first character. Up to 4 tokens, with a third of the ids
    stopping a response, some stop: the update's response_mask keeps theirs and zeroes the cut-off ones' rows.
    Responses of 1 token all use their budget: the update has no token to learn from, so its loss and gradient are
    exactly 0, not NaN, though the advantages are not."""
    path = tmp_path / "reward.py"
    path.write_text(FIRST_CHARACTER_REWARD)
    stop_ids = ",".join(str(i) for i in range(3, 60, 3))
    trainer = UpdateRecordingTrainer(
        tiny_config(
            f"reward.function={path}:score",
            "algorithm.adv_estimator=grpo",
            "rollout.n=4",
            f"data.max_response_length={length}",
            "algorithm.overlong_filtering=true",
            f"rollout.stop_token_ids=[{stop_ids}]",
        )
    )
    trainer._open()
    metrics = trainer._train_step(trainer.loader.next_batch(), 1)
    trainer.groups.shutdown()
    ((batch, update),) = trainer.updates  # one process: the update keeps the batch's order
    cut = batch.batch["attention_mask"][:, -length:].sum(-1) == length
    mask, kept = batch.batch["response_mask"], update.batch["response_mask"]
    assert metrics["response_length/clip_ratio"] == pytest.approx(cut.float().mean().item())
    assert not kept[cut].any() and torch.equal(kept[~cut], mask[~cut])
    assert (batch.batch["advantages"] * mask).abs().sum() > 0
    if length > 1:
        assert 0 < cut.sum() < 32 and math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    else:
        assert cut.all() and metrics["actor/pg_loss"] == 0.0 and metrics["actor/grad_norm"] == 0.0


def test_overlong_filtering_with_ignore_eos_is_refused(tiny_config):
    with pytest.raises(ConfigError, match="every response is cut off, so the actor would never learn"):
        tiny_config("algorithm.overlong_filtering=true", "rollout.ignore_eos=true")
