"""Multi-turn trajectories carried between rounds of partial rollouts (`meta_info["round_tokens"]`): a round's budget
cuts turns, the next round (a new rollout, its rows read back from disk as from a checkpoint) continues them, and the
finished trajectory is the one an uncut call gives, token for token; environments are rebuilt by `restore` or by
replaying `step`."""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import numpy as np
import pytest
import torch
from test_checkpoint import break_after

from ketch.config import load_config
from ketch.config.partial import describe_partial_rollouts
from ketch.data import build_char_tokenizer
from ketch.data.builtin.calculator import CALL
from ketch.protocol import DataProto, object_array
from ketch.rollout.base import Rollout, rollout_output
from ketch.rollout.multi_turn import MultiTurnRollout, environment_factory
from ketch.rollout.multi_turn.trajectory import CARRIED_COLUMNS, CARRIED_TENSORS, not_begun, rollout_fields
from ketch.tracking import read_metrics
from ketch.trainer.loop import RunFailedError
from ketch.trainer.partial import PARTIAL_FILE, PartialRollouts
from ketch.trainer.ppo import PPOTrainer

SCRIPT = {
    "3*4=": [CALL.format("3*4"), CALL.format("12+1"), "#### 13"],  # two tool calls, then the answer
    "2+5=": ["#### 7"],  # no call
}
ROLLOUT_FIELDS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")
ROLLOUT_FIELDS += ("rollout_log_probs",)
OVERRIDES = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculate]")
OVERRIDES += ("data.max_prompt_length=32", "data.max_response_length=240")


class ContinuingPolicy(Rollout):
    """Writes turn k of a prompt's script and EOS, going on from the part of the turn the context already holds (a
    turn a round cut); the i-th token of a turn gets log-prob -(i + 1) / 64, so a token's log-prob tells where in its
    turn it was sampled."""

    def __init__(self, tokenizer, width: int, script: dict[str, list[str]]):
        self.tokenizer, self.width, self.script = tokenizer, width, script

    def generate(self, prompts: DataProto) -> DataProto:
        responses = torch.zeros(len(prompts), self.width, dtype=torch.long)
        log_probs = torch.zeros(len(prompts), self.width)
        for i, (ids, mask) in enumerate(
            zip(prompts.batch["input_ids"], prompts.batch["attention_mask"].bool(), strict=True)
        ):
            context = self.tokenizer.decode(ids[mask].tolist())
            question = next(line for line in context.split("\n") if line.startswith("user: ")).removeprefix("user: ")
            turn = self.script[question][context.count("assistant: ") - 1]
            written = context.rsplit("assistant: ", 1)[1]
            rest = self.tokenizer(turn[len(written) :])["input_ids"] + [self.tokenizer.eos_token_id]
            responses[i, : len(rest)] = torch.tensor(rest)
            log_probs[i, : len(rest)] = -torch.arange(len(written) + 1, len(written) + len(rest) + 1) / 64
        return rollout_output(prompts, responses, log_probs, [self.tokenizer.eos_token_id], 0)

    def update_weights(self, named_tensors) -> None: ...

    def weight_norm(self, name: str) -> float:
        return 0.0


def rollout(config, script: dict[str, list[str]] = SCRIPT, new_environment=None) -> MultiTurnRollout:
    tokenizer = build_char_tokenizer()
    policy = ContinuingPolicy(tokenizer, config.data.max_response_length, script)
    new_environment = new_environment or environment_factory(config, tokenizer)
    return MultiTurnRollout(policy, config, tokenizer, new_environment)


def prompt_rows(prompts: list[str]) -> DataProto:
    dummy = torch.zeros(len(prompts), 1, dtype=torch.long)  # the loop renders the prompts itself
    return DataProto.from_dict({"input_ids": dummy}, {"raw_prompt": object_array(prompts)})


