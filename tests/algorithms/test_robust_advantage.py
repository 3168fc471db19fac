"""robust_compute_advantage: estimator on a DataProto, whitening, clipping and non-finite checks."""

import uuid

import pytest
import torch
from torch.testing import assert_close

from ketch.algorithms import (
    NonFiniteError,
    compute_gae,
    compute_grpo_advantage,
    register_adv_estimator,
    robust_compute_advantage,
)
from ketch.protocol import DataProto

NAN = float("nan")


def make_batch(rewards, mask, values=None, uid=None, **meta):
    tensors = {"token_level_rewards": torch.tensor(rewards), "response_mask": torch.tensor(mask)}
    if values is not None:
        tensors["values"] = torch.tensor(values)
    return DataProto.from_dict(tensors, {"uid": uid} if uid is not None else {}, meta)


def random_gae_batch():
    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(6, 5, generator=generator), torch.randn(6, 5, generator=generator)
    mask = (torch.rand(6, 5, generator=generator) > 0.3).int()
    return DataProto.from_dict({"token_level_rewards": rewards, "values": values, "response_mask": mask})


def test_returns_a_new_batch_with_advantages_and_returns_and_leaves_the_input_alone():
    batch = make_batch([[0.0, 0.0, 1.0]], [[1, 1, 1]], values=[[0.5, 0.6, 0.7]], step=3)
    out = robust_compute_advantage(batch, gamma=0.9, lam=0.8, normalize_advantage=False)
    assert type(out) is DataProto and out is not batch
    assert "advantages" not in batch.batch and "non_finite_zeroed" not in batch.meta_info
    assert_close(out.batch["advantages"], torch.tensor([[0.21712, 0.246, 0.3]]))
    assert_close(out.batch["returns"], torch.tensor([[0.71712, 0.846, 1.0]]))
    assert out.meta_info == {"step": 3, "non_finite_zeroed": 0}


def test_gae_advantages_are_whitened_over_valid_tokens():
    batch = random_gae_batch()
    mask = batch.batch["response_mask"].bool()
    adv = robust_compute_advantage(batch, gamma=0.9, lam=0.95).batch["advantages"]
    assert abs(adv[mask].mean().item()) < 1e-5
    assert abs(adv[mask].std().item() - 1) < 1e-4
    assert (adv[~mask] == 0).all()


def test_without_normalize_advantage_gae_is_raw_and_returns_are_never_whitened():
    batch = random_gae_batch()
    raw_adv, raw_ret = compute_gae(
        *(batch.batch[k] for k in ("token_level_rewards", "values", "response_mask")), 0.9, 1
    )
    out = robust_compute_advantage(batch, gamma=0.9, lam=1.0, normalize_advantage=False)
    assert_close(out.batch["advantages"], raw_adv)
    assert_close(robust_compute_advantage(batch, gamma=0.9, lam=1.0).batch["returns"], raw_ret)


def test_grpo_is_not_whitened_even_with_normalize_advantage():
    # group of two with scores 0 and 2: mean 1, std sqrt(2) → ∓1/sqrt(2), not rescaled further
    batch = make_batch([[0.0], [2.0], [5.0]], [[1], [1], [1]], uid=["p", "p", "q"])
    adv = robust_compute_advantage(batch, estimator="grpo").batch["advantages"]
    assert_close(adv, torch.tensor([[-1 / (2**0.5 + 1e-6)], [1 / (2**0.5 + 1e-6)], [5.0]]))


def test_advantages_are_clipped_after_whitening():
    batch = make_batch([[0.0], [2.0], [5.0]], [[1], [1], [1]], uid=["p", "p", "q"])
    adv = robust_compute_advantage(batch, estimator="rloo", clip_advantage=1.5).batch["advantages"]
    assert adv.flatten().tolist() == [-1.5, 1.5, 1.5]  # −2, 2 and the lone 5, clipped


def test_nan_reward_raises_naming_token_level_rewards_and_the_row():
    batch = make_batch([[0.0, 1.0], [0.0, NAN]], [[1, 1], [1, 1]], values=[[0.0, 0.0]] * 2)
    with pytest.raises(NonFiniteError, match=r"token_level_rewards has 1 non-finite .* row\(s\) \[1\]; check the rew"):
        robust_compute_advantage(batch)


def test_the_non_finite_error_is_a_value_error_that_says_how_to_continue():
    batch = make_batch([[float("inf")]], [[1]], values=[[0.0]])
    with pytest.raises(ValueError, match=r"algorithm\.non_finite=zero"):
        robust_compute_advantage(batch)


