"""The CPU's and the GPU's code paths give the same multi-turn training data, in float32 on the CPU (where both
run): padded against packed training forwards, transformers' `generate` against the static decoder (eager, as the
GPU's static decoder is without its compiled blocks and CUDA graphs), on trajectories with two calls of the
`calculate` tool (tests/path_parity.py; the same checks on CUDA in bfloat16: tests/gpu/test_path_parity_gpu.py).
And the rollout mismatch per kind of turn that a multi-turn run logs."""

from __future__ import annotations

import math

import pytest
import torch
from path_parity import (
    CPU_PATHS,
    GPU_PATHS,
    PROMPT_LEN,
    answers,
    expected_layout,
    for_update,
    prompts,
    save_tool_policy,
    sft_batch,
    sft_gradients,
    tool_calls,
    tool_config,
    update_gradients,
    worker_group,
    write_rows,
)

from ketch.algorithms import turn_masks
from ketch.protocol import DataProto
from ketch.rollout.static_decoding import StaticDecoder
from ketch.tracking import read_metrics
from ketch.trainer.ppo import PPOTrainer

PATHS = {"cpu": CPU_PATHS, "gpu": GPU_PATHS}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(model directory, rows file, a directory for runs)."""
    root = tmp_path_factory.mktemp("path-parity")
    return save_tool_policy(root / "policy"), write_rows(root / "rows.parquet"), root / "runs"


@pytest.fixture(scope="module")
def configs(policy):
    return {name: tool_config(*policy, "trainer.device=cpu", *paths) for name, paths in PATHS.items()}


@pytest.fixture(scope="module")
def groups(configs):
    groups = {name: worker_group(config) for name, config in configs.items()}
    yield groups
    for group in groups.values():
        group.shutdown()


@pytest.fixture(scope="module")
def greedy(configs, groups):
    """Each path's greedy trajectories of the three problems."""
    return {name: group.generate_sequences(prompts(configs[name])) for name, group in groups.items()}


def test_both_paths_decode_the_same_two_call_trajectories_with_masks_on_the_sampled_tokens(greedy):
    responses, response_mask, real = expected_layout()
    for data in greedy.values():
        b = data.batch
        assert tool_calls(data).tolist() == [2.0] * 3
        assert answers(data) == ["#### 13", "#### 61", "#### 5536"]
        # The whole conversation as the demonstration holds it: 1 exactly on the model's own tokens (both calls
        # and the answer), 0 on the tool's replies and the template around them, and on the padding.
        assert torch.equal(b["responses"] * real, responses) and torch.equal(b["response_mask"], response_mask)
        assert torch.equal(b["attention_mask"][:, PROMPT_LEN:], real)
        assert (b["rollout_log_probs"][response_mask == 0] == 0).all()
    cpu, gpu = greedy["cpu"].batch, greedy["gpu"].batch
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(cpu[key], gpu[key]), key
    torch.testing.assert_close(gpu["rollout_log_probs"], cpu["rollout_log_probs"], atol=1e-5, rtol=0)


