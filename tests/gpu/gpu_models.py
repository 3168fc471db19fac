"""Small random decoders on the GPU for the tests of this folder."""

from __future__ import annotations

import torch


def tiny_decoder(family: str = "qwen2") -> torch.nn.Module:
    """A random 2-layer Qwen2 (or Qwen3, its head norms drawn) on the GPU in float32, head size 64 (the decode
    kernel's), vocabulary of 512."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    sizes = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    sizes |= {"num_attention_heads": 4, "num_key_value_heads": 2, "attn_implementation": "sdpa"}
    torch.manual_seed(0)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**sizes)).cuda().eval()
    model = Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=64))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                weight.uniform_(0.5, 1.5)
    return model.cuda().eval()


def two_grpo_steps(config) -> tuple[list[dict], tuple[bool, bool]]:
    """Two GRPO steps of a `PPOTrainer` on `config`: each step's metrics, and whether the actor trained packed and
    the rollout decoded with the static decoder."""
    from ketch.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(config)
    trainer._open()
    steps = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    worker = trainer.actor_rollout.worker
    paths = (worker.actor.module.packed, worker.rollout.decoder is not None)
    trainer.groups.shutdown()
    return steps, paths
