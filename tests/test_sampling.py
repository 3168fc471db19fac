"""Sampling on the device for static decoding: greedy, temperature, top-k and top-p with hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from ketch.rollout.sampling import Sampling, _filter

LOGITS = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])


def test_greedy_takes_the_argmax_and_reports_its_log_prob():
    token, log_prob = Sampling(do_sample=False).sample(LOGITS)
    assert token.tolist() == [0]
    assert log_prob.item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_top_k_2_keeps_the_two_most_likely_tokens():
    kept = _filter(LOGITS.clone(), top_k=2, top_p=1.0)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 alone < 0.7; 0.5 + 0.3 = 0.8 >= 0.7: the nucleus is the first two tokens.
    kept = _filter(LOGITS.clone(), top_k=0, top_p=0.7)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_filter(LOGITS.clone(), top_k=0, top_p=0.85)).tolist() == [[True, True, True, False]]


def test_sampled_log_prob_is_under_the_temperature_not_the_filter():
    torch.manual_seed(0)
    token, log_prob = Sampling(True, temperature=2.0, top_k=1).sample(LOGITS)
    expected = (LOGITS / 2.0).log_softmax(-1)[0, 0].item()  # top-k 1 picks token 0; log-prob of T=2 softmax
    assert token.tolist() == [0] and abs(log_prob.item() - expected) < 1e-6


def test_sampling_frequencies_follow_the_distribution():
    torch.manual_seed(0)
    logits = LOGITS.expand(20000, 4)
    tokens, _ = Sampling(True).sample(logits)
    frequencies = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)
