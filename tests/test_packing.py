"""Padding-free packing: packed and padded forwards give the same log-probs, entropy, values, scores, losses and
gradients, on ragged left-padded prompts and right-padded responses."""

from __future__ import annotations

import pytest
import torch
from recorded_grads import record_grads

from ketch.algorithms import policy_loss
from ketch.config.schema import OptimConfig
from ketch.engine.distributed import init_process_group
from ketch.engine.engine import TrainEngine
from ketch.engine.heads import PolicyModel, ScoreModel, ValueModel
from ketch.engine.packing import Packing, _sdpa_masked, _sdpa_per_sequence
from ketch.models import load_causal_lm, load_critic, load_reward_model
from ketch.protocol import DataProto

CPU = torch.device("cpu")
PROMPT_LEN, RESPONSE_LEN = 6, 5


def ragged_batch(vocab: int) -> DataProto:
    """6 rows: prompts of 6, 3, 1, 4, 6, 2 tokens (left-padded), responses of 5, 1, 3, 5, 2, 4 (right-padded)."""
    g = torch.Generator().manual_seed(1)
    prompt_lens = torch.tensor([6, 3, 1, 4, 6, 2])
    response_lens = torch.tensor([5, 1, 3, 5, 2, 4])
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - prompt_lens[:, None]).long()
    response_mask = (torch.arange(RESPONSE_LEN) < response_lens[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(4, vocab, attention_mask.shape, generator=g) * attention_mask
    rows = len(prompt_lens)
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, PROMPT_LEN:],
            "response_mask": response_mask,
            "old_log_prob": -torch.rand(rows, RESPONSE_LEN, generator=g) * 3,
            "advantages": torch.randn(rows, RESPONSE_LEN, generator=g),
        }
    )


def test_packing_keeps_the_real_tokens_in_order_and_restores_the_padded_layout():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0], [0, 0, 1]])
    packing = Packing.from_mask(mask)
    assert packing.index.tolist() == [1, 2, 3, 4, 8]
    assert packing.cu_seqlens.tolist() == [0, 2, 4, 5]
    assert packing.max_len == 2
    values = torch.tensor([[9, 1, 2], [3, 4, 9], [9, 9, 5]])
    assert packing.pack(values).tolist() == [[1, 2, 3, 4, 5]]
    assert packing.unpack(packing.pack(values)).tolist() == [[0, 1, 2], [3, 4, 0], [0, 0, 5]]


@pytest.mark.parametrize("window", [None, 4])
def test_the_attention_of_each_sequence_gives_the_masked_rows_values_and_gradients(window):
    """The eager CPU fallback (`_sdpa_per_sequence`) against the masked row that compiled blocks trace, in float32:
    4 query heads over 2 key/value heads, a scale of its own, sequences of 7, 1, 12, 5, 0 and 9 tokens, with and
    without a window of 4 tokens. Both sum the same products in other orders: to 1e-6 plus 1e-6 of the value (the
    differences seen are at most 1.2e-6 on values up to ~8, a few float32 ulps)."""
    g = torch.Generator().manual_seed(0)
    lengths = [7, 1, 12, 5, 0, 9]
    cu_seqlens = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    inputs = [torch.randn(sum(lengths), heads, 16, generator=g) for heads in (4, 2, 2)]
    grad_out = torch.randn(sum(lengths), 4, 16, generator=g)
    results = []
    for attention in (_sdpa_masked, _sdpa_per_sequence):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        out = attention(q, k, v, cu_seqlens, 0.25, 0.0, window)
        out.backward(grad_out)
        results.append([out, q.grad, k.grad, v.grad])
    for name, masked, per_sequence in zip(("output", "grad q", "grad k", "grad v"), *results, strict=True):
        assert masked.abs().max() > 0.1, name  # real values, not an all-zero pass
        torch.testing.assert_close(per_sequence, masked, atol=1e-6, rtol=1e-6, msg=name)


