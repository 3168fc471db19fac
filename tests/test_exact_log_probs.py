"""`rollout.exact_log_probs`: batch-invariant ops (`ketch.models.batch_invariant`) give a row the same bits whatever
rows and keys are computed with it, so the rollout's log-probs of the sampled tokens are the training forward's."""

from __future__ import annotations

import pytest
import torch
from families import save_tiny_family_model
from torch import nn
from transformers import GPT2Config, LlamaConfig, Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, Qwen2RotaryEmbedding

from ketch.config import ConfigError, load_config
from ketch.config.exact import check_exact_start
from ketch.data import build_char_tokenizer
from ketch.models.batch_invariant import ROWS, attention, label_log_probs, linear, silu
from ketch.trainer.ppo import PPOTrainer
from ketch.workers.actor import ActorRolloutRefWorker


def _one_at_a_time(op, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([op(x[i : i + 1]) for i in range(len(x))])


def test_linear_gives_a_row_the_same_bits_alone_as_in_any_batch():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(37, 256), torch.randn(384, 256), torch.randn(384)
    batch = linear(x, weight, bias)
    assert torch.equal(_one_at_a_time(lambda rows: linear(rows, weight, bias), x), batch)
    assert torch.equal(linear(x[5:8], weight, bias), batch[5:8])  # 3 rows: the CPU's small-matmul path for plain mm
    assert batch.shape == (37, 384) and ROWS == 16


def test_linear_backward_gives_the_plain_gradients():
    """The blocked forward's backward is the plain matmul's: the gradients of `x @ weight.T + bias` (in float64
    the two agree to rounding; 37 rows are 3 blocks, the last one padded)."""
    torch.manual_seed(0)
    shapes = ((37, 8), (5, 8), (5,))
    x, weight, bias = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in shapes)
    upstream = torch.randn(37, 5, dtype=torch.float64)
    blocked = torch.autograd.grad((linear(x, weight, bias) * upstream).sum(), (x, weight, bias))
    plain = torch.autograd.grad(((x @ weight.T + bias) * upstream).sum(), (x, weight, bias))
    for got, expected in zip(blocked, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert blocked[1].shape == (5, 8)


def test_silu_gives_an_element_the_same_bits_wherever_it_sits():
    """torch's SiLU leaves a vectorised loop's last elements to a scalar formula (131 of 100,000 differ in groups of
    33); `x / (1 + exp(-x))` rounds every element alike."""
    x = torch.linspace(-10, 10, 33 * 300)
    assert torch.equal(torch.cat([silu(part) for part in x.split(33)]), silu(x))


def test_log_probs_over_a_large_vocabulary_are_per_row():
    """A plain sum over one 151,936-wide row is split over the threads, over many rows it is not: the log-softmax
    reduces each row on its own."""
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 151936) * 3, torch.tensor([0, 7, 151935, 42, 1000, 5])
    batch, entropy = label_log_probs(logits, labels, 0.7, calc_entropy=True)
    alone = torch.cat([label_log_probs(logits[i : i + 1], labels[i : i + 1], 0.7)[0] for i in range(6)])
    assert torch.equal(alone, batch) and entropy.shape == (6,)


def test_rms_norm_is_per_row_as_it_stands():
    torch.manual_seed(0)
    norm, x = Qwen2RMSNorm(896), torch.randn(40, 896)
    assert torch.equal(_one_at_a_time(norm, x), norm(x))


def test_rotary_cos_and_sin_of_a_position_are_the_same_in_a_decode_step_as_in_a_sequence():
    rotary, x = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=896, num_attention_heads=14)), torch.zeros(1)
    sequence = rotary(x, torch.arange(300)[None].expand(3, -1))
    for position in (0, 7, 130, 299):
        step = rotary(x, torch.tensor([[position]] * 5))
        assert all(torch.equal(one[0, 0], many[0, position]) for one, many in zip(step, sequence, strict=True))


