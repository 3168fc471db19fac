"""The turn loop with a scripted policy: exact tokens, masks and log-probs of trajectories with tool calls."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ketch.algorithms import get_policy_loss
from ketch.config import load_config
from ketch.data import DatasetError, RLHFDataset, SFTDataset, build_char_tokenizer
from ketch.data.builtin.calculator import CALL, builtin_calculator_files, demonstration
from ketch.data.chat_templates import CHAT_TEMPLATES
from ketch.protocol import DataProto, object_array
from ketch.rewards import RewardScorer
from ketch.rollout.base import Rollout, rollout_output
from ketch.rollout.multi_turn import MultiTurnRollout, environment_factory, tool_schemas, turn_stop_strings

SCRIPT = {
    "3*4=": [CALL.format("3*4"), CALL.format("12+1"), "#### 13"],  # two tool calls, then the answer
    "2+5=": ["#### 7"],  # no call
}
LOG_PROB = -0.5


class ScriptedPolicy(Rollout):
    """Answers turn k of a prompt with script[prompt][k] and EOS, every token with log-prob LOG_PROB."""

    def __init__(self, tokenizer, max_response_length: int, script: dict[str, list[str]] = SCRIPT):
        self.tokenizer, self.max_response_length, self.script = tokenizer, max_response_length, script
        self.calls: list[int] = []

    def generate(self, prompts: DataProto) -> DataProto:
        self.calls.append(len(prompts))
        rows = []
        for ids, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"].bool(), strict=True):
            context = self.tokenizer.decode(ids[mask].tolist())
            question = next(line for line in context.split("\n") if line.startswith("user: ")).removeprefix("user: ")
            turn = self.script[question][context.count("assistant: ") - 1]
            rows.append(self.tokenizer(turn)["input_ids"] + [self.tokenizer.eos_token_id])
        responses = torch.zeros(len(rows), self.max_response_length, dtype=torch.long)
        for i, row in enumerate(rows):
            responses[i, : len(row)] = torch.tensor(row)
        log_probs = torch.full(responses.shape, LOG_PROB)
        return rollout_output(prompts, responses, log_probs, [self.tokenizer.eos_token_id], 0)

    def update_weights(self, named_tensors) -> None: ...

    def weight_norm(self, name: str) -> float:
        return 0.0


def run(
    prompts: list, *overrides: str, script: dict[str, list[str]] = SCRIPT, tokenizer=None, **columns: list
) -> tuple[DataProto, ScriptedPolicy]:
    """The turn loop over `prompts` (other non-tensor columns in `columns`) with the scripted policy."""
    config = load_config(
        overrides=[
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.tools=[calculate]",
            "data.max_prompt_length=32",
            "data.max_response_length=240",
            *overrides,
        ]
    )
    tokenizer = tokenizer or build_char_tokenizer()
    policy = ScriptedPolicy(tokenizer, config.data.max_response_length, script)
    rollout = MultiTurnRollout(policy, config, tokenizer, environment_factory(config, tokenizer))
    raw = object_array(prompts)
    dummy = torch.zeros(len(prompts), 1, dtype=torch.long)  # the loop renders the prompts itself
    non_tensors = {"raw_prompt": raw} | {key: object_array(values) for key, values in columns.items()}
    batch = DataProto.from_dict({"input_ids": dummy}, non_tensors, {"temperature": 1.0})
    return rollout.generate(batch), policy


def test_two_tool_calls_mask_exactly_the_sampled_tokens():
    out, policy = run(["3*4=", "2+5="])
    b, c = out.batch, out.non_tensor_batch
    # Prompt "user: 3*4=\nassistant: " is 22 characters = 22 tokens, left-padded to 32.
    assert b["prompts"].shape == (2, 32) and b["attention_mask"][0, :32].sum() == 22
    # Turn 1: the call (80 characters; the turn ends at "</tool_call>", the policy's EOS after it is cut);
    # glue "\ntool: 12\nassistant: " = 21; turn 2: the call with "12+1" (81); glue "\ntool: 13\nassistant: "
    # = 21; "#### 13" + EOS = 8.
    expected_mask = [1] * 80 + [0] * 21 + [1] * 81 + [0] * 21 + [1] * 8 + [0] * (240 - 211)
    assert b["response_mask"][0].tolist() == expected_mask
    assert b["attention_mask"][0, 32:].tolist() == [1] * 211 + [0] * 29
    tokenizer = build_char_tokenizer()
    glue = tokenizer.decode(b["responses"][0, 80:101].tolist())
    assert glue == "\ntool: 12\nassistant: "
    assert b["rollout_log_probs"][0].sum().item() == pytest.approx(LOG_PROB * (80 + 81 + 8))
    assert (b["rollout_log_probs"][0][b["response_mask"][0] == 0] == 0).all()
    # The row without a call ends after its one turn: "#### 7" + EOS.
    assert b["response_mask"][1].tolist() == [1] * 7 + [0] * 233
    # Rows progress independently: turn 1 for both, turns 2 and 3 for the first row alone.
    assert policy.calls == [2, 1, 1]
    assert c["num_turns"].tolist() == [3, 1] and c["tool_calls"].tolist() == [2, 0]
    assert [m["role"] for m in c["messages"][0]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert c["messages"][0][4]["content"] == "13"


def test_a_tool_result_changes_no_gradient():
    out, _ = run(["3*4="])
    b = out.batch
    log_prob = b["rollout_log_probs"].clone().requires_grad_()
    advantages = torch.ones(b["response_mask"].shape)
    loss, _ = get_policy_loss("vanilla")(
        b["rollout_log_probs"], log_prob, advantages, b["response_mask"], loss_agg_mode="token-mean"
    )
    loss.backward()
    # On-policy (ratio 1), the token-mean of -ratio * advantage over the 169 sampled tokens: -1/169 on each,
    # 0 on the 42 tool-result and glue tokens and on the padding.
    grad, mask = log_prob.grad[0], b["response_mask"][0]
    assert grad[mask == 0].abs().max().item() == 0.0
    torch.testing.assert_close(grad[mask == 1], torch.full((169,), -1 / 169))


def test_max_turns_and_the_length_budget_cut_trajectories():
    out, _ = run(["3*4="], "rollout.multi_turn.max_turns=2")
    assert out.batch["response_mask"][0].sum().item() == 80 + 81
    assert out.batch["attention_mask"][0, 32:].sum().item() == 80 + 21 + 81
    assert out.non_tensor_batch["cut_by_max_turns"].tolist() == [1.0]
    out, _ = run(["3*4="], "data.max_response_length=100")
    # 80 sampled, then the 21-token glue is cut to the 20 tokens left.
    assert out.batch["response_mask"][0].tolist() == [1] * 80 + [0] * 20
    assert out.non_tensor_batch["cut_by_length"].tolist() == [1.0]
    assert out.non_tensor_batch["num_turns"].tolist() == [1]


def test_a_turn_stops_at_its_token_budget():
    out, _ = run(["3*4=", "2+5="], "rollout.multi_turn.max_tokens_per_turn=50", "data.max_response_length=600")
    b, c = out.batch, out.non_tensor_batch
    # Each call is cut after 50 of its 80 characters: an unclosed call, answered with an error; the answer
    # "#### 13" and EOS (8 tokens) fit. Sampled: 50 + 50 + 8.
    assert b["response_mask"][0, :51].tolist() == [1] * 50 + [0]
    assert b["response_mask"][0].sum().item() == 108
    assert c["messages"][0][1]["content"] == CALL.format("3*4")[:50]
    assert c["messages"][0][2]["content"].startswith("error: ValueError: the tool call is not valid JSON")
    assert c["num_turns"].tolist() == [3, 1] and c["tool_errors"].tolist() == [2, 0]
    assert b["response_mask"][1].tolist() == [1] * 7 + [0] * 593  # "#### 7" and EOS


def test_the_calculator_demonstrations_are_the_tokens_of_a_rollout():
    """The SFT warm-up teaches exactly the token layout the turn loop produces (the call, EOS, the glue with
    the tool's reply, the answer, EOS) with the loss where the rollout's response_mask is: never on the glue."""
    config = load_config(overrides=["data.max_prompt_length=32", "data.max_response_length=128"])
    val = builtin_calculator_files()["val"]
    demo = SFTDataset(str(val), build_char_tokenizer(), config.data, turn_stop=("</tool_call>",))[0]
    row = RLHFDataset(str(val), build_char_tokenizer(), config.data)[0]
    question = row["raw_prompt"][0]["content"]
    expression, answer = question.removesuffix("="), row["ground_truth"]
    script = {question: [CALL.format(expression), f"#### {answer}"]}
    out, _ = run([row["raw_prompt"]], "data.max_response_length=128", script=script)
    b = out.batch
    prompt_ids = b["prompts"][0][b["attention_mask"][0, :32].bool()].tolist()
    response_ids = b["responses"][0][b["attention_mask"][0, 32:].bool()].tolist()
    assert prompt_ids + response_ids == demo["input_ids"].tolist()
    response_mask = b["response_mask"][0][: len(response_ids)].tolist()
    assert demo["loss_mask"].tolist() == [0] * len(prompt_ids) + response_mask
    # The call (77 characters and the expression; no EOS: the turn ends at "</tool_call>"), the glue, the
    # answer and EOS.
    glue = len(f"\ntool: {answer}\nassistant: ")
    assert response_mask == [1] * (77 + len(expression)) + [0] * glue + [1] * (len(f"#### {answer}") + 1)


TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
    + CHAT_TEMPLATES["plain"]
)
"""The built-in `plain` template with a first line naming the tools it is given."""


def test_sft_renders_the_prompt_with_the_tools_its_row_allows_as_the_rollout_does(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    loaded = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculate,python]"]
    loaded += ["data.max_prompt_length=48", "data.max_response_length=128"]
    config = load_config(overrides=loaded)
    prompt = [{"role": "user", "content": "3*4="}]
    rows = [{"prompt": prompt, "response": demonstration(3, 4), "tools": ["calculate"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "demo.parquet")
    demo_format = {"turn_stop": turn_stop_strings(config, tokenizer), "tools": tool_schemas(config)}
    demo = SFTDataset(str(tmp_path / "demo.parquet"), tokenizer, config.data, **demo_format)[0]
    script = {"3*4=": [CALL.format("3*4"), "#### 12"]}
    out, _ = run([prompt], *loaded, script=script, tokenizer=tokenizer, tools=[["calculate"]])
    b = out.batch
    prompt_ids = b["prompts"][0][b["attention_mask"][0, :48].bool()].tolist()
    assert tokenizer.decode(prompt_ids) == "tools: calculate\nuser: 3*4=\nassistant: "
    response_ids = b["responses"][0][b["attention_mask"][0, 48:].bool()].tolist()
    assert demo["input_ids"].tolist() == prompt_ids + response_ids
    rows[0]["tools"] = ["search"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "demo.parquet")
    with pytest.raises(DatasetError, match=r"demo.parquet, row 0: the row allows tools \['search'\] that are not"):
        SFTDataset(str(tmp_path / "demo.parquet"), tokenizer, config.data, **demo_format)


REWARD = """
def score(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(solution_str.endswith("#### 13")), "saw_tool": float("tool: 12" in solution_str),
            "messages": float(len(extra_info["messages"])), "tool_calls": extra_info["tool_calls"],
            "tool_errors": extra_info["tool_errors"]}
"""


def test_the_reward_function_sees_the_whole_trajectory(tmp_path):
    out, _ = run(["3*4=", "2+5="])
    out.non_tensor_batch |= {"data_source": object_array(["x", "x"]), "ground_truth": object_array(["13", "7"])}
    (tmp_path / "reward.py").write_text(REWARD)
    scores, info = RewardScorer(build_char_tokenizer(), f"{tmp_path / 'reward.py'}:score")(out)
    assert info["scores"].tolist() == [1.0, 0.0]
    assert info["extra"]["saw_tool"].tolist() == [1.0, 0.0] and info["extra"]["messages"].tolist() == [6.0, 2.0]
    assert info["extra"]["tool_calls"].tolist() == [2.0, 0.0] and info["extra"]["tool_errors"].tolist() == [0.0, 0.0]
    # The score sits on the last sampled token: the EOS after "#### 13", position 210 of the response.
    assert scores[0].nonzero().flatten().tolist() == [210]