def test_packed_policy_gives_the_padded_log_probs_entropy_loss_and_gradients(tiny_model_dir):
    init_process_group(CPU)
    engines = {}
    for packed in (False, True):
        lm = load_causal_lm(str(tiny_model_dir), torch.float32)
        engines[packed] = TrainEngine(PolicyModel(lm, packed), CPU, OptimConfig(lr=0.0, grad_clip=0.0), total_steps=1)
    batch = ragged_batch(engines[True].module.lm.config.vocab_size)
    mask = batch.batch["response_mask"].bool()
    out = {p: e.infer(batch, micro_batch_size=4, calc_entropy=True) for p, e in engines.items()}
    for key in ("log_prob", "entropy"):
        torch.testing.assert_close(out[True][key][mask], out[False][key][mask], atol=1e-5, rtol=0)
        assert out[True][key][~mask].abs().max() == 0  # no output projection at response padding
    assert out[False]["log_prob"][mask].min() < -1  # real values, not an all-zero pass

    def loss_fn(o, micro, num_tokens, num_seqs):
        b = micro.batch
        loss, _ = policy_loss(
            b["old_log_prob"], o["log_prob"], b["advantages"], b["response_mask"], num_tokens=num_tokens
        )
        return loss, {}

    grads = {p: record_grads(e) for p, e in engines.items()}
    metrics = {p: e.train_mini_batch(batch.split(3), loss_fn) for p, e in engines.items()}
    assert abs(metrics[True]["loss"] - metrics[False]["loss"]) < 1e-5
    assert abs(metrics[True]["grad_norm"] - metrics[False]["grad_norm"]) < 1e-5
    assert metrics[False]["grad_norm"] > 1e-3
    assert len(grads[True]) == len(grads[False]) > 0
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-5, rtol=0)


def test_packed_critic_and_reward_model_give_the_padded_values_and_scores(tiny_model_dir):
    batch = ragged_batch(vocab=64)
    b = batch.batch
    inputs = (b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE_LEN)
    torch.manual_seed(0)  # the same fresh heads for both
    critics = {p: ValueModel(load_critic(str(tiny_model_dir)), p) for p in (False, True)}
    critics[True].load_state_dict(critics[False].state_dict())
    scorers = {p: ScoreModel(load_reward_model(str(tiny_model_dir)), p) for p in (False, True)}
    scorers[True].load_state_dict(scorers[False].state_dict())
    mask = b["response_mask"].bool()
    with torch.no_grad():
        values = {p: m.eval()(*inputs)["values"] for p, m in critics.items()}
        scores = {p: m.eval()(*inputs)["scores"] for p, m in scorers.items()}
    torch.testing.assert_close(values[True][mask], values[False][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(scores[True], scores[False], atol=1e-5, rtol=0)
    assert scores[False].abs().max() > 1e-4


def test_a_ppo_step_packed_or_in_token_budget_micro_batches_gives_the_padded_step(tiny_config):
    """Actor (KL to the reference) and critic through the workers: the same losses, KL and values padded, packed,
    and packed in micro-batches of at most 40 tokens (update, old-log-prob and reference passes, the critic's)."""
    from ketch.trainer.ppo import PPOTrainer

    runs = {
        "padded": ["model.use_remove_padding=false"],
        "packed": ["model.use_remove_padding=true"],
        "budget": [
            "model.use_remove_padding=true",
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_device=40",
        ],
    }
    metrics = {}
    for name, overrides in runs.items():
        config = tiny_config(
            "trainer.total_steps=1", "algorithm.use_kl_in_reward=true", *overrides, f"trainer.experiment_name={name}"
        )
        trainer = PPOTrainer(config)
        trainer._open()
        metrics[name] = trainer._train_step(trainer.loader.next_batch(), 1)
        heads = (trainer.actor_rollout.worker.actor.module, trainer.critic.worker.critic.module)
        assert [head.packed for head in heads] == [name != "padded"] * 2
        trainer.groups.shutdown()
    assert metrics["padded"]["response_length/mean"] < 8  # ragged responses: there is padding to remove
    keys = ("actor/pg_loss", "actor/reward_kl_penalty", "critic/vf_loss", "critic/values/mean", "actor/entropy")
    for name in ("packed", "budget"):
        for key in keys:
            assert metrics[name][key] == pytest.approx(metrics["padded"][key], abs=1e-5), (name, key)
