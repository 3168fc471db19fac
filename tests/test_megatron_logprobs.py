"""Vocabulary-parallel log-probs and entropy: the hand-worked two-token case, and two gloo ranks holding
half the vocabulary each agree with the full-vocabulary softmax in value and gradient."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from ketch.engine.megatron.logprobs import vocab_parallel_log_probs


def test_two_token_vocabulary_by_hand():
    # logits [0, ln 3]: p = [1/4, 3/4]; log p(1) = ln 0.75; entropy = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623
    log_prob, entropy = vocab_parallel_log_probs(
        torch.tensor([[0.0, math.log(3)]]), torch.tensor([1]), 0, calc_entropy=True
    )
    assert log_prob.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert entropy.item() == pytest.approx(0.5623351, abs=1e-6)


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
    torch.save((log_prob.detach(), entropy.detach(), mine.grad), f"{out}/{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_with_half_the_vocabulary_each_match_the_full_softmax(tmp_path):
    mp.start_processes(_rank, args=(29581, str(tmp_path)), nprocs=2, start_method="spawn")
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 8) * 3, torch.randint(0, 8, (3, 5))
    full = logits.clone().requires_grad_()
    log_prob, entropy = _full(full, labels)
    (log_prob.sum() + 0.5 * entropy.sum()).backward()
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for lp, ent, _ in ranks:
        torch.testing.assert_close(lp, log_prob.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, entropy.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([g for _, _, g in ranks], -1), full.grad, rtol=0, atol=1e-5)
