"""Partial rollouts (`rollout.partial`): trajectories carried between steps, their staleness bound, every prompt
trained once, and a resume that continues the same trajectories."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_checkpoint import break_after
from test_rollout import actor_group, prompts

from ketch.config import ConfigError, load_config
from ketch.config.partial import describe_partial_rollouts
from ketch.protocol import DataProto
from ketch.rollout.base import rollout_output
from ketch.rollout.group_stop import FINISH_FRACTION, GROUP_INDEX, MUST_FINISH, UNFINISHED
from ketch.tracking import read_metrics
from ketch.trainer.loop import RunFailedError
from ketch.trainer.partial import PARTIAL_FILE, PartialRollouts, continuation
from ketch.trainer.ppo import PPOTrainer

PARTIAL = ("rollout.n=2", "data.train_batch_size=4", "actor.rollout_is=token", "rollout.partial.enable=true")
GRPO = "algorithm.adv_estimator=grpo"
STOPS = "rollout.stop_token_ids=[" + ",".join(map(str, range(21, 41))) + "]"
"""A fifth of the character vocabulary (digits and letters) ends a response, so the tiny random model's responses
stop anywhere from their first token to the limit: some trajectories are unfinished when a step's batch is full."""


class TrainedRows:
    """Records the `uid` and data-set `index` of every row a trainer scores (its trained batches), per step."""

    def __init__(self, trainer: PPOTrainer):
        self.uids: list[list[str]] = []
        self.indices: list[list[int]] = []
        self.index_of: dict[str, int] = {}
        score = trainer._score

        def record(batch):
            self.uids.append(list(batch.non_tensor_batch["uid"][:: trainer.config.rollout.n]))
            self.indices.append([int(i) for i in batch.non_tensor_batch["index"][:: trainer.config.rollout.n]])
            self.index_of |= dict(zip(self.uids[-1], self.indices[-1], strict=True))
            return score(batch)

        trainer._score = record