def _mask(real: torch.Tensor, q_len: int) -> torch.Tensor:
    """transformers' boolean mask `[batch, 1, q_len, kv_len]` of the last `q_len` queries over keys `real` `[batch,
    kv_len]` (1: a token, 0: padding): causal, padding masked."""
    kv_len = real.shape[-1]
    causal = torch.ones(kv_len, kv_len, dtype=torch.bool, device=real.device).tril()[-q_len:]
    return (causal & real.bool()[:, None, :])[:, None]


def test_attention_of_a_decode_step_is_the_whole_sequences_forward_at_that_token():
    """Three left-padded rows of 150 tokens (padding 0, 5 and 70: a first key block of padding alone), 4 query heads
    over 2 key heads: a query decoded over its cache is the forward's output at its position."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 150, 16), torch.randn(3, 2, 150, 16), torch.randn(3, 2, 150, 16)
    real = torch.ones(3, 150)
    real[1, :5], real[2, :70] = 0, 0
    forward, _ = attention(nn.Module(), q, k, v, _mask(real, 150), scaling=0.25)
    for t in (70, 100, 127, 128, 149):
        cached = (q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], _mask(real[:, : t + 1], 1))
        step, _ = attention(nn.Module(), *cached, scaling=0.25)
        assert torch.equal(step[:, 0], forward[:, t]), t
    assert forward.shape == (3, 150, 4, 16) and torch.equal(forward[2, :70], torch.zeros(70, 4, 16))


def test_attention_of_a_sequence_does_not_depend_on_its_padding():
    """The same 80 tokens padded on the left to 100 and to 150 (a batch with a longer prompt): the same bits."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 80, 16), torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 16)
    outputs = []
    for pad in (20, 70):
        padded = [nn.functional.pad(t, (0, 0, pad, 0), value=1.0) for t in (q, k, v)]
        real = nn.functional.pad(torch.ones(1, 80), (pad, 0))
        out, _ = attention(nn.Module(), *padded, _mask(real, 80 + pad), scaling=0.25)
        outputs.append(out[:, pad:])
    assert torch.equal(*outputs)


GRPO = ("algorithm.adv_estimator=grpo", "rollout.n=2", "trainer.total_steps=2")


def _grpo_run(tiny_config, monkeypatch, *overrides) -> tuple[list[dict], list[tuple[torch.Tensor, torch.Tensor]]]:
    """A 2-step GRPO run: its metrics per step, and per micro-batch of each update's first forward the sampled
    tokens' log-probs of that forward and of the rollout (`[tokens]` each)."""
    pairs = []
    measured = ActorRolloutRefWorker._rollout_mismatch

    def record(worker, log_prob, b, num_tokens):
        mask = b["response_mask"].bool()
        pairs.append((log_prob[mask], b[worker.mismatch_with][mask]))
        return measured(worker, log_prob, b, num_tokens)

    monkeypatch.setattr(ActorRolloutRefWorker, "_rollout_mismatch", record)
    trainer = PPOTrainer(tiny_config(*GRPO, *overrides))
    trainer._open()
    try:
        steps = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    finally:
        trainer.groups.shutdown()
    return steps, pairs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rollouts_log_probs_are_the_training_forwards_bit_for_bit(tiny_config, monkeypatch, dtype):
    steps, pairs = _grpo_run(tiny_config, monkeypatch, "rollout.exact_log_probs=true", f"model.dtype={dtype}")
    assert [s["training/rollout_probs_diff_max"] for s in steps] == [0.0, 0.0]
    assert len(pairs) == 2 and all(torch.equal(train, rollout) for train, rollout in pairs)