def in_rounds(config, prompts: list[str], round_tokens: int, tmp_path, **kwargs) -> list[DataProto]:
    """Rounds of `round_tokens` until every trajectory is finished, as the partial rollouts' buffer runs them: the
    carried rows go back to a new rollout each round, read from disk. Returns the rows after each round."""
    carried = not_begun(len(prompts), config.data.max_prompt_length, config.data.max_response_length, pad=0)
    rows = DataProto.from_dict(carried.batch, carried.non_tensor_batch | {"raw_prompt": object_array(prompts)})
    after = []
    while not rows.batch["finished"].all():
        index = (~rows.batch["finished"]).nonzero().squeeze(-1)
        part, rows = rows[index].select(batch_keys=CARRIED_TENSORS), rows.select()
        part.meta_info["round_tokens"] = round_tokens
        out = rollout(config, **kwargs).generate(part)
        for key in CARRIED_TENSORS:
            rows.batch[key] = rows.batch[key].index_copy(0, index, out.batch[key])
        for key in CARRIED_COLUMNS:
            rows.non_tensor_batch[key] = rows.non_tensor_batch[key].copy()
            rows.non_tensor_batch[key][index.numpy()] = out.non_tensor_batch[key]
        rows.save_to_disk(tmp_path / "rows.pt")
        rows = DataProto.load_from_disk(tmp_path / "rows.pt")
        after.append(rows)
    return after


def assert_same_trajectories(carried: DataProto, uncut: DataProto) -> None:
    """The carried rows' trajectories are the uncut call's: every `Rollout` tensor and column equal (but the tools'
    wall time)."""
    fields = rollout_fields(carried.batch)
    assert fields.keys() == uncut.batch.keys()
    for key, value in uncut.batch.items():
        assert torch.equal(fields[key], value), key
    assert set(CARRIED_COLUMNS) == set(uncut.non_tensor_batch)
    for key in set(CARRIED_COLUMNS) - {"tool_time"}:
        for have, want in zip(carried.non_tensor_batch[key], uncut.non_tensor_batch[key], strict=True):
            assert have == want or (math.isnan(have) and math.isnan(want)), key


def test_rounds_cut_the_tool_calls_and_continue_them_to_the_uncut_trajectory(tmp_path):
    config = load_config(overrides=list(OVERRIDES))
    uncut = rollout(config).generate(prompt_rows(["3*4=", "2+5="]))
    rounds = in_rounds(config, ["3*4=", "2+5="], 30, tmp_path)
    # The first row samples 80 (the call) + 81 (the second call) + 8 ("#### 13" and EOS) = 169 tokens, 30 a round;
    # the tool's answers (21 tokens each: "\ntool: 12\nassistant: ") come in between and are not counted. Round 3
    # ends the first call (20 tokens), gets the tool's answer and begins the second call with the 10 tokens left;
    # round 6 ends it (11) and writes the answer (8). The second row ends in round 1 ("#### 7" and EOS).
    b = [r.batch for r in rounds]
    assert [r["response_length"].tolist() for r in b] == [[30, 7], [60, 7], [111, 7], [141, 7], [171, 7], [211, 7]]
    assert [r["turn_tokens"][0].item() for r in b] == [30, 60, 10, 40, 70, 0]
    assert [r["finished"].tolist() for r in b] == [[False, True]] * 5 + [[True, True]]
    assert [r.non_tensor_batch["num_turns"][0] for r in rounds] == [1, 1, 2, 2, 2, 3]
    assert [r.non_tensor_batch["tool_calls"][0] for r in rounds] == [0, 0, 1, 1, 1, 2]
    sampled = [r["response_mask"][0].sum().item() for r in b]
    assert sampled == [30, 60, 90, 120, 150, 169]
    # a cut turn is the conversation's last message, its text so far
    assert rounds[0].non_tensor_batch["messages"][0][-1] == {"role": "assistant", "content": CALL.format("3*4")[:30]}
    assert rounds[2].non_tensor_batch["messages"][0][-2:] == [
        {"role": "tool", "name": "calculate", "content": "12"},
        {"role": "assistant", "content": CALL.format("12+1")[:10]},
    ]
    # the tokens a round carries stay as they were, log-probs included (the i-th token of a turn: -(i + 1) / 64)
    for before, after in itertools.pairwise(b):
        length = before["response_length"][0]
        assert torch.equal(after["responses"][0, :length], before["responses"][0, :length])
        assert torch.equal(after["rollout_log_probs"][0, :length], before["rollout_log_probs"][0, :length])
    assert b[-1]["rollout_log_probs"][0, 79:82].tolist() == [-80 / 64, 0.0, 0.0]  # the call's last token, the glue
    assert_same_trajectories(rounds[-1], uncut)


