"""KL estimators, KL coefficient controllers and the in-reward KL penalty."""

import math

import pytest
import torch
from torch.testing import assert_close

from ketch.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from ketch.protocol import DataProto

# d = log_prob − ref_log_prob = [0.5, −1, 5, −5]
LOG_PROB = torch.tensor([[-1.0, -2.0, -1.0, -6.0]])
REF_LOG_PROB = torch.tensor([[-1.5, -1.0, -6.0, -1.0]])


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("kl", "k1"), [0.5, -1.0, 5.0, -5.0]),
        (("abs",), [0.5, 1.0, 5.0, 5.0]),
        (("mse", "k2"), [0.125, 0.5, 12.5, 12.5]),
        # exp(−d) + d − 1: e^−0.5 − 0.5, e − 2, e^−5 + 4, e^5 − 6 = 142.4 clamped to 10
        (("low_var_kl", "k3"), [math.exp(-0.5) - 0.5, math.e - 2, math.exp(-5) + 4, 10.0]),
    ],
)
def test_each_kl_kind_and_its_alias(kinds, expected):
    for kind in kinds:
        assert_close(kl_penalty(LOG_PROB, REF_LOG_PROB, kind), torch.tensor([expected]))


def test_low_var_kl_has_a_finite_gradient_far_from_the_reference():
    log_prob = torch.tensor([[-100.0, 0.0]], requires_grad=True)
    kl_penalty(log_prob, torch.tensor([[0.0, -100.0]]), "low_var_kl").sum().backward()
    assert log_prob.grad.isfinite().all()


def test_unknown_kl_kind_lists_the_kinds():
    with pytest.raises(ValueError, match=r"unknown KL kind 'kl3'; choose one of kl, k1, abs, mse, k2, low_var_kl, k3"):
        kl_penalty(LOG_PROB, REF_LOG_PROB, "kl3")


def test_fixed_controller_never_changes():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_moves_proportionally_to_the_kl_error():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)  # error clip(0.5) = 0.2 → × (1 + 0.2·10/100) = 1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.09, n_steps=10)  # error −0.1 → × 0.99
    assert ctrl.value == pytest.approx(0.10098)


def test_adaptive_controller_error_is_clipped_to_twenty_percent_both_ways():
    low = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    low.update(current_kl=0.0, n_steps=10)  # error −1 clipped to −0.2 → × 0.98
    high = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    high.update(current_kl=5.0, n_steps=10)  # error 49 clipped to 0.2 → × 1.02
    assert (low.value, high.value) == (pytest.approx(0.098), pytest.approx(0.102))


def test_adaptive_controller_refuses_a_zero_target():
    with pytest.raises(ValueError, match=r"target_kl > 0 and horizon > 0 .* got target_kl=0"):
        AdaptiveKLController(0.1, target_kl=0, horizon=100)


def test_controller_state_round_trips_through_a_checkpoint():
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)
    restored = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value and restored.state_dict() == {"value": ctrl.value}


def test_build_kl_controller_by_type():
    assert type(build_kl_controller("fixed", 0.01)) is FixedKLController
    adaptive = build_kl_controller("adaptive", 0.01, target_kl=0.2, horizon=50)
    assert (type(adaptive), adaptive.value, adaptive.target_kl, adaptive.horizon) == (
        AdaptiveKLController,
        0.01,
        0.2,
        50,
    )
    with pytest.raises(ValueError, match="unknown KL controller type 'pid'"):
        build_kl_controller("pid", 0.01)


def test_apply_kl_penalty_subtracts_beta_kl_at_valid_tokens_and_updates_the_controller():
    # kl = old − ref = [0.5, 0, (masked)]; β = 0.1 → rewards [0 − 0.05, 0, 1 unchanged]
    batch = DataProto.from_dict(
        {
            "token_level_scores": torch.tensor([[0.0, 0.0, 1.0]]),
            "old_log_prob": torch.tensor([[-1.0, -1.0, -1.0]]),
            "ref_log_prob": torch.tensor([[-1.5, -1.0, -2.0]]),
            "response_mask": torch.tensor([[1, 1, 0]]),
        }
    )
    ctrl = AdaptiveKLController(0.1, target_kl=0.2, horizon=10)
    out, metrics = apply_kl_penalty(batch, ctrl, kind="kl")
    assert_close(out.batch["token_level_rewards"], torch.tensor([[-0.05, 0.0, 1.0]]))
    # mean KL per valid token (0.5 + 0) / 2 = 0.25; error clip(0.25/0.2 − 1) = 0.2 → β × (1 + 0.2·1/10)
    assert metrics == {"actor/reward_kl_penalty": 0.25, "actor/reward_kl_penalty_coeff": 0.1}
    assert ctrl.value == pytest.approx(0.102)
    assert "token_level_rewards" not in batch.batch


def test_apply_kl_penalty_names_a_missing_key():
    batch = DataProto.from_dict({"token_level_scores": torch.zeros(1, 2), "response_mask": torch.ones(1, 2)})
    with pytest.raises(ValueError, match=r"apply_kl_penalty needs batch.batch\['old_log_prob'\]"):
        apply_kl_penalty(batch, FixedKLController(0.1))