def test_a_mixture_of_experts_routes_and_computes_alike_in_the_rollout_and_the_update(
    tiny_config, monkeypatch, tmp_path
):
    """A tiny Qwen3-MoE (4 experts, 2 a token) in float32: the router's logits through the blocked matmul, each
    expert's tokens through it too, a token's experts added in their order. The log-probs are bitwise equal, and
    the router's load-balancing loss is still added (transformers' recorder finds the switched router)."""
    model = save_tiny_family_model(tmp_path / "moe", "qwen3_moe", build_char_tokenizer())
    steps, pairs = _grpo_run(tiny_config, monkeypatch, "rollout.exact_log_probs=true", f"model.path={model}")
    assert [s["training/rollout_probs_diff_max"] for s in steps] == [0.0, 0.0]
    assert len(pairs) == 2 and all(torch.equal(train, rollout) for train, rollout in pairs)
    assert all(s["actor/router_aux_loss"] > 0 for s in steps)


def test_without_it_they_differ_in_the_last_bits(tiny_config, monkeypatch):
    """The same run with the rollout's log-probs as old_log_prob but the default kernels."""
    steps, pairs = _grpo_run(tiny_config, monkeypatch, "actor.old_log_prob_from_rollout=true")
    assert all(0 < s["training/rollout_probs_diff_max"] < 1e-6 for s in steps)
    assert not any(torch.equal(train, rollout) for train, rollout in pairs)


def test_the_old_log_prob_pass_is_skipped(tiny_config, monkeypatch):
    def no_pass(*args, **kwargs):
        raise AssertionError("the old-log-prob pass ran")

    monkeypatch.setattr(ActorRolloutRefWorker, "compute_log_prob", no_pass)
    steps, _ = _grpo_run(tiny_config, monkeypatch, "rollout.exact_log_probs=true", "actor.recompute_old_log_prob=null")
    assert not any("timing_s/old_log_prob" in s for s in steps)


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ("rollout.name=vllm", "vLLM's kernels are its own"),
        ("rollout.kv_cache_dtype=fp8", "the rollout attends to rounded keys and values"),
        ("model.use_remove_padding=true", "packed forwards are not covered"),
        ("actor.lora.rank=8", "the rollout decodes merged weights, the actor adds adapters"),
    ],
)
def test_settings_it_cannot_hold_with_are_refused(setting, why):
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=["rollout.exact_log_probs=true", setting])
    assert (
        f"rollout.exact_log_probs=true needs the hf rollout and the actor's padded eager forward in one process, "
        f"and with {setting.replace('rank=8', 'rank > 0')} {why}: drop it or set "
        "rollout.exact_log_probs=false"
    ) in str(refused.value)


def test_it_recomputes_the_layers_in_the_backward_unless_told_otherwise():
    """Its attention keeps whole score matrices for the backward: recomputing each layer frees them."""
    assert load_config(overrides=["rollout.exact_log_probs=true"]).model.gradient_checkpointing is True
    kept = load_config(overrides=["rollout.exact_log_probs=true", "model.gradient_checkpointing=false"])
    assert kept.model.gradient_checkpointing is False
    assert load_config(overrides=[]).model.gradient_checkpointing is False


def test_it_skips_the_pass_that_rollout_is_needs():
    with pytest.raises(ConfigError, match=r"rollout.exact_log_probs=true skips .* which actor.rollout_is needs"):
        load_config(overrides=["rollout.exact_log_probs=true", "actor.rollout_is=token"])


@pytest.mark.parametrize(
    ("model_config", "problem"),
    [
        (GPT2Config(), "model_type='gpt2' is not a family whose every op it covers (llama, qwen2, qwen3, qwen3_moe)"),
        (LlamaConfig(hidden_act="gelu"), "its MLP's activation is 'gelu'; it covers SiLU"),
    ],
)
def test_a_model_it_does_not_cover_is_refused_at_start_up(model_config, problem):
    config = load_config(overrides=["rollout.exact_log_probs=true"])
    with pytest.raises(ConfigError) as refused:
        check_exact_start(config, model_config)
    assert f"rollout.exact_log_probs=true computes batch-invariantly, and {problem}: set" in str(refused.value)
    check_exact_start(config, LlamaConfig())