def test_a_turn_cut_by_a_round_keeps_its_own_token_limit(tmp_path):
    # max_tokens_per_turn=50 counts over the rounds of a turn: rounds of 20 cut the first call at 20 and 40, and
    # round 3 ends it at its 50th token as an uncut call ends (an unclosed call, answered with an error), then
    # begins the second with the 10 tokens left; round 5 ends that one at 50 too, round 6 writes the answer
    limits = ("rollout.multi_turn.max_tokens_per_turn=50", "data.max_response_length=600")
    config = load_config(overrides=[*OVERRIDES, *limits])
    uncut = rollout(config).generate(prompt_rows(["3*4="]))
    rounds = in_rounds(config, ["3*4="], 20, tmp_path)
    assert [r.batch["turn_tokens"][0].item() for r in rounds] == [20, 40, 10, 30, 0, 0]
    assert rounds[2].non_tensor_batch["messages"][0][2]["content"].startswith("error: ValueError")
    assert rounds[-1].batch["response_mask"][0].sum().item() == 50 + 50 + 8
    assert_same_trajectories(rounds[-1], uncut)


class Counter:
    """Answers "again <turns>" twice, then is done with reward 3; its count of turns is the state a new instance
    must be brought back to. A turn ends after "!"."""

    stop = ("!",)

    def reset(self, row):
        self.turns = 0
        return [{"role": "user", "content": row["raw_prompt"]}]

    def step(self, messages):
        self.turns += 1
        if self.turns < 3:
            return [{"role": "user", "content": f"again {self.turns}"}], None, False
        return [], float(self.turns), True


class RestoredCounter(Counter):
    """The counter with a restore hook: counts the model's turns of the conversation instead of replaying them."""

    restored: ClassVar[list[int]] = []

    def restore(self, messages):
        self.turns = sum(m["role"] == "assistant" for m in messages)
        RestoredCounter.restored.append(len(messages))

    def step(self, messages):
        assert messages[-1]["role"] == "assistant"
        return super().step(messages)


MULTI_TURN_METRICS = ("num_turns/mean", "tool_calls/mean", "tool_call_rate", "tool_error_rate", "tool_timeouts")
MULTI_TURN_METRICS += ("tool_time_s", "cut_by_max_turns", "cut_by_length", "turn_length/mean")
COUNTER_SCRIPT = {"hi": ["so long, and thanks!"] * 3}
COUNTER = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculate]", "data.max_response_length=128")
"""The config of the counter's tests (its tools unused: the loop is given its environment)."""


@pytest.mark.parametrize("environment", [Counter, RestoredCounter])
def test_a_stateful_environment_is_rebuilt_by_replaying_its_steps_or_by_its_restore_hook(tmp_path, environment):
    config = load_config(overrides=list(COUNTER))
    uncut = rollout(config, COUNTER_SCRIPT, environment).generate(prompt_rows(["hi"]))
    RestoredCounter.restored.clear()
    rounds = in_rounds(config, ["hi"], 15, tmp_path, script=COUNTER_SCRIPT, new_environment=environment)
    # three turns of 20 tokens ("so long, and thanks!": the turn ends at "!"), 15 a round: 4 rounds
    assert len(rounds) == 4 and rounds[-1].non_tensor_batch["env_reward"].tolist() == [3.0]
    assert [m["content"] for m in rounds[-1].non_tensor_batch["messages"][0][::2]] == ["hi", "again 1", "again 2"]
    assert_same_trajectories(rounds[-1], uncut)
    # rounds 2 to 4 rebuild it from the conversation up to its last answer: [hi], then [hi, turn, again 1], ...
    assert RestoredCounter.restored == ([1, 3, 5] if environment is RestoredCounter else [])


