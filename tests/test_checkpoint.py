"""Checkpoints: exact resume, no prompt skipped or repeated, atomic writes, rotation, export."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from ketch.cli import main
from ketch.protocol import DataProto
from ketch.tracking import read_metrics
from ketch.trainer.checkpoint import CheckpointManager
from ketch.trainer.loop import RunFailedError
from ketch.trainer.ppo import PPOTrainer
from ketch.workers import ActorRolloutRefWorker

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "critic/vf_loss", "response_length/mean")


class PromptLog:
    """Wraps a trainer's loader to record the prompt indices of every step."""

    def __init__(self, trainer: PPOTrainer):
        self.indices: list[list[int]] = []
        next_batch = trainer.loader.next_batch

        def record() -> DataProto:
            batch = next_batch()
            self.indices.append([int(i) for i in batch.non_tensor_batch["index"]])
            return batch

        trainer.loader.next_batch = record


def break_after(monkeypatch, steps: int) -> None:
    """Make update_actor raise after `steps` successful calls (the run stops: max_retries=0)."""
    calls = {"n": 0}
    original = ActorRolloutRefWorker.update_actor

    @functools.wraps(original)  # keeps the @register dispatch of the method
    def update_actor(self, data):
        calls["n"] += 1
        if calls["n"] > steps:
            raise RuntimeError("simulated crash")
        return original(self, data)

    monkeypatch.setattr(ActorRolloutRefWorker, "update_actor", update_actor)


@pytest.mark.parametrize(
    "extra",
    [
        ["actor.optim.offload=true", "critic.optim.offload=true"],
        ["data.max_samples=16"],
        ["actor.lora.rank=4", "critic.lora.rank=4", "actor.optim.lr=0.01"],
    ],
    ids=["mid-epoch-moments-in-host-buffers", "epoch-boundary", "mid-epoch-lora-adapters"],
)
def test_resume_continues_exactly_where_the_run_broke(tiny_config, monkeypatch, extra):
    # 16 prompts in batches of 8: the break after step 2 falls on the epoch boundary. The first case keeps
    # AdamW's moments in host buffers (OffloadedAdamW), so its checkpoints hold DTensors over host shards. The last
    # trains LoRA adapters (and the critic's head beside them): its checkpoints hold those and their moments alone,
    # and its reference (KL in the reward) is the actor with its adapters off.
    config = tiny_config("trainer.total_steps=4", "trainer.save_freq=2", "algorithm.use_kl_in_reward=true", *extra)
    unbroken = PPOTrainer(config)
    unbroken_prompts = PromptLog(unbroken)
    unbroken.fit()
    expected = read_metrics(unbroken.run_dir / "metrics.jsonl")
    shutil.rmtree(unbroken.run_dir)

    with monkeypatch.context() as patch:
        break_after(patch, steps=2)
        first = PPOTrainer(config)
        first_prompts = PromptLog(first)
        with pytest.raises(RunFailedError):
            first.fit()
    resumed = PPOTrainer(config)
    resumed_prompts = PromptLog(resumed)
    resumed.fit()
    got = read_metrics(resumed.run_dir / "metrics.jsonl")

    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert first_prompts.indices[:2] + resumed_prompts.indices == unbroken_prompts.indices
    for want, have in zip(expected[2:], got[2:], strict=True):
        for key in COMPARED:  # CPU, float32, same seed: equal up to float rounding
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)


