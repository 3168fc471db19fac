"""Tensor-parallel hf rollout (`rollout.tensor_parallel_size=2`) on two CPU processes over gloo, on a tiny
Qwen2-shaped model with grouped-query attention (4 query heads, 2 key/value heads): each rank decodes its own
prompts together with its peer, and gets the tokens and log-probs of a whole (TP=1) model, greedy and sampled,
through `generate` and the static decoder, before and after a weight hand-off."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from spawned import end_rank
from transformers import Qwen2Config

from ketch.config import ConfigError, load_config
from ketch.data import build_char_tokenizer
from ketch.engine.distributed import free_port
from ketch.models import save_tiny_model
from ketch.protocol import DataProto
from ketch.rollout.hf import HFRollout
from ketch.rollout.tensor_parallel import check_shardable, same_random_numbers
from ketch.trainer.ppo import PPOTrainer

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
LOG_PROB_ATOL = 1e-5
"""float32: the split matmuls and the all-reduce add up in another order than the whole model's."""


def _prompts(rank: int) -> DataProto:
    """Three left-padded prompts per rank, different on each rank (one of rank 1's is shorter)."""
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(3, 30, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, : 2 + rank] = 0
    return DataProto.from_dict({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask})


def _decode_both(rank: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    for decoding in ("generate", "static"):
        _compare(rank, path, decoding)
    end_rank()


def _compare(rank: int, path: str, decoding: str) -> None:
    base = [
        f"model.path={path}",
        "trainer.device=cpu",
        "trainer.n_cpu_workers=2",
        "data.max_response_length=10",
        f"rollout.hf_decoding={decoding}",
    ]
    rollouts = {
        tp: HFRollout(
            load_config(overrides=[*base, f"rollout.tensor_parallel_size={tp}"]),
            path,
            build_char_tokenizer(),
            torch.float32,
            torch.device("cpu"),
            seed=0,
        )
        for tp in (1, 2)
    }
    shard = rollouts[2].model.model.layers[0]
    assert shard.self_attn.q_proj.weight.shape == (2 * 8, 32) and shard.self_attn.k_proj.weight.shape == (8, 32)
    assert shard.mlp.down_proj.weight.shape == (32, 32)
    assert torch.equal(
        shard.self_attn.k_proj.weight,
        rollouts[1].model.model.layers[0].self_attn.k_proj.weight[8 * rank : 8 * rank + 8],
    )
    for hand_off in (False, True):
        if hand_off:  # new full weights (another random model), each TP rank copies its shard
            g = torch.Generator().manual_seed(1)
            fresh = {id(p): torch.randn(p.shape, generator=g) * 0.2 for p in rollouts[1].model.parameters()}
            new = {n: fresh[id(p)] for n, p in rollouts[1].model.named_parameters(remove_duplicate=False)}
            for rollout in rollouts.values():
                rollout.update_weights(new.items())
        greedy = _prompts(rank)
        greedy.meta_info["do_sample"] = False
        out = {tp: r.generate(greedy).batch for tp, r in rollouts.items()}
        assert torch.equal(out[2]["responses"], out[1]["responses"]), (rank, hand_off)
        assert torch.equal(out[2]["response_mask"], out[1]["response_mask"])
        torch.testing.assert_close(out[2]["rollout_log_probs"], out[1]["rollout_log_probs"], atol=LOG_PROB_ATOL, rtol=0)
        # sampling: the group's ranks draw the same numbers, so TP=2 samples what TP=1 samples with that seed
        sampled = _prompts(rank)
        state = torch.get_rng_state()  # generate below draws the same group seed again
        together, rows, seed = rollouts[2].tp.group_prompts(sampled, 0)
        with same_random_numbers(seed, torch.device("cpu")):
            whole = rollouts[1]._decode(together)
        torch.set_rng_state(state)
        tp2 = rollouts[2].generate(sampled).batch
        assert torch.equal(tp2["responses"] * tp2["response_mask"], whole[0][rows] * tp2["response_mask"])
        torch.testing.assert_close(
            tp2["rollout_log_probs"], whole[1][rows] * tp2["response_mask"], atol=LOG_PROB_ATOL, rtol=0
        )


def test_tp2_decodes_like_one_whole_model(tmp_path):
    path = save_tiny_model(tmp_path / "gqa", build_char_tokenizer(), **SIZES)
    mp.start_processes(_decode_both, args=(free_port(), str(path)), nprocs=2, start_method="spawn")


def test_sizes_that_do_not_divide_the_heads_or_processes_are_refused(tiny_model_dir, tiny_config):
    config = Qwen2Config(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, intermediate_size=64)
    with pytest.raises(
        ConfigError, match=r"rollout.tensor_parallel_size=4 does not divide the model's num_attention_heads=6"
    ) as err:
        check_shardable(config, 4)
    assert "num_key_value_heads=2" in str(err.value) and "intermediate_size" not in str(err.value)
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=3 does not divide the 2 worker processes"):
        load_config(
            overrides=[
                f"model.path={tiny_model_dir}",
                "trainer.device=cpu",
                "trainer.n_cpu_workers=2",
                "rollout.tensor_parallel_size=3",
            ]
        )
    with pytest.raises(ConfigError, match=r"set it to 1 for rollout.multi_turn.enable=true"):
        load_config(
            overrides=[
                f"model.path={tiny_model_dir}",
                "trainer.device=cpu",
                "trainer.n_cpu_workers=2",
                "rollout.tensor_parallel_size=2",
                "rollout.multi_turn.enable=true",
            ]
        )
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the model's num_key_value_heads=2"):
        PPOTrainer(tiny_config("trainer.n_cpu_workers=4", "rollout.tensor_parallel_size=4"))  # before any worker