def test_nan_value_raises_naming_values():
    batch = make_batch([[0.0, 1.0]], [[1, 1]], values=[[NAN, 0.0]])
    with pytest.raises(NonFiniteError, match=r"values has 1 non-finite .* row\(s\) \[0\]; check the critic"):
        robust_compute_advantage(batch)


def test_nan_in_padding_is_not_an_error():
    batch = make_batch([[1.0, NAN]], [[1, 0]], values=[[0.5, NAN]])
    out = robust_compute_advantage(batch, normalize_advantage=False)
    assert out.batch["advantages"].tolist() == [[0.5, 0.0]]


def test_zero_mode_zeroes_and_counts_non_finite_inputs():
    # rewards: one NaN; values: one inf → 2 entries zeroed, then GAE on the cleaned numbers
    batch = make_batch([[1.0, NAN]], [[1, 1]], values=[[float("inf"), 0.0]])
    out = robust_compute_advantage(batch, normalize_advantage=False, non_finite="zero")
    assert out.meta_info["non_finite_zeroed"] == 2
    assert out.batch["token_level_rewards"].tolist() == [[1.0, 0.0]]
    assert out.batch["values"].tolist() == [[0.0, 0.0]]
    assert out.batch["advantages"].tolist() == [[1.0, 0.0]]


def _grpo_without_eps():
    name = f"grpo-eps0-{uuid.uuid4().hex}"

    @register_adv_estimator(name)
    def grpo_eps0(token_level_rewards, response_mask, *, group_ids, **context):
        return compute_grpo_advantage(token_level_rewards, response_mask, group_ids, eps=0.0)

    return name


def test_zero_variance_group_with_eps_zero_raises_naming_the_group():
    batch = make_batch([[1.0], [1.0], [0.0], [1.0]], [[1]] * 4, uid=["same", "same", "mixed", "mixed"])
    with pytest.raises(
        NonFiniteError, match=r"2 non-finite .* row\(s\) \[0, 1\] \(uid group\(s\) \['same'\]\).*zero-var"
    ):
        robust_compute_advantage(batch, estimator=_grpo_without_eps())


def test_zero_mode_zeroes_and_counts_non_finite_advantages():
    batch = make_batch([[1.0], [1.0], [0.0], [1.0]], [[1]] * 4, uid=["same", "same", "mixed", "mixed"])
    out = robust_compute_advantage(batch, estimator=_grpo_without_eps(), non_finite="zero")
    assert out.meta_info["non_finite_zeroed"] == 2
    assert_close(out.batch["advantages"], torch.tensor([[0.0], [0.0], [-(0.5**0.5)], [0.5**0.5]]))


def test_unknown_estimator_lists_the_registered_names():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gea'; registered: gae, grpo"):
        robust_compute_advantage(make_batch([[1.0]], [[1]]), estimator="gea")


def test_gae_without_values_says_it_needs_the_critic():
    with pytest.raises(ValueError, match="'gae' needs values from the critic"):
        robust_compute_advantage(make_batch([[1.0]], [[1]]))


def test_missing_rewards_are_named_with_the_keys_present():
    batch = DataProto.from_dict({"response_mask": torch.ones(1, 2)})
    with pytest.raises(ValueError, match=r"needs batch.batch\['token_level_rewards'\] .* has \['response_mask'\]"):
        robust_compute_advantage(batch)


def test_a_user_registered_estimator_gets_the_context_and_is_whitened_when_registered_so():
    name, seen = f"doubled-{uuid.uuid4().hex}", {}

    @register_adv_estimator(name, whiten=True)
    def doubled(token_level_rewards, response_mask, **context):
        seen.update(context)
        return 2 * token_level_rewards, token_level_rewards

    batch = make_batch([[1.0, 2.0], [3.0, 4.0]], [[1, 1], [1, 0]], uid=["a", "b"])
    raw = robust_compute_advantage(batch, estimator=name, gamma=0.7, normalize_advantage=False)
    assert raw.batch["advantages"].tolist() == [[2.0, 4.0], [6.0, 0.0]]
    assert seen["gamma"] == 0.7 and seen["group_ids"].tolist() == ["a", "b"] and seen["values"] is None
    # valid 2, 4, 6: mean 4, std 2 → −1, 0, 1
    whitened = robust_compute_advantage(batch, estimator=name).batch["advantages"]
    assert_close(whitened, torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))
