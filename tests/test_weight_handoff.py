"""The weight hand-off from FSDP2 shards to the hf rollout (`TrainEngine.full_parameters`, one all-gather per FSDP
unit) on two CPU processes over gloo (one process: tests/test_rollout.py), with tied and untied embeddings, in
float32 and in bfloat16 mixed precision: the rollout's weights afterwards are the training model's full weights
exactly."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp
from spawned import end_rank

from ketch.config import load_config
from ketch.data import build_char_tokenizer
from ketch.engine.distributed import free_port
from ketch.engine.engine import TrainEngine
from ketch.engine.heads import PolicyModel
from ketch.models import load_causal_lm, save_tiny_model
from ketch.rollout.hf import HFRollout

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "max_positions": 64}


def _hand_off(rank: int, world: int, port: int, model_dirs: dict[bool, str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    tokenizer = build_char_tokenizer()
    for (tied, path), dtype in [(item, d) for item in model_dirs.items() for d in (torch.float32, torch.bfloat16)]:
        config = load_config(overrides=[f"model.path={path}", "trainer.device=cpu", "rollout.hf_decoding=generate"])
        cpu = torch.device("cpu")
        mixed = dtype if dtype != torch.float32 else None
        engine = TrainEngine(PolicyModel(load_causal_lm(path, torch.float32)), cpu, param_dtype=mixed)
        generator = torch.Generator().manual_seed(rank)
        for param in engine.module.parameters():  # every shard moves: the rollout's copy from disk goes stale
            local = param.to_local()
            local.add_(torch.randn(local.shape, generator=generator))
        master = {name: p.full_tensor() for name, p in engine.module.named_parameters(remove_duplicate=False)}
        truth = {name: tensor.to(dtype) for name, tensor in master.items()}
        rollout = HFRollout(config, path, tokenizer, dtype, cpu, seed=0)
        rollout.update_weights(engine.full_parameters(prefix="lm.", dtype=dtype))
        got = dict(rollout.model.named_parameters(remove_duplicate=False))
        assert set(got) == {name.removeprefix("lm.") for name in truth}, (tied, dtype)
        assert ("lm_head.weight" in got) and (got["lm_head.weight"] is got["model.embed_tokens.weight"]) == tied
        for name, tensor in truth.items():
            assert got[name.removeprefix("lm.")].dtype == dtype
            assert torch.equal(got[name.removeprefix("lm.")], tensor), (name, tied, dtype)
        # the engine's shards are untouched: its float32 master weights still come out whole
        for name, tensor in engine.full_parameters():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, master[name]), name
    end_rank()


def test_hand_off_gives_the_rollout_the_full_weights_exactly(tmp_path):
    tokenizer = build_char_tokenizer()
    dirs = {}
    for tied in (True, False):
        path = save_tiny_model(tmp_path / f"tied-{tied}", tokenizer, **SIZES)
        if not tied:  # an untied copy: its own output projection
            model = load_causal_lm(str(path), torch.float32)
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.5)
            model.save_pretrained(path)
        dirs[tied] = str(path)
    mp.start_processes(_hand_off, args=(2, free_port(), dirs), nprocs=2, start_method="spawn")
