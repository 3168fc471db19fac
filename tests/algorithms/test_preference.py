"""Bradley–Terry loss, pairwise accuracy, running statistics and the mixing of reward sources, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from ketch.algorithms import RewardMixer, RunningMeanStd, bradley_terry_loss, last_valid_index, pairwise_accuracy

# margins 2, 0, -2: -log σ(2) = log(1 + e^-2) = 0.126928, -log σ(0) = log 2 = 0.693147, -log σ(-2) = 2.126928
CHOSEN = torch.tensor([2.0, 0.0, -1.0])
REJECTED = torch.tensor([0.0, 0.0, 1.0])
LOSSES = [0.12692801104297263, 0.6931471805599453, 2.1269280110429727]


def test_bradley_terry_loss_is_the_mean_negative_log_sigmoid_of_the_margins():
    assert bradley_terry_loss(CHOSEN, REJECTED).item() == pytest.approx(sum(LOSSES) / 3, rel=1e-6)  # 0.982334


def test_pairwise_accuracy_counts_a_tie_as_one_half():
    assert pairwise_accuracy(CHOSEN, REJECTED).item() == pytest.approx((1 + 0.5 + 0) / 3)


def test_with_the_mini_batch_pair_count_the_results_are_shares_that_add_up():
    # Two micro-batches of a mini-batch of 3 pairs: each is divided by 3, and the shares sum to the mean.
    first = bradley_terry_loss(CHOSEN[:2], REJECTED[:2], num_pairs=torch.tensor(3.0))
    second = bradley_terry_loss(CHOSEN[2:], REJECTED[2:], num_pairs=torch.tensor(3.0))
    assert first.item() == pytest.approx((LOSSES[0] + LOSSES[1]) / 3, rel=1e-6)
    assert (first + second).item() == pytest.approx(bradley_terry_loss(CHOSEN, REJECTED).item(), rel=1e-6)
    assert pairwise_accuracy(CHOSEN[:2], REJECTED[:2], num_pairs=3).item() == pytest.approx(1.5 / 3)


def test_the_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    bradley_terry_loss(chosen, rejected).backward()
    # d/d r_chosen of -log σ(m) / 3 is -(1 - σ(m)) / 3: σ(2) = 0.880797, σ(0) = 0.5, σ(-2) = 0.119203
    assert chosen.grad.tolist() == pytest.approx([-0.119203 / 3, -0.5 / 3, -0.880797 / 3], abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([0.119203 / 3, 0.5 / 3, 0.880797 / 3], abs=1e-6)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"must both be \[pairs\]"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))


def test_running_mean_std_merges_batches_like_one_pass():
    stats = RunningMeanStd()
    stats.update(torch.tensor([1.0, 2.0, 3.0]))
    stats.update(torch.tensor([4.0, 5.0]))
    assert (stats.count, stats.mean, stats.std) == (5, pytest.approx(3.0), pytest.approx(math.sqrt(2.0)))
    restored = RunningMeanStd()
    restored.load_state_dict(stats.state_dict())
    assert restored.normalize(torch.tensor([5.0])).item() == pytest.approx(2 / math.sqrt(2.0), rel=1e-5)


RESPONSE_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
RULE = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # sequence scores 1, 0
MODEL = torch.tensor([[0.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])  # sequence scores 2, -1


def test_mixer_weighs_the_sources_and_puts_the_sum_at_the_last_valid_token():
    mixer = RewardMixer({"rule": 1.0, "model": 0.5})
    scores, metrics = mixer(RESPONSE_MASK, RULE, MODEL)
    assert scores.tolist() == [[0.0, 2.0, 0.0], [-0.5, 0.0, 0.0]]  # 1 + 0.5 * 2, 0 + 0.5 * (-1)
    assert metrics == {"reward/rule/mean": 0.5, "reward/model/mean": 0.5, "reward/model/std": 1.5}


def test_mixer_with_the_model_alone_never_needs_rule_scores():
    scores, metrics = RewardMixer({"model": 1.0})(RESPONSE_MASK, None, MODEL)
    assert scores.tolist() == MODEL.tolist() and "reward/rule/mean" not in metrics


def test_mixer_normalises_then_clips_model_scores():
    mixer = RewardMixer({"rule": 1.0, "model": 1.0}, clip=0.5, normalize=True)
    scores, metrics = mixer(RESPONSE_MASK, RULE, MODEL)
    # model scores 2, -1: running mean 0.5, std 1.5 -> normalised 1, -1 -> clipped 0.5, -0.5 (both clipped)
    assert scores.sum(-1).tolist() == pytest.approx([1.5, -0.5], abs=1e-5)
    assert metrics["reward/model/running_mean"] == pytest.approx(0.5)
    assert metrics["reward/model/running_std"] == pytest.approx(1.5)
    assert metrics["reward/model/clipfrac"] == 1.0
    assert mixer.state_dict() == {"stats": {"count": 2, "mean": 0.5, "m2": 4.5}}
    mixer(RESPONSE_MASK, RULE, MODEL, update_stats=False)
    assert mixer.stats.count == 2, "a baseline pass does not move the statistics"


def test_mixer_needs_the_scores_of_every_weighted_source():
    with pytest.raises(ValueError, match="model reward has a non-zero weight but no model scores"):
        RewardMixer({"rule": 1.0, "model": 1.0})(RESPONSE_MASK, RULE, None)
    with pytest.raises(ValueError, match=r"unknown reward sources \['human'\]"):
        RewardMixer({"human": 1.0})


def test_last_valid_index_of_right_padded_rows():
    assert last_valid_index(torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])).tolist() == [1, 0, 2]