def test_the_static_decoder_in_the_gpus_shape_buckets_decodes_the_same_trajectories(configs, groups, greedy):
    """With buckets, as compiled on a GPU: every turn's prompt left-padded to a multiple of 64 tokens and the three
    rows to four, in one KV cache per shape that later turns reuse."""
    hf = groups["gpu"].worker.rollout.backend
    eager = hf.decoder
    hf.decoder = StaticDecoder(hf.model, compile_step=False, buckets=True, longest_prompt=PROMPT_LEN)
    try:
        bucketed = groups["gpu"].generate_sequences(prompts(configs["gpu"])).batch
    finally:
        hf.decoder = eager
    reference = greedy["cpu"].batch
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(bucketed[key], reference[key]), key
    torch.testing.assert_close(bucketed["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-5, rtol=0)


def test_sampled_trajectories_score_the_same_in_the_rollout_and_in_both_training_forwards(configs, groups):
    torch.manual_seed(0)
    data = groups["gpu"].generate_sequences(prompts(configs["gpu"], repeat=2, do_sample=True))
    mask = data.batch["response_mask"].bool()
    real = data.batch["attention_mask"][:, PROMPT_LEN:].bool()
    assert (tool_calls(data) >= 1).all() and (mask.sum(-1) < real.sum(-1)).all()
    rollout = data.batch["rollout_log_probs"]
    forward = {name: group.compute_log_prob(data).batch["old_log_prob"] for name, group in groups.items()}
    for log_prob in forward.values():
        torch.testing.assert_close(log_prob[mask], rollout[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(forward["gpu"][real], forward["cpu"][real], atol=1e-5, rtol=0)


def test_a_grpo_update_on_multi_turn_rows_has_the_same_gradients_packed_and_padded(configs, groups):
    torch.manual_seed(1)
    data = for_update(groups["gpu"].generate_sequences(prompts(configs["gpu"], repeat=2, do_sample=True)))
    grads = {name: update_gradients(group, data) for name, group in groups.items()}
    for name, grad in grads["cpu"].items():
        torch.testing.assert_close(grads["gpu"][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_sft_of_multi_turn_demonstrations_has_the_same_loss_and_gradients_packed_and_padded(configs, groups):
    data = sft_batch(configs["cpu"])
    assert data.batch["loss_mask"].sum().item() == expected_layout()[1].sum().item()
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = (sft_gradients(groups[name], data) for name in ("cpu", "gpu"))
    assert gpu_loss == pytest.approx(cpu_loss, abs=1e-5)
    assert 0.0 < cpu_loss < 0.05  # the policy knows the conversations
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_update_measures_the_rollout_mismatch_per_kind_of_turn(configs, groups):
    """Without an old-log-prob pass the update's first forward is pi_old. Here the rollout's log-probs claim half
    the probability for every token of its tool calls: the mismatch shows on those turns and not on the answers."""
    torch.manual_seed(2)
    b = groups["gpu"].generate_sequences(prompts(configs["gpu"], repeat=2, do_sample=True)).batch
    tool = turn_masks(b["response_mask"], b["attention_mask"][:, PROMPT_LEN:])["tool_turns"]
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    update = {key: b[key] for key in keys} | {"advantages": torch.zeros_like(b["rollout_log_probs"])}
    update["rollout_log_probs"] = b["rollout_log_probs"] + math.log(0.5) * tool
    metrics = groups["gpu"].update_actor(DataProto.from_dict(update)).meta_info["metrics"]
    p = b["rollout_log_probs"].exp()[tool]
    assert metrics["training/rollout_probs_diff_mean/tool_turns"] == pytest.approx(0.5 * p.mean().item(), rel=1e-4)
    assert metrics["training/rollout_probs_diff_max/tool_turns"] == pytest.approx(0.5 * p.max().item(), rel=1e-4)
    assert metrics["training/rollout_probs_diff_max/answer_turns"] < 1e-5


def test_a_multi_turn_run_with_pi_old_from_the_rollout_logs_the_mismatch_per_kind_of_turn(policy):
    """The tool example's setting (`actor.old_log_prob_from_rollout`, no old-log-prob pass): metrics.jsonl still
    has the rollout mismatch, from the update's first forward, per kind of turn; in float32 on the CPU the rollout
    and the training engine agree."""
    settings = ("actor.old_log_prob_from_rollout=true", "trainer.total_steps=1", "trainer.val_before_train=false")
    trainer = PPOTrainer(tool_config(*policy, "trainer.device=cpu", *GPU_PATHS, *settings))
    trainer.fit()
    (metrics,) = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "step" in r]
    for kind in ("tool_turns", "answer_turns"):
        assert (
            0
            <= metrics[f"training/rollout_probs_diff_mean/{kind}"]
            <= metrics[f"training/rollout_probs_diff_max/{kind}"]
            < 1e-5
        )
    assert metrics["training/rollout_probs_diff_max"] < 1e-5