def test_auto_resume_ignores_a_checkpoint_written_half_way(tiny_config):
    trainer = PPOTrainer(tiny_config("trainer.total_steps=2"))
    trainer.fit()
    root = trainer.run_dir / "checkpoints"
    complete = root / "global_step_2"
    (root / ".tmp-global_step_4-deadbeef" / "actor").mkdir(parents=True)  # killed while the workers wrote
    shutil.copytree(complete, root / "global_step_4")
    (root / "global_step_4" / "trainer_state.json").unlink()  # a non-atomic writer could leave this
    (root / "latest").write_text("global_step_4")
    assert CheckpointManager(root).latest() == complete
    resumed = PPOTrainer(tiny_config("trainer.total_steps=3"))
    resumed.fit()
    assert [r["step"] for r in read_metrics(resumed.run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_rotation_keeps_the_newest_and_a_remote_copy_is_made(tiny_config, tmp_path):
    remote = tmp_path / "remote"
    config = tiny_config(
        "trainer.total_steps=3",
        "trainer.save_freq=1",
        "trainer.max_checkpoints_to_keep=2",
        f"trainer.checkpoint_remote_dir=file://{remote}",
    )
    trainer = PPOTrainer(config)
    trainer.fit()
    local = sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir())
    assert local == ["global_step_2", "global_step_3", "latest"]
    assert (trainer.run_dir / "checkpoints" / "latest").read_text() == "global_step_3"
    assert sorted(p.name for p in remote.iterdir()) == ["global_step_1", "global_step_2", "global_step_3"]
    assert (remote / "global_step_3" / "trainer_state.json").is_file()


def test_checkpoint_records_every_part_of_the_state(tiny_config):
    trainer = PPOTrainer(tiny_config("trainer.total_steps=1", "algorithm.use_kl_in_reward=true"))
    trainer.fit()
    checkpoint = trainer.run_dir / "checkpoints" / "global_step_1"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 1 and state["world_size"] == 1
    assert state["loader"] == {"epoch": 0, "batch_index": 1, "seed": 1}
    assert set(state["kl_ctrl"]) and state["val_history"] == []
    for role in ("actor", "critic"):
        manifest = json.loads((checkpoint / role / "manifest.json").read_text())
        assert manifest["world_size"] == 1 and manifest["parameters"]
        extra = torch.load(checkpoint / role / "extra_rank0.pt", weights_only=False)
        assert {"scheduler", "rng", "update_count"} <= set(extra) and extra["update_count"] == 1
    assert json.loads((checkpoint / "config.json").read_text())["trainer"]["total_steps"] == 1


def greedy(model, prompts: DataProto, new_tokens: int) -> torch.Tensor:
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return out[:, ids.shape[1] :]


def test_exports_load_with_from_pretrained_and_generate_like_the_trained_actor(tiny_config, tmp_path):
    trainer = PPOTrainer(tiny_config("trainer.total_steps=2", "actor.optim.lr=0.01"))
    trainer.fit()
    prompts = DataProto.from_single_dict(trainer.val_set.collate([trainer.val_set[i] for i in range(8)]))
    live = trainer.run_dir / "model"
    assert main(["export", str(trainer.run_dir / "checkpoints" / "global_step_2"), str(tmp_path / "out")]) == 0
    exported = tmp_path / "out"
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "vllm_engine_config.json",
    }
    assert expected <= {p.name for p in exported.iterdir()} and expected <= {p.name for p in live.iterdir()}
    engine = json.loads((exported / "vllm_engine_config.json").read_text())
    assert engine == {
        "tensor_parallel_size": 1,
        "max_model_len": 40,
        "dtype": "float32",
        "stop_token_ids": [1],
        "gpu_memory_utilization": 0.5,
    }
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == [1]
    trained = AutoModelForCausalLM.from_pretrained(live)
    from_checkpoint = AutoModelForCausalLM.from_pretrained(exported)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(tensor, from_checkpoint.state_dict()[name]), name
    # The trained actor's own rollout, rebuilt from the checkpoint, decodes greedily like the export.
    resumed = PPOTrainer(tiny_config("trainer.total_steps=2", "actor.optim.lr=0.01"))
    resumed._open()
    prompts.meta_info["do_sample"] = False
    rollout = resumed.actor_rollout.generate_sequences(
        prompts.select(["input_ids", "attention_mask", "position_ids"], [])
    )
    resumed.groups.shutdown()
    mask = rollout.batch["response_mask"].bool()
    tokens = greedy(from_checkpoint, prompts, new_tokens=8)
    assert torch.equal(tokens[mask], rollout.batch["responses"][mask])


def test_a_large_export_is_sharded_with_an_index(tiny_model_dir, tmp_path):
    from ketch.engine.export import write_hf_directory
    from ketch.models import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = write_hf_directory(state, model.config, tmp_path / "sharded", max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    back = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(back.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_exporting_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "is not a complete ketch checkpoint" in capsys.readouterr().err
