"""Ulysses sequence parallelism (`actor.ulysses_sequence_parallel_size`) on 2 and 4 CPU processes over gloo: the
packed row of each micro-batch split over the ranks, attention over all tokens with a share of the heads, gives the
loss, log-probs, entropy and gradients of one rank; and the sizes that do not divide are refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from recorded_grads import record_grads
from spawned import end_rank
from transformers import Qwen2Config

from ketch.algorithms import policy_loss
from ketch.config import ConfigError, load_config
from ketch.config.parallel import sequence_parallel_problem
from ketch.config.schema import OptimConfig
from ketch.data import build_char_tokenizer
from ketch.engine.distributed import free_port, init_process_group
from ketch.engine.engine import TrainEngine
from ketch.engine.heads import PolicyModel, ValueModel
from ketch.engine.micro import split_micro_batches
from ketch.models import load_causal_lm, load_critic, save_tiny_model
from ketch.protocol import DataProto
from ketch.workers.common import role_dispatch_rank

CPU = torch.device("cpu")
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4}
"""8 query heads sharing 4 key/value heads: 4 and 2 (or 2 and 1) per rank of 2 (or 4)."""


def _batch() -> DataProto:
    """8 rows of 5 prompt tokens (two with left padding) and responses of 1 to 6 tokens: 69 real tokens, a packed
    row that 2 and 4 do not divide."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 100, (8, 11), generator=g)
    response_mask = (torch.arange(6) < torch.tensor([1, 6, 3, 6, 2, 5, 4, 6])[:, None]).long()
    prompt_mask = torch.ones(8, 5, dtype=torch.long)
    prompt_mask[2, :2] = prompt_mask[5, :1] = 0
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return DataProto.from_dict(
        {
            "input_ids": input_ids * attention_mask,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, 5:] * response_mask,
            "response_mask": response_mask,
            "old_log_prob": -torch.rand(8, 6, generator=g) * 3,
            "advantages": torch.randn(8, 6, generator=g),
        }
    )


def _loss(out, micro, num_tokens, num_seqs):
    """The PPO loss with an entropy bonus, and the log-probs and entropy summed as metrics."""
    b = micro.batch
    mask = b["response_mask"]
    loss, _ = policy_loss(b["old_log_prob"], out["log_prob"], b["advantages"], mask, num_tokens=num_tokens)
    loss = loss - 0.1 * (out["entropy"] * mask).sum() / num_tokens
    sums = {"log_prob": (out["log_prob"] * mask).sum().detach(), "entropy": (out["entropy"] * mask).sum().detach()}
    return loss, {k: v / num_tokens for k, v in sums.items()}


def _step(model_dir: str, sequence_parallel: int) -> dict:
    """One update of two micro-batches, its metrics and gradients; and a value model's values (masked)."""
    policy = PolicyModel(load_causal_lm(model_dir, torch.float32, "sdpa"), packed=True)
    engine = TrainEngine(
        policy, CPU, OptimConfig(lr=0.0, grad_clip=0.0), total_steps=1, sequence_parallel=sequence_parallel
    )
    grads = record_grads(engine)
    metrics = engine.train_mini_batch(split_micro_batches(_batch(), 4), _loss, calc_entropy=True)
    torch.manual_seed(0)  # the value head's initial weights
    critic = ValueModel(load_critic(model_dir, torch.float32, "sdpa"), packed=True)
    values = TrainEngine(critic, CPU, sequence_parallel=sequence_parallel).infer(_batch(), 4)["values"]
    return {"metrics": metrics, "grads": grads, "values": values * _batch().batch["response_mask"]}


def _sequence_parallel_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    init_process_group(CPU)
    result = _step(model_dir, sequence_parallel=world)
    if rank == 0:
        torch.save(result, out)
    end_rank()


@pytest.mark.parametrize("ranks", [2, 4])
def test_sequence_parallel_ranks_give_the_loss_and_gradients_of_one_rank(tmp_path, ranks):
    model_dir = str(save_tiny_model(tmp_path / "model", build_char_tokenizer(), **SIZES))
    out = tmp_path / "result.pt"
    mp.start_processes(
        _sequence_parallel_rank, args=(ranks, free_port(), model_dir, str(out)), nprocs=ranks, start_method="spawn"
    )
    init_process_group(CPU)
    one = _step(model_dir, sequence_parallel=1)
    parallel = torch.load(out)
    for key in ("loss", "log_prob", "entropy"):
        assert parallel["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-6), key
    assert len(parallel["grads"]) == len(one["grads"]) > 0
    for name, grad in one["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(parallel["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert one["values"].abs().sum() > 0
    torch.testing.assert_close(parallel["values"], one["values"], atol=1e-6, rtol=1e-5)


def test_sequence_parallel_ranks_share_a_data_parallel_rank_and_the_batch_sizes_count_those():
    config = load_config(
        overrides=[
            "trainer.device=cpu",
            "trainer.n_cpu_workers=4",
            "model.use_remove_padding=true",
            "actor.ulysses_sequence_parallel_size=2",
        ]
    )
    assert config.world_size(gpu_visible=False) == 2
    ranks = [role_dispatch_rank(r, 4, config.actor, 2) for r in range(4)]
    assert ranks == [(0, True), (0, False), (1, True), (1, False)]


def test_sizes_that_do_not_divide_the_processes_or_heads_or_run_padded_are_refused():
    base = ["trainer.device=cpu", "trainer.n_cpu_workers=4", "model.use_remove_padding=true"]
    with pytest.raises(ConfigError, match=r"actor.ulysses_sequence_parallel_size=3 does not divide the 4 worker "):
        load_config(overrides=[*base, "actor.ulysses_sequence_parallel_size=3"])
    with pytest.raises(ConfigError, match=r"the packed row of a micro-batch: set model.use_remove_padding=true"):
        load_config(overrides=[*base[:2], "actor.ulysses_sequence_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=0 must be"):
        load_config(overrides=[*base, "actor.ulysses_sequence_parallel_size=0"])
    model = Qwen2Config(num_attention_heads=12, num_key_value_heads=2, hidden_size=48)
    assert sequence_parallel_problem(2, model) is None
    assert sequence_parallel_problem(4, model) == (
        "actor.ulysses_sequence_parallel_size=4 must divide the model's attention heads (12) and key/value heads (2); "
        "pick a common divisor"
    )
