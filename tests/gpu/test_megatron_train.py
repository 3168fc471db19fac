"""`ketch train` with `actor.strategy=megatron` over two GPUs (Ray; TP=2, or two data-parallel ranks with the
distributed optimizer): GRPO steps run, the metrics are finite, the checkpoint and the HF export are written, and
the export loads in transformers with trained weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'ketch[megatron]')")
pytest.importorskip("ray", reason="ray is not installed")


@pytest.mark.gpus(2)
@pytest.mark.parametrize(
    "grid",
    [
        ["actor.megatron.tensor_model_parallel_size=2"],
        ["actor.megatron.use_distributed_optimizer=true"],  # two data-parallel ranks, AdamW split between them
    ],
    ids=["tp2", "dp2-distributed-optimizer"],
)
def test_grpo_with_a_megatron_actor_trains_and_exports(tiny_model_dir, task_files, tmp_path, grid):
    import ray
    from transformers import AutoModelForCausalLM

    from ketch.config import load_config
    from ketch.trainer.ppo import PPOTrainer

    # the random tiny model never solves the task: reward the response length instead, so advantages vary
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n    return len(solution_str) % 3\n"
    )
    config = load_config(
        overrides=[
            f"reward.function={reward}:score",
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{task_files['train']}]",
            "data.val_files=[]",
            "data.train_batch_size=8",
            "data.max_response_length=8",
            "rollout.n=2",
            "rollout.hf_decoding=generate",
            "algorithm.adv_estimator=grpo",
            "actor.strategy=megatron",
            *grid,
            "actor.ppo_micro_batch_size_per_device=4",
            "trainer.total_steps=3",
            "trainer.val_before_train=false",
            "trainer.test_freq=0",
            "trainer.logger=[jsonl]",
            "trainer.device=cuda",
            "trainer.n_gpus_per_node=2",
            f"trainer.default_local_dir={tmp_path / 'runs'}",
        ]
    )
    try:
        PPOTrainer(config).fit()
    finally:
        ray.shutdown()
    run = tmp_path / "runs" / config.trainer.experiment_name
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert len(steps) == 3
    assert all(math.isfinite(s["actor/pg_loss"]) and math.isfinite(s["actor/grad_norm"]) for s in steps)
    assert sorted(p.name for p in (run / "checkpoints" / "global_step_3" / "actor").glob("megatron_rank*.pt")) == [
        "megatron_rank0.pt",
        "megatron_rank1.pt",
    ]
    exported = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert exported.keys() == initial.keys()
    changed = [k for k in initial if not torch.equal(exported[k], initial[k])]
    assert len(changed) == len(initial)  # every weight was trained (2e-4 lr, 3 steps)
