"""LoRA adapters (`ketch/engine/lora.py`): a fresh adapter changes nothing, a step changes the adapters alone, the
reference is the base model with the adapters off, the merged export and the PEFT adapter directory decode alike,
`ketch sft` and `ketch rm` take the same section, and settings that cannot apply stop the run at start-up."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from peft import PeftModel
from spawned import end_rank
from test_engine import make_batch
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ketch.algorithms import policy_loss
from ketch.cli import main
from ketch.config import ConfigError, derive_batch_plan, load_config
from ketch.config.memory import lora_parameters, shared_rollout_parameters
from ketch.config.schema import LoraConfig, OptimConfig
from ketch.controller import LocalWorkerGroup
from ketch.engine.distributed import free_port, init_process_group
from ketch.engine.engine import TrainEngine
from ketch.engine.heads import PolicyModel
from ketch.engine.lora import add_lora
from ketch.engine.micro import split_micro_batches
from ketch.models import load_causal_lm, load_model_config
from ketch.protocol import DataProto
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.rm import RMTrainer
from ketch.trainer.sft import SFTTrainer
from ketch.workers import ActorRolloutRefWorker

CPU = torch.device("cpu")
ADAPTERS = 28
"""Adapter tensors of the tiny model with `all-linear`: 2 layers x 7 linear layers (q, k, v, o, gate, up, down)
x (A, B)."""
ADAPTER_NUMBERS = 4096
"""Their numbers at rank 4: per layer 4 x ((32 + 32) q + (32 + 16) k + (32 + 16) v + (32 + 32) o + 3 x (32 + 64)
gate/up/down) = 2048."""


def engine(
    model_dir, lora: LoraConfig | None = None, lr: float = 0.0, dtype: torch.dtype = torch.float32
) -> TrainEngine:
    """The tiny model as a trained FSDP2 policy (no weight decay, no clipping), with `lora` adapters when given; a
    `dtype` other than float32 is the base's and the forward's (mixed precision, adapters in float32)."""
    init_process_group(CPU)
    policy = PolicyModel(load_causal_lm(str(model_dir), dtype, "eager"))
    if lora is not None:
        add_lora(policy.lm, lora)
    mixed = dtype if dtype != torch.float32 else None
    return TrainEngine(policy, CPU, OptimConfig(lr=lr, grad_clip=0.0), total_steps=2, param_dtype=mixed)


def policy_gradient(out, micro, num_tokens, num_seqs):
    b = micro.batch
    loss, _ = policy_loss(b["old_log_prob"], out["log_prob"], b["advantages"], b["response_mask"])
    return loss, {}


def full(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in engine.module.named_parameters()}


def test_a_fresh_adapter_gives_the_base_models_log_probs(tiny_model_dir):
    batch = make_batch(vocab=100)
    base = engine(tiny_model_dir).infer(batch, None, calc_entropy=True)
    adapted = engine(tiny_model_dir, LoraConfig(rank=4))
    with_lora = adapted.infer(batch, None, calc_entropy=True)
    assert torch.equal(with_lora["log_prob"], base["log_prob"])  # B = 0: W x + 0
    assert torch.equal(with_lora["entropy"], base["entropy"])
    trained = dict(adapted.trained_parameters())
    assert len(trained) == ADAPTERS and all(".lora_" in name for name in trained)
    assert sum(t.numel() for t in trained.values()) == ADAPTER_NUMBERS
    assert lora_parameters(load_model_config(str(tiny_model_dir)), rank=4) == ADAPTER_NUMBERS  # the doctor's count


def test_a_step_changes_the_adapters_and_nothing_else(tiny_model_dir):
    lora = engine(tiny_model_dir, LoraConfig(rank=4), lr=0.01)
    before = full(lora)
    for _ in range(2):  # the first step moves B only (A's gradient is B^T ..., zero while B is)
        lora.train_mini_batch(split_micro_batches(make_batch(vocab=100), 4), policy_gradient)
    after = full(lora)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {name for name in before if ".lora_" in name} and len(changed) == ADAPTERS
    assert len(lora.optimizer.state) == ADAPTERS  # AdamW's moments for the adapters only


def _train_adapters(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """Two steps on this rank's share of one batch; rank 0 saves the full adapters to `out`. With two ranks, also a
    bfloat16 base (mixed precision) beside float32 adapters in each FSDP unit: they train, the base does not."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    mine = make_batch(vocab=100).chunk(world)[rank]
    dtypes = (torch.float32, torch.bfloat16) if world == 2 else (torch.float32,)
    for dtype in dtypes:
        lora = engine(model_dir, LoraConfig(rank=4), lr=0.01, dtype=dtype)
        before = full(lora)
        for _ in range(2):
            lora.train_mini_batch(split_micro_batches(mine, 2), policy_gradient)
        adapters = {name: tensor.clone() for name, tensor in lora.trained_parameters()}
        changed = {name for name, tensor in full(lora).items() if not torch.equal(tensor, before[name])}
        assert changed == set(adapters) and {t.dtype for t in adapters.values()} == {torch.float32}, dtype
        handed = {name: tensor.dtype for name, tensor in lora.full_parameters(prefix="lm.", dtype=dtype)}
        assert "model.layers.0.self_attn.q_proj.weight" in handed and set(handed.values()) == {dtype}  # plain names
        if rank == 0 and dtype == torch.float32:
            torch.save(adapters, out)
    end_rank()


