"""Vocabulary-parallel log-probs and entropy: the hand-worked two-token case, the chunked projection from
hidden states (by hand, and empty), and two gloo ranks holding half the vocabulary each agree with the
full-vocabulary softmax in value and gradient."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from spawned import end_rank

from ketch.engine.megatron.vocab_parallel_log_probs import (
    chunked_vocab_parallel_log_probs,
    sum_grad_over_ranks,
    vocab_parallel_log_probs,
)


def test_two_token_vocabulary_by_hand():
    # logits [0, ln 3]: p = [1/4, 3/4]; log p(1) = ln 0.75; entropy = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623
    log_prob, entropy = vocab_parallel_log_probs(
        torch.tensor([[0.0, math.log(3)]]), torch.tensor([1]), 0, calc_entropy=True
    )
    assert log_prob.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert entropy.item() == pytest.approx(0.5623351, abs=1e-6)


def test_chunked_projection_by_hand_one_token_per_chunk():
    # weight rows [0], [ln 3]; states 1 and 2 give logits [0, ln 3] (p = 1/4, 3/4) and [0, 2 ln 3] (1/10, 9/10)
    states = torch.tensor([[1.0], [2.0]], requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3)]])
    log_prob, entropy = chunked_vocab_parallel_log_probs(
        states, torch.tensor([1, 0]), weight, 0, calc_entropy=True, chunk=1
    )
    torch.testing.assert_close(log_prob, torch.tensor([math.log(0.75), math.log(0.1)]))
    # -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351; -(0.1 ln 0.1 + 0.9 ln 0.9) = 0.3250830
    torch.testing.assert_close(entropy, torch.tensor([0.5623351, 0.3250830]))
    log_prob.sum().backward()
    # d log p(label) / d state = sum_v (onehot - p)_v w_v: 0.25 ln 3 = 0.2746531 and -0.9 ln 3 = -0.9887511
    torch.testing.assert_close(states.grad, torch.tensor([[0.2746531], [-0.9887511]]))


def test_chunked_projection_of_no_tokens_is_empty_and_differentiable():
    states = torch.zeros(0, 3, requires_grad=True)
    log_prob, entropy = chunked_vocab_parallel_log_probs(
        states, torch.zeros(0, dtype=torch.long), torch.ones(4, 3), 0, calc_entropy=True
    )
    assert log_prob.shape == entropy.shape == (0,)
    log_prob.sum().backward()
    assert states.grad.shape == (0, 3)


def _full(logits: torch.Tensor, labels: torch.Tensor):
    log_softmax = torch.log_softmax(logits, -1)
    return log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_softmax.exp() * log_softmax).sum(-1)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 8) * 3, torch.randint(0, 8, (3, 5))
    mine = logits[..., 4 * rank : 4 * rank + 4].clone().requires_grad_()
    log_prob, entropy = vocab_parallel_log_probs(mine, labels, 4 * rank, calc_entropy=True)
    (log_prob.sum() + 0.5 * entropy.sum()).backward()
    states, weight = _projection()
    chunked = chunked_vocab_parallel_log_probs(
        states, labels.flatten(), weight[4 * rank : 4 * rank + 4], 4 * rank, chunk=4
    )
    chunked[0].sum().backward()
    # as in the engine: Megatron's `[seq, batch, hidden]` states through the head, the `[batch, seq]` transpose of
    # GPTModel's output projected; the gradient reaching the head is a (non-contiguous) transpose
    replicated = _projection()[0].detach().view(3, 5, 6).transpose(0, 1).contiguous().requires_grad_()
    hidden = sum_grad_over_ranks(replicated).transpose(0, 1).contiguous().flatten(0, 1)
    weight_slice = weight[4 * rank : 4 * rank + 4]
    chunked_vocab_parallel_log_probs(hidden, labels.flatten(), weight_slice, 4 * rank, chunk=4)[0].sum().backward()
    outputs = (log_prob.detach(), entropy.detach(), mine.grad, chunked[0].detach(), states.grad, replicated.grad)
    torch.save(outputs, f"{out}/{rank}.pt")
    end_rank()


def _projection() -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of the 15 tokens of `_rank` (in chunks of 4 there) and an 8-token output layer."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(15, 6, generator=g).requires_grad_(), torch.randn(8, 6, generator=g)


@pytest.mark.slow
def test_two_ranks_with_half_the_vocabulary_each_match_the_full_softmax(tmp_path):
    mp.start_processes(_rank, args=(29581, str(tmp_path)), nprocs=2, start_method="spawn")
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 8) * 3, torch.randint(0, 8, (3, 5))
    full = logits.clone().requires_grad_()
    log_prob, entropy = _full(full, labels)
    (log_prob.sum() + 0.5 * entropy.sum()).backward()
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for lp, ent, *_ in ranks:
        torch.testing.assert_close(lp, log_prob.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, entropy.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([r[2] for r in ranks], -1), full.grad, rtol=0, atol=1e-5)
    # the chunked projection: each rank's log-probs are the full softmax's, each rank's gradient of the states
    # is its half of the vocabulary's part (the engine sums them over the tensor ranks)
    states, weight = _projection()
    projected = (states @ weight.T).log_softmax(-1).gather(-1, labels.flatten()[:, None]).squeeze(-1)
    projected.sum().backward()
    for r in ranks:
        torch.testing.assert_close(r[3], projected.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ranks[0][4] + ranks[1][4], states.grad, rtol=0, atol=1e-5)
    for r in ranks:  # through `sum_grad_over_ranks`, every rank has the whole gradient
        torch.testing.assert_close(r[5].transpose(0, 1).flatten(0, 1), states.grad, rtol=0, atol=1e-5)
