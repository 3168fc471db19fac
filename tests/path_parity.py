"""The multi-turn parity checks between the CPU's code paths (padded training forwards, transformers' `generate`)
and the GPU's (packed forwards, the static decoder), shared by tests/test_path_parity.py (float32 on the CPU)
and tests/gpu/test_path_parity_gpu.py (bfloat16 on CUDA).

The policy is a tiny model that has learned by heart, for three prompts of different lengths, a conversation
with two calls of the `calculate` tool: greedy decoding repeats it, so each trajectory's layout (the calls,
the tool's replies, the answer) is known token by token, and any path that decodes or scores a token in a
wrong context (positions, masks, a turn's prompt) changes what the model writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from recorded_grads import record_grads

from ketch.config import derive_batch_plan, load_config
from ketch.controller import LocalWorkerGroup
from ketch.data import RLHFDataset, SFTDataset, build_char_tokenizer
from ketch.data.builtin.calculator import CALL, DATA_SOURCE
from ketch.data.conversation import ChatRenderer, conversation_tokens
from ketch.models import build_tiny_model
from ketch.protocol import DataProto
from ketch.rollout.multi_turn import tool_schemas, turn_stop_strings
from ketch.trainer.validation import generation_inputs
from ketch.workers import ActorRolloutRefWorker

PROBLEMS = ((3, 4), (12, 5), (123, 45))
"""The products the policy knows: prompts of 4 to 7 characters, so that rows differ in length at every turn, and
three of them, so that the static decoder's shape buckets add a row of padding."""
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "max_positions": 512}
PROMPT_LEN, RESPONSE_LEN = 32, 256
TURN_STOP = ("</tool_call>",)

CPU_PATHS = ("model.use_remove_padding=false", "rollout.hf_decoding=generate")
"""The paths a CPU run takes by default: padded training forwards, transformers' `generate`."""
GPU_PATHS = ("model.use_remove_padding=true", "rollout.hf_decoding=static")
"""The paths a GPU run takes by default: packed training forwards, the static decoder."""


def conversation(a: int, b: int) -> list[dict[str, str]]:
    """After the prompt `a*b=`: a call for a*b, the tool's reply, a call adding 1 to it, the reply, the answer."""
    product = a * b
    return [
        {"role": "assistant", "content": CALL.format(f"{a}*{b}")},
        {"role": "tool", "name": "calculate", "content": str(product)},
        {"role": "assistant", "content": CALL.format(f"{product}+1")},
        {"role": "tool", "name": "calculate", "content": str(product + 1)},
        {"role": "assistant", "content": f"#### {product + 1}"},
    ]


def demonstrations() -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, response ids, response loss mask) of each problem's conversation, as the turn loop holds it:
    the mask is 1 on the model's turns (each call without EOS, the answer with it), 0 on the tool's replies."""
    tokenizer = build_char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    out = []
    for a, b in PROBLEMS:
        prompt = renderer.prompt_ids([{"role": "user", "content": f"{a}*{b}="}], None)
        ids, mask = conversation_tokens(renderer, conversation(a, b), tokenizer.eos_token_id, TURN_STOP)
        out.append((prompt, ids, mask))
    return out


def write_rows(path: Path) -> Path:
    """A Parquet file of the problems: `prompt`, `response` (the conversation), `answer`, `data_source`."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "response": conversation(a, b),
            "answer": str(a * b + 1),
            "data_source": DATA_SOURCE,
        }
        for a, b in PROBLEMS
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def save_tool_policy(path: Path, steps: int = 150) -> Path:
    """The tiny model trained (float32, on the CPU, seeded) on the conversations until greedy decoding repeats them
    with a margin of about 5 nats per token; saved with the character tokenizer as a Hugging Face directory."""
    tokenizer = build_char_tokenizer()
    sequences = [prompt + ids for prompt, ids, _ in demonstrations()]
    width = max(map(len, sequences))
    input_ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences])
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in sequences])
    model = build_tiny_model(tokenizer, seed=0, **SIZES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    for _ in range(steps):
        model(input_ids=input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def tool_config(model_dir: Path, rows: Path, out: Path, *overrides: str):
    """The tool example's multi-turn settings (calculate, 3 turns, 96 tokens a turn, temperature 0.7) on the policy."""
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"data.train_files=[{rows}]",
            f"data.val_files=[{rows}]",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            f"data.train_batch_size={len(PROBLEMS)}",
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.tools=[calculate]",
            "rollout.multi_turn.max_turns=3",
            "rollout.multi_turn.max_tokens_per_turn=96",
            "rollout.temperature=0.7",
            "rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "actor.ppo_mini_batch_size=null",
            "actor.optim.lr=1e-12",  # the tests' updates record gradients and leave the weights as they are
            "trainer.seed=0",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={out}",
            *overrides,
        ]
    )