def test_two_gloo_ranks_train_the_same_adapters_as_one(tiny_model_dir, tmp_path):
    for world in (1, 2):
        args = (world, free_port(), str(tiny_model_dir), str(tmp_path / f"world{world}.pt"))
        mp.start_processes(_train_adapters, args=args, nprocs=world, start_method="spawn")
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    assert set(one) == set(two) and len(one) == ADAPTERS
    for name, tensor in one.items():  # the same gradients (global normalisation) summed in another order: AdamW's
        torch.testing.assert_close(two[name], tensor, atol=1e-5, rtol=0)  # first steps move each by ~lr = 1e-2
    assert min(t.abs().max().item() for n, t in one.items() if "lora_B" in n) > 1e-3  # B left zero


@pytest.fixture
def lora_actor(tiny_config):
    """An actor worker with rank-4 adapters and a KL loss (so a reference is used), after one update with random
    advantages that moved its adapters."""
    config = tiny_config("actor.lora.rank=4", "actor.use_kl_loss=true", "actor.optim.lr=0.05", "rollout.n=2")
    trainer = PPOTrainer(config)
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, trainer.model_path, derive_batch_plan(config), 10)
    group.init_model()
    batch = trainer.val_set.collate([trainer.val_set[i] for i in range(8)])
    prompts = DataProto.from_single_dict(batch).select(["input_ids", "attention_mask", "position_ids"], [])
    data = group.generate_sequences(prompts)
    data = data.union(group.compute_ref_log_prob(data))
    shape = data.batch["response_mask"].shape
    data.batch["advantages"] = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    group.update_actor(data)
    yield group, data
    group.shutdown()


def test_the_reference_is_the_actors_base_model_with_its_adapters_off(lora_actor, tiny_model_dir):
    group, data = lora_actor
    assert group.worker.ref is None  # no second model
    reference = group.compute_ref_log_prob(data).batch["ref_log_prob"]
    actor = group.compute_log_prob(data).batch["old_log_prob"]
    base = engine(tiny_model_dir).infer(data, None)["log_prob"]
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(reference[mask], base[mask], atol=1e-6, rtol=0)
    assert (actor[mask] - base[mask]).abs().max() > 1e-3  # the adapters did move: the actor is not the reference
    torch.testing.assert_close(group.compute_log_prob(data).batch["old_log_prob"], actor)  # adapters back on