def test_continuation_is_the_prompt_then_the_response_so_far_left_padded():
    prompt_ids = torch.tensor([[0, 0, 7, 8], [0, 5, 6, 9]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    responses = torch.tensor([[11, 12, 13, 0], [14, 0, 0, 0]])
    out = continuation(prompt_ids, prompt_mask, responses, torch.tensor([3, 0]), pad_token_id=0).batch
    assert out["input_ids"].tolist() == [[7, 8, 11, 12, 13], [0, 0, 5, 6, 9]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]


def test_partial_rollouts_carry_trajectories_and_a_resume_after_step_3_gives_the_same_metrics(tiny_config, monkeypatch):
    # PPO with a critic (the tiny model's rewards are all 0, so GRPO would never move its weights): the carried
    # tokens' probabilities then move well beyond rounding between steps, also those a resumed run starts with
    config = tiny_config(
        *PARTIAL,
        STOPS,
        "rollout.partial.round_tokens=2",
        "rollout.partial.max_staleness=3",
        "trainer.total_steps=5",
        "trainer.save_freq=3",
        "actor.optim.lr=0.01",
    )
    unbroken = PPOTrainer(config)
    unbroken_rows = TrainedRows(unbroken)
    unbroken.fit()
    expected = read_metrics(unbroken.run_dir / "metrics.jsonl")
    assert sum(r["partial/carried_unfinished"] for r in expected) > 0  # the buffer did carry unfinished ones
    assert max(r["partial/staleness/max"] for r in expected) >= 1
    shutil.rmtree(unbroken.run_dir)

    with monkeypatch.context() as patch:
        break_after(patch, steps=3)
        first = PPOTrainer(config)
        first_rows = TrainedRows(first)
        with pytest.raises(RunFailedError):
            first.fit()
    assert (first.run_dir / "checkpoints/global_step_3" / PARTIAL_FILE).is_file()
    resumed = PPOTrainer(config)
    resumed_rows = TrainedRows(resumed)
    resumed.fit()
    got = read_metrics(resumed.run_dir / "metrics.jsonl")

    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert first_rows.indices[:3] + resumed_rows.indices == unbroken_rows.indices
    compared = [k for k in expected[-1] if k.startswith(("partial/", "actor/", "critic/", "response_length/"))]
    assert "partial/carried" in compared and "actor/pg_loss" in compared
    for want, have in zip(expected[3:], got[3:], strict=True):
        for key in compared:  # CPU, float32, same seed: equal up to float rounding
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)


def test_every_prompt_of_an_epoch_is_trained_once(tiny_config):
    # 16 prompts, 4 a step, 6 in flight: the loader's first epoch is drawn by step 3, and with rounds of 2 of the
    # 8 tokens a trajectory finishes within 4 steps of its first token
    config = tiny_config(
        *PARTIAL,
        GRPO,
        STOPS,
        "data.max_samples=16",
        "rollout.partial.round_tokens=2",
        "rollout.partial.max_staleness=3",
        "trainer.total_steps=8",
    )
    trainer = PPOTrainer(config)
    drawn: list[tuple[int, list[str]]] = []  # (epoch, uids) of each loader batch, as it enters the buffer
    add = trainer.partial._add

    def record(rows, prompts):
        drawn.append((prompts.meta_info["epoch"], list(prompts.non_tensor_batch["uid"][:: config.rollout.n])))
        return add(rows, prompts)

    trainer.partial._add = record
    trained = TrainedRows(trainer)
    trainer.fit()
    trained_uids = [uid for step in trained.uids for uid in step]
    first_epoch = [uid for epoch, uids in drawn if epoch == 0 for uid in uids]
    assert len(trained_uids) == 8 * 4 and len(set(trained_uids)) == len(trained_uids)  # none trained twice
    assert len(first_epoch) == 16 and set(first_epoch) <= set(trained_uids)  # every one of the epoch trained
    assert len({trained.index_of[uid] for uid in first_epoch}) == 16  # 16 prompts, not one of them twice


@pytest.mark.parametrize(
    ("max_staleness", "dropped", "staleness_mean"),
    [(0, [0, 4, 4], [0.0, 0.0, 0.0]), (1, [0, 0, 0], [0.0, 0.5, 0.5])],
)
def test_the_staleness_bound_drops_the_trajectories_begun_too_long_ago(
    tiny_config, max_staleness, dropped, staleness_mean
):
    # every response runs to the 8-token limit in one round, so each step finishes all 6 groups in flight and trains
    # the 4 oldest; the 2 others wait, finished, for the next step, one step stale. With max_staleness=0 their 4
    # trajectories (32 tokens) are dropped and sampled again; with 1 they are trained.
    config = tiny_config(
        *PARTIAL,
        GRPO,
        "rollout.ignore_eos=true",
        "rollout.partial.round_tokens=8",
        f"rollout.partial.max_staleness={max_staleness}",
        "trainer.total_steps=3",
    )
    trainer = PPOTrainer(config)
    trainer.fit()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["partial/trajectories_dropped"] for r in records] == dropped
    assert [r["partial/tokens_dropped"] for r in records] == [8.0 * d for d in dropped]
    assert [r["partial/staleness/mean"] for r in records] == staleness_mean
    assert [r["partial/carried"] for r in records] == [4.0, 4.0, 4.0]
    assert [r["partial/carried_unfinished"] for r in records] == [0.0, 0.0, 0.0]
    assert [r["partial/rounds"] for r in records] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["actor.rollout_is=null"], "set actor.rollout_is=token"),
        (["algorithm.adv_estimator=remax"], "does not support algorithm.adv_estimator=remax"),
        (["rollout.partial.round_tokens=2", "rollout.partial.max_staleness=1"], "2 x 2 tokens"),
        (["rollout.partial.over_sample=0.5"], "rollout.partial.over_sample"),
    ],
)
def test_partial_rollouts_refuse_what_they_cannot_continue_at_load(tiny_config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(*PARTIAL, *overrides)


def test_partial_rollouts_correct_with_token_level_rollout_is_by_default(tiny_config):
    """Also on the built-in run, whose `actor.old_log_prob_from_rollout=true` would skip the pass it needs."""
    on = "rollout.partial.enable=true"
    for config in (tiny_config("rollout.n=2", "data.train_batch_size=4", on), load_config(overrides=[on])):
        assert (config.actor.rollout_is, config.actor.old_log_prob_from_rollout) == ("token", False)
    kept = load_config(overrides=[on, "actor.rollout_is=sequence"])
    assert (kept.actor.rollout_is, kept.actor.old_log_prob_from_rollout) == ("sequence", False)


def test_the_doctor_line_says_what_partial_rollouts_bound():
    assert describe_partial_rollouts(load_config(overrides=[])).startswith("off: ")
    on = load_config(
        overrides=[
            *PARTIAL,
            "actor.old_log_prob_from_rollout=false",
            "actor.ppo_mini_batch_size=4",
            "data.max_response_length=1000",
        ]
    )
    assert describe_partial_rollouts(on) == (
        "on: 6 prompts in flight for 4 a step (over_sample 1.5), one round a step (ended once 4 prompts are "
        "finished), a trajectory spans at most 2 steps (max_staleness 1); its older tokens weighted by "
        "truncated importance sampling (actor.rollout_is=token, at most 2)"
    )


def test_a_round_keeps_a_rows_tokens_up_to_its_stop_or_budget_when_padding_is_a_stop_token(tiny_config):
    # pad = the stop token 1, as for models that pad with their EOS: a row that used its whole budget reads as
    # stopped one token later, which is a cut, not a stop; a row stopped by its own token is finished; a row cut at
    # data.max_response_length (8) is finished too
    buffer = PartialRollouts(
        tiny_config(*PARTIAL, "rollout.partial.round_tokens=3", "rollout.partial.max_staleness=2"), pad_token_id=1
    )
    prompt = torch.tensor([[9, 9]] * 3)
    rows = DataProto.from_dict({"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, meta_info={})
    rows = buffer._add(None, rows)
    so_far = torch.tensor([[1] * 8, [1] * 8, [4, 4, 4, 4, 4, 4, 1, 1]])
    rows.batch |= {
        "responses": so_far,
        "response_length": torch.tensor([0, 0, 6]),
        "first_step": torch.tensor([0, 0, 1]),
    }
    calls = []

    def generate(inputs: DataProto) -> DataProto:
        calls.append(inputs)
        sampled = torch.tensor([[5, 6, 7], [5, 1, 1], [5, 6, 7]])
        responses = torch.nn.functional.pad(sampled, (0, 5), value=1)
        log_probs = -torch.arange(1, 9).float().expand(3, 8) / 10
        return rollout_output(inputs, responses, log_probs, stop_token_ids=[1], pad_token_id=1)

    out = buffer._continue(rows, step=2, generate=generate, groups=torch.tensor([0, 0, 1]), needed=1).batch
    assert calls[0].meta_info["max_new_tokens"] == 3
    assert calls[0].batch[GROUP_INDEX].tolist() == [0, 0, 1] and calls[0].meta_info[FINISH_FRACTION] == 0.5
    assert calls[0].batch["input_ids"].tolist()[2] == [9, 9, 4, 4, 4, 4, 4, 4]
    assert out["responses"].tolist() == [[5, 6, 7, 1, 1, 1, 1, 1], [5, 1, 1, 1, 1, 1, 1, 1], [4, 4, 4, 4, 4, 4, 5, 6]]
    assert out["response_length"].tolist() == [3, 2, 8]
    assert out["finished"].tolist() == [False, True, True]
    assert out["first_step"].tolist() == [2, 2, 1]
    assert out["rollout_log_probs"][2, 6:].tolist() == pytest.approx([-0.1, -0.2])
    assert out["rollout_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0, 0, 0, 0, 0])


def test_a_checkpoints_buffer_of_another_group_size_is_refused_naming_the_keys(tiny_config, tmp_path):
    prompt = torch.tensor([[9, 9]] * 2)
    prompts = DataProto.from_dict({"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, {"uid": ["a", "b"]})
    saved = PartialRollouts(tiny_config(*PARTIAL), pad_token_id=0)._add(None, prompts.repeat(2))
    saved.save_to_disk(tmp_path / PARTIAL_FILE)
    PartialRollouts(tiny_config(*PARTIAL), pad_token_id=0).load(tmp_path / PARTIAL_FILE)
    with pytest.raises(ValueError, match=r"another rollout.n or data.max_response_length than this run's \(3, 8\)"):
        PartialRollouts(tiny_config(*PARTIAL, "rollout.n=3"), pad_token_id=0).load(tmp_path / PARTIAL_FILE)


def test_the_static_decoder_stops_at_a_rounds_tokens_as_generate_does(tiny_config):
    # a round asks for 3 of the 12 tokens: both decodings give the same 3 greedy tokens, then padding
    batch = prompts(tiny_config(), rows=4)
    batch.meta_info |= {"do_sample": False, "max_new_tokens": 3}
    outputs = {}
    for decoding in ("generate", "static"):
        group = actor_group(tiny_config("data.max_response_length=12", f"rollout.hf_decoding={decoding}"))
        outputs[decoding] = group.generate_sequences(batch).batch
    assert torch.equal(outputs["static"]["responses"], outputs["generate"]["responses"])
    assert (outputs["static"]["responses"][:, 3:] == 0).all()
    torch.testing.assert_close(
        outputs["static"]["rollout_log_probs"][:, :3],
        outputs["generate"]["rollout_log_probs"][:, :3],
        atol=1e-5,
        rtol=0,
    )


def test_the_static_decoder_stops_a_round_once_enough_groups_are_finished(tiny_config):
    """8 sampled rows in 4 groups of 2, a quarter of the groups needed: the decoder stops at its first check (every
    16 tokens) with a group finished, and cuts the rows still going there; the same seed without the stop gives the
    same tokens, decoded to their ends."""
    stops = "rollout.stop_token_ids=[21,22,23,24]"
    group = actor_group(tiny_config("data.max_response_length=64", "rollout.hf_decoding=static", stops))
    batch = prompts(tiny_config(), rows=8)
    torch.manual_seed(0)
    whole = group.generate_sequences(batch).batch
    batch.batch[GROUP_INDEX] = torch.arange(8) // 2
    batch.meta_info[FINISH_FRACTION] = 0.25
    torch.manual_seed(0)
    cut = group.generate_sequences(batch).batch
    # the groups end at 39, 45, 64 and 17 tokens: at the check after 32 tokens the last group is finished
    assert whole["response_mask"].sum(-1).tolist() == [39, 6, 1, 45, 7, 64, 17, 7] and UNFINISHED not in whole
    assert cut["response_mask"].sum(-1).tolist() == [32, 6, 1, 32, 7, 32, 17, 7]
    assert cut[UNFINISHED].tolist() == [True, False, False, True, False, True, False, False]
    kept = cut["response_mask"].bool()
    assert torch.equal(cut["responses"][kept], whole["responses"][kept]) and (cut["responses"][~kept] == 0).all()
    assert torch.equal(cut["rollout_log_probs"][kept], whole["rollout_log_probs"][kept])
    assert torch.equal(cut["attention_mask"][:, -64:], cut["response_mask"])
    # row 0 must finish (the staleness bound would drop it): the stop waits for its 39 tokens, to the check at 48
    batch.batch[MUST_FINISH] = torch.arange(8) == 0
    torch.manual_seed(0)
    waited = group.generate_sequences(batch).batch
    assert waited["response_mask"].sum(-1).tolist() == [39, 6, 1, 45, 7, 48, 17, 7]
    assert waited[UNFINISHED].tolist() == [False] * 5 + [True, False, False]


def test_a_trajectory_in_its_last_step_must_finish_and_may_pass_the_rounds_tokens(tiny_config):
    # at step 3 with max_staleness=2, a trajectory begun at step 1 is dropped unless it finishes now: the backend may
    # not cut it (must_finish) and it gets the 4 tokens it has left, more than a round's 3
    config = tiny_config(*PARTIAL, "rollout.partial.round_tokens=3", "rollout.partial.max_staleness=2")
    buffer = PartialRollouts(config, pad_token_id=0)
    prompt = torch.tensor([[9, 9]] * 3)
    rows = buffer._add(None, DataProto.from_dict({"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}))
    rows.batch |= {"response_length": torch.tensor([0, 2, 4]), "first_step": torch.tensor([0, 2, 1])}
    calls = []

    def generate(inputs: DataProto) -> DataProto:
        calls.append(inputs)
        responses = torch.tensor([[5, 1] + [0] * 6] * 3)
        return rollout_output(inputs, responses, torch.zeros(3, 8), stop_token_ids=[1], pad_token_id=0)

    out = buffer._continue(rows, step=3, generate=generate, groups=torch.tensor([0, 0, 1]), needed=1).batch
    assert calls[0].batch[MUST_FINISH].tolist() == [False, False, True]
    assert calls[0].meta_info["max_new_tokens"] == 4
    assert out["response_length"].tolist() == [2, 4, 6] and out["finished"].all()


@pytest.mark.parametrize(
    ("decoding", "left_lengths", "left_finished"),
    [("generate", [3, 13, 19, 18], [True, True, False, True]), ("static", [16, 6, 16, 11], [False, True, False, True])],
)
def test_a_round_of_the_whole_length_ends_once_the_batch_is_finished(
    tiny_config, decoding, left_lengths, left_finished
):
    # one round of the whole response length for 6 groups of 2 (without the stop, generate decodes a row to 58
    # tokens): generate looks after every token and stops at the 19th, when the 4th group finishes; the static decoder
    # looks every 16 tokens and stops at its first check. The rows cut there go to the next step (max_staleness=1
    # keeps them), with the finished groups beyond the batch and the 2 groups not begun (over-sampled prompts)
    config = tiny_config(
        *PARTIAL, GRPO, "rollout.stop_token_ids=[21,22,23,24]", "data.max_response_length=64",
        "rollout.partial.round_tokens=64", f"rollout.hf_decoding={decoding}", "trainer.total_steps=1",
    )  # fmt: skip
    trainer = PPOTrainer(config)
    trainer.fit()
    (record,) = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert record["partial/rounds"] == 1.0
    assert record["partial/carried_unfinished"] == left_finished.count(False)
    left = trainer.partial.rows.batch
    assert left["response_length"].tolist() == [*left_lengths, 0, 0, 0, 0]
    assert left["finished"].tolist() == [*left_finished, False, False, False, False]


def test_without_a_token_budget_a_step_is_one_round_cut_where_the_batch_is_finished(tiny_config):
    """No `round_tokens`: each step's generation is one round, which the rollout stops once 4 of the 6 groups in
    flight are finished; the rows it cut are carried unfinished with their tokens (no round prefills them twice)."""
    config = tiny_config(*PARTIAL, GRPO, STOPS, "data.max_response_length=24", "trainer.total_steps=3")
    trainer = PPOTrainer(config)
    trainer.fit()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["partial/rounds"] for r in records] == [1.0, 1.0, 1.0]
    assert [r["partial/carried_unfinished"] for r in records] == [3.0, 2.0, 1.0]