def worker_group(config) -> LocalWorkerGroup:
    """The actor and its hf rollout, in this process."""
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, config.model.path, derive_batch_plan(config), 10)
    group.init_model()
    return group


def prompts(config, repeat: int = 1, do_sample: bool = False) -> DataProto:
    """The problems' prompts (each `repeat` times in a row) as `generate_sequences` takes them."""
    dataset = RLHFDataset(config.data.train_files, build_char_tokenizer(), config.data)
    batch = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(len(dataset))]))
    out = generation_inputs(batch.repeat(repeat, interleave=True))
    out.meta_info = {"do_sample": do_sample, "temperature": config.rollout.temperature if do_sample else 1.0}
    return out


def expected_layout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy trajectories' `responses` (pad 0 after them), `response_mask` and the response part of the
    `attention_mask` `[problems, RESPONSE_LEN]`: the demonstrations right-padded."""
    demos = demonstrations()
    responses = torch.zeros(len(demos), RESPONSE_LEN, dtype=torch.long)
    response_mask, real = torch.zeros_like(responses), torch.zeros_like(responses)
    for i, (_, ids, mask) in enumerate(demos):
        responses[i, : len(ids)] = torch.tensor(ids)
        response_mask[i, : len(ids)] = torch.tensor(mask)
        real[i, : len(ids)] = 1
    return responses, response_mask, real


def for_update(data: DataProto, old_log_prob: torch.Tensor | None = None) -> DataProto:
    """`data` with seeded advantages `[batch, response_len]` and pi_old (default: the rollout's log-probs, as the
    tool example takes it): a GRPO batch."""
    g = torch.Generator().manual_seed(2)
    b = data.batch
    advantages = torch.randn(b["responses"].shape[0], 1, generator=g).expand_as(b["response_mask"])
    old_log_prob = b["rollout_log_probs"] if old_log_prob is None else old_log_prob
    return DataProto.from_dict(
        {key: b[key] for key in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
        | {"advantages": advantages * b["response_mask"], "old_log_prob": old_log_prob}
    )


def update_gradients(group: LocalWorkerGroup, data: DataProto) -> dict[str, torch.Tensor]:
    """The gradients (float32, on the CPU, by parameter name) of one PPO update of the actor on `data`."""
    grads = record_grads(group.worker.actor)
    group.update_actor(data)
    return {name: grad.float().cpu() for name, grad in grads.items()}


def sft_batch(config) -> DataProto:
    """The conversations as SFT rows (the loss on the model's turns), as the tool example's warm-up builds them."""
    tokenizer = build_char_tokenizer()
    stop, tools = turn_stop_strings(config, tokenizer), tool_schemas(config)
    dataset = SFTDataset(config.data.train_files, tokenizer, config.data, turn_stop=stop, tools=tools)
    return DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(len(dataset))]))


def sft_gradients(group: LocalWorkerGroup, data: DataProto) -> tuple[float, dict[str, torch.Tensor]]:
    """`sft/loss` and the gradients (float32, on the CPU) of one SFT step on `data`."""
    grads = record_grads(group.worker.actor)
    loss = group.sft_step(data).meta_info["metrics"]["sft/loss"]
    return float(loss), {name: grad.float().cpu() for name, grad in grads.items()}


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The cosine similarity of two gradients, all parameters flattened into one vector."""
    x, y = (torch.cat([g[name].flatten() for name in sorted(a)]) for g in (a, b))
    return torch.nn.functional.cosine_similarity(x, y, dim=0).item()


def answers(data: DataProto) -> list[str]:
    """Each trajectory's last message (the answer)."""
    return [messages[-1]["content"] for messages in data.non_tensor_batch["messages"]]


def tool_calls(data: DataProto) -> np.ndarray:
    return data.non_tensor_batch["tool_calls"]