class Drifting(Counter):
    """Answers with a number that grows with every step of every instance: replaying gives other answers."""

    steps = 0

    def step(self, messages):
        Drifting.steps += 1
        return [{"role": "user", "content": f"now {Drifting.steps}"}], None, False


def test_an_environment_that_answers_differently_on_replay_is_refused_naming_the_row(tmp_path):
    config = load_config(overrides=list(COUNTER))
    with pytest.raises(ValueError, match=r"row 0: rebuilding the environment .* message 1 gave .*define restore"):
        in_rounds(config, ["hi"], 25, tmp_path, script=COUNTER_SCRIPT, new_environment=Drifting)


NUDGE = '''
from ketch.rollout.multi_turn.environment import row_messages


class Nudge:
    """Asks the model to go on twice, then is done with reward 3. A turn also ends after a digit. No restore hook:
    a carried conversation's environment is rebuilt by replaying its steps."""

    stop = tuple("0123456789")

    def reset(self, row):
        self.turns = 0
        return row_messages(row)

    def step(self, messages):
        self.turns += 1
        if self.turns < 3:
            return [{"role": "user", "content": "again"}], None, False
        return [], float(self.turns), True
'''

PARITY = """
def score(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str) % 2)
"""
"""A reward that differs between samples (the tiny model's arithmetic is always wrong), so GRPO moves the weights
and the carried tokens' log-probs change between steps."""


class Recorded:
    """Records, per step, the rows the buffer held before it (`PartialRollouts.rows`), the step's trained batch and
    the (step, epoch, data-set index, uid) of each group the loader gave (`_add`)."""

    def __init__(self, trainer):
        self.before, self.trained, self.drawn = [], [], []
        next_batch, add = trainer.partial.next_batch, trainer.partial._add

        def record(prompts, step, generate, more_prompts):
            self.before.append(trainer.partial.rows)
            batch, metrics = next_batch(prompts, step, generate, more_prompts)
            self.trained.append(batch)
            return batch, metrics

        def record_added(rows, prompts):
            c, n = prompts.non_tensor_batch, trainer.config.rollout.n
            step, epoch = len(self.before), prompts.meta_info["epoch"]
            for index, uid in zip(c["index"][::n], c["uid"][::n], strict=True):
                self.drawn.append((step, epoch, int(index), uid))
            return add(rows, prompts)

        trainer.partial.next_batch, trainer.partial._add = record, record_added


def rows_by_sample(data) -> dict[tuple[str, int], dict]:
    """Row dicts by (uid, sample of the group)."""
    uids = data.non_tensor_batch["uid"].tolist()
    return {(uid, uids[:i].count(uid)): data[i] for i, uid in enumerate(uids)}


def assert_continues(carried: dict, trained: dict) -> None:
    """`trained` (a trained row) continues `carried` (a buffer row): its tokens, which were sampled, their log-probs
    and the conversation so far are kept exactly (a turn the round cut goes on: its text grows)."""
    length = int(carried["response_length"])
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(trained[key][:length], carried[key][:length]), key
    messages = carried["messages"]
    answered = messages[:-1] if carried["turn_tokens"] else messages
    assert trained["messages"][: len(answered)] == answered
    if carried["turn_tokens"]:
        assert trained["messages"][len(answered)]["content"].startswith(messages[-1]["content"])