def test_the_rollout_reads_the_frozen_weights_in_place_and_frees_only_its_own(tiny_config):
    """LoRA on the attention projections: the hf rollout reads the embeddings (tied), the norms and the down
    projections from the actor's own tensors, not copies (the static decoder's fused gate/up is a copy it computes
    with); sleeping frees the rollout's own weights only, and two steps decode the trained adapters."""
    config = tiny_config(
        "algorithm.adv_estimator=grpo", "rollout.n=2", "data.train_batch_size=4", "actor.lora.rank=4",
        "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "actor.optim.lr=0.05", "actor.entropy_coeff=0.01",
        "rollout.hf_decoding=static", "rollout.free_memory_while_training=true",
    )  # fmt: skip
    trainer = PPOTrainer(config)
    trainer._open()
    worker = trainer.actor_rollout.worker
    actor = {n.removeprefix("lm."): p.to_local() for n, p in worker.actor.module.named_parameters()}
    rollout = dict(worker.rollout.model.named_parameters(remove_duplicate=False))
    per_layer = ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.down_proj.weight")
    expected = {f"model.layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert worker.rollout.shared == expected | {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert all(rollout[n].data_ptr() == actor[n].data_ptr() for n in expected | {"model.embed_tokens.weight"})
    metrics = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    worker.rollout.sleep()
    kept = {n for n, p in rollout.items() if p.untyped_storage().nbytes() > 0}
    trainer.groups.shutdown()
    assert kept == worker.rollout.shared
    with torch.device("meta"):  # ketch doctor's estimate counts the same parameters
        skeleton = AutoModelForCausalLM.from_config(load_model_config(config.model.path))
    shared = {id(rollout[n]): rollout[n].numel() for n in worker.rollout.shared}
    assert shared_rollout_parameters(config, skeleton) == sum(shared.values())
    assert all(m["training/rollout_probs_diff_max"] < 1e-5 for m in metrics)


def greedy(model, prompts: DataProto, new_tokens: int = 8) -> torch.Tensor:
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return out[:, ids.shape[1] :]


def test_the_merged_export_and_the_adapter_directory_decode_alike(tiny_config, tiny_model_dir, tmp_path):
    config = tiny_config("actor.lora.rank=4", "critic.lora.rank=4", "actor.optim.lr=0.05")
    trainer = PPOTrainer(config)
    trainer.fit()
    model_dir = trainer.run_dir / "model"
    merged = AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), model_dir / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert (merged.state_dict()[q_proj] - base.state_dict()[q_proj]).abs().max() > 1e-4  # trained adapters
    prompts = DataProto.from_single_dict(trainer.val_set.collate([trainer.val_set[i] for i in range(16)]))
    assert torch.equal(greedy(merged, prompts), greedy(adapted, prompts))
    adapter_config = json.loads((model_dir / "adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 32.0)
    assert adapter_config["base_model_name_or_path"] == str(tiny_model_dir)
    # the checkpoint holds the adapters (the critic's head too) alone; `ketch export` merges them into the base
    checkpoint = trainer.run_dir / "checkpoints" / "global_step_2"
    for role, extra in (("actor", set()), ("critic", {"score.weight", "score.bias"})):
        saved = FileSystemReader(str(checkpoint / role)).read_metadata().state_dict_metadata
        weights = {key.removeprefix(f"model.{role}.").removeprefix("model.lm.") for key in saved if key[:6] == "model."}
        assert {name for name in weights if ".lora_" not in name} == extra and len(weights) == ADAPTERS + len(extra)
    assert main(["export", str(checkpoint), str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in merged.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    assert main(["export", str(checkpoint), str(tmp_path / "critic"), "--role", "critic"]) == 0


def test_an_adapter_directory_starts_a_run_where_its_training_ended(tiny_config, tmp_path):
    first = PPOTrainer(tiny_config("actor.lora.rank=4", "critic.lora.rank=4", "actor.optim.lr=0.05"))
    first.fit()
    adapter = first.run_dir / "model" / "adapter"
    config = tiny_config(f"actor.lora.adapter_path={adapter}", "trainer.experiment_name=again")
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, first.model_path, derive_batch_plan(config), 10)
    group.init_model()
    data = make_batch(vocab=100)
    started = group.compute_log_prob(data).batch["old_log_prob"]
    group.shutdown()
    merged = engine(first.run_dir / "model").infer(data, None)["log_prob"]
    torch.testing.assert_close(started, merged, atol=1e-5, rtol=0)


def test_ketch_sft_trains_adapters_and_writes_them(tiny_config, tiny_model_dir):
    config = tiny_config("actor.lora.rank=4", "actor.optim.lr=0.01", "trainer.total_steps=2")
    SFTTrainer(config, str(tiny_model_dir)).fit()
    run_dir = Path(config.trainer.default_local_dir) / config.trainer.experiment_name
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run_dir / "model/adapter")
    ids = torch.arange(4, 20)[None]
    torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_ketch_rm_trains_adapters_beside_a_whole_score_head(tiny_config, tiny_model_dir, preference_files):
    overrides = ("reward.model.lora.rank=4", "reward.model.optim.lr=0.01", "trainer.total_steps=2")
    files = [f"data.train_files=[{preference_files['train']}]", f"data.val_files=[{preference_files['val']}]"]
    config = tiny_config(*files, *overrides)
    RMTrainer(config).fit()
    run_dir = Path(config.trainer.default_local_dir) / config.trainer.experiment_name
    merged = AutoModelForSequenceClassification.from_pretrained(run_dir / "model").eval()
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    adapted = PeftModel.from_pretrained(base, run_dir / "model" / "adapter").eval()
    ids = torch.arange(4, 20)[None]
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["actor.lora.rank=4", "actor.lora.target_modules=[q_proj,qkv]"],
            "actor.lora.target_modules names 'qkv', which is no linear layer of Qwen2ForCausalLM; its linear layers "
            "are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or use all-linear)",
        ),
        (
            ["actor.lora.rank=4", "actor.lora.target_modules=lm_head"],
            "actor.lora.target_modules names 'lm_head', which is no linear layer of Qwen2ForCausalLM",
        ),
        (
            ["actor.lora.adapter_path=/nowhere"],
            "actor.lora.adapter_path=/nowhere has no adapter_config.json; give a PEFT adapter directory",
        ),
        (
            ["reward.model.lora.rank=4"],
            "reward.model.lora trains a reward model's adapters in `ketch rm`; PPO's reward model is frozen",
        ),
    ],
)
def test_lora_settings_that_cannot_apply_stop_the_run_at_start_up(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        PPOTrainer(tiny_config(*overrides))


def test_the_megatron_engine_refuses_lora_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["actor.lora.rank=8", "actor.strategy=megatron", "trainer.device=cuda"])
    assert (
        "  - actor.lora trains adapters on the FSDP engine; the Megatron engine (actor.strategy=megatron) trains full "
        "weights only: set actor.strategy=fsdp or actor.lora.rank=0"
    ) in str(err.value).splitlines()