def test_a_multi_turn_partial_run_carries_conversations_and_a_resume_continues_them(tiny_config, tmp_path, monkeypatch):
    (tmp_path / "nudge.py").write_text(NUDGE)
    (tmp_path / "parity.py").write_text(PARITY)
    config = tiny_config(
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.environment={tmp_path / 'nudge.py'}:Nudge",
        f"reward.function={tmp_path / 'parity.py'}:score",
        f"rollout.stop_token_ids=[1,{','.join(map(str, range(21, 41)))}]",  # EOS, digits and 10 more characters
        "data.max_prompt_length=24",
        "data.max_response_length=64",
        "data.max_samples=4",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "data.train_batch_size=2",
        "actor.rollout_is=token",
        "actor.optim.lr=0.01",
        "rollout.partial.enable=true",
        "rollout.partial.round_tokens=8",
        "rollout.partial.max_staleness=7",
        "trainer.total_steps=2",
        "trainer.save_freq=1",
    )
    with monkeypatch.context() as patch:
        break_after(patch, steps=1)  # step 2 generates its batch, then fails
        first = PPOTrainer(config)
        first_log = Recorded(first)
        with pytest.raises(RunFailedError):
            first.fit()
    checkpoint = first.run_dir / "checkpoints/global_step_1" / PARTIAL_FILE
    resumed = PPOTrainer(config)
    resumed_log = Recorded(resumed)
    resumed.fit()
    n = config.rollout.n

    # step 1 left a trajectory in the middle of a turn; every trajectory it carried into step 2 is continued from
    # exactly where it was, trained at step 2 or carried on
    carried = first_log.before[1]
    assert (carried.batch["turn_tokens"] > 0).any()
    later = rows_by_sample(first_log.trained[1]) | rows_by_sample(first.partial.rows)
    for key, row in rows_by_sample(carried).items():
        assert_continues(row, later[key])
    # the checkpoint holds the buffer as it was after step 1, conversations included
    saved, kept = DataProto.load_from_disk(checkpoint), carried
    assert saved.keys() == kept.keys() and "messages" in saved.non_tensor_batch
    assert all(torch.equal(saved.batch[key], value) for key, value in kept.batch.items())
    assert saved.non_tensor_batch["messages"].tolist() == kept.non_tensor_batch["messages"].tolist()
    # the resumed run's step 2 continues the same trajectories as the failed run's step 2 did, to the same batch (which
    # trains the group begun at step 1) and the same buffer
    assert (first_log.trained[1].batch["first_step"] == 1).any()
    for again, lost in [(resumed.partial.rows, first.partial.rows), (resumed_log.trained[0], first_log.trained[1])]:
        for key, value in lost.batch.items():
            assert torch.equal(again.batch[key], value), key
        for key in ("index", "messages", "num_turns", "cut_by_length"):
            assert again.non_tensor_batch[key].tolist() == lost.non_tensor_batch[key].tolist(), key
    # the step's batch is a multi-turn batch (the `Rollout` fields, the conversation and its counts, not the buffer's
    # own columns) with the step of each trajectory's first token, and the run logs the multi-turn metrics
    assert {*ROLLOUT_FIELDS, "first_step"} <= set(again.batch)
    assert not {"prompt_length", "response_length", "turn_tokens", "finished"} & set(again.batch)
    assert set(CARRIED_COLUMNS) <= set(again.non_tensor_batch)
    logged = read_metrics(resumed.run_dir / "metrics.jsonl")
    logged_names = {k.removeprefix("multi_turn/") for k in logged[-1] if k.startswith("multi_turn/")}
    assert logged_names == set(MULTI_TURN_METRICS)
    assert logged[0]["partial/carried_unfinished"] >= 1
    # every prompt the loader gave is trained once or still in the buffer, never twice (epoch 0: indices 0 to 3)
    drawn = [d for d in first_log.drawn if d[0] == 1] + resumed_log.drawn
    trained = [b.non_tensor_batch["uid"][::n] for b in first_log.trained[:1] + resumed_log.trained]
    left = resumed.partial.rows.non_tensor_batch["uid"][::n]
    assert sorted([*np.concatenate(trained), *left]) == sorted(uid for _, _, _, uid in drawn)
    assert sorted(index for _, epoch, index, _ in drawn if epoch == 0) == [0, 1, 2, 3]


BUFFER = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculate]", "rollout.n=2")
BUFFER += ("data.train_batch_size=2", "actor.rollout_is=token", "rollout.partial.enable=true")
"""Partial rollouts of a multi-turn run, two samples a prompt (`tiny_config`: 8 response tokens, rounds of 4)."""


STARTED = {"prompt_length": 20, "response_length": 3, "turn_tokens": 3, "first_step": 1}


def test_the_staleness_bound_restarts_a_carried_conversation_from_its_prompt(tiny_config):
    buffer = PartialRollouts(tiny_config(*BUFFER), pad_token_id=0)
    prompt = torch.tensor([[9, 9]] * 2)
    prompts = DataProto.from_dict(
        {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)},
        {"uid": ["a", "b"], "raw_prompt": ["1+1="] * 2},
    )
    rows = buffer._add(None, prompts.repeat(2))
    assert rows.non_tensor_batch["messages"].tolist() == [[]] * 4 and not rows.batch["finished"].any()
    # the first sample of "a" began at step 1 and is under way: 3 tokens of its first turn
    rows.batch["responses"][0, :3] = torch.tensor([43, 44, 45])
    rows.batch["response_mask"][0, :3] = 1
    rows.batch |= {key: rows.batch[key].index_fill(0, torch.tensor([0]), value) for key, value in STARTED.items()}
    rows.non_tensor_batch["messages"][0] = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "FGH"},
    ]
    rows.non_tensor_batch["num_turns"][0] = 1.0
    kept, metrics = buffer._drop_stale(rows, step=2)  # one step old: max_staleness=1 keeps it
    assert metrics == {"partial/trajectories_dropped": 0.0, "partial/tokens_dropped": 0.0} and kept is rows
    restarted, metrics = buffer._drop_stale(rows, step=3)
    assert metrics == {"partial/trajectories_dropped": 1.0, "partial/tokens_dropped": 3.0}
    b, c = restarted.batch, restarted.non_tensor_batch
    assert b["response_length"].tolist() == [0] * 4 and b["first_step"].tolist() == [0] * 4
    assert b["turn_tokens"].tolist() == [0] * 4 and b["responses"].abs().sum() == 0 and b["response_mask"].sum() == 0
    assert c["messages"].tolist() == [[]] * 4 and c["num_turns"].tolist() == [0.0] * 4
    assert rows.non_tensor_batch["num_turns"][0] == 1.0  # the buffer's rows are never changed in place


def test_a_checkpoints_single_turn_trajectories_are_refused_by_a_multi_turn_run(tiny_config, tmp_path):
    prompt = torch.tensor([[9, 9]] * 2)
    prompts = DataProto.from_dict({"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, {"uid": ["a", "b"]})
    single = tiny_config(*BUFFER[2:])
    PartialRollouts(single, pad_token_id=0)._add(None, prompts.repeat(2)).save_to_disk(tmp_path / PARTIAL_FILE)
    with pytest.raises(ValueError, match=r"rollout.multi_turn.enable=False, which this run's multi-turn rollouts"):
        PartialRollouts(tiny_config(*BUFFER), pad_token_id=0).load(tmp_path / PARTIAL_FILE)


def test_the_doctor_line_says_a_multi_turn_round_counts_sampled_tokens(tiny_config):
    assert "rounds of up to 4 sampled tokens a trajectory (over its turns; a cut turn goes on at the next round)" in (
        describe_partial_rollouts(tiny_config(*BUFFER))
    )
