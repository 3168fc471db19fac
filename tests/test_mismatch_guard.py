"""The first step's guard (`actor.mismatch_check`): the rollout's log-probs of the sampled tokens against the actor's
training forward, on a tiny model whose attention dropout ketch is kept from turning off."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from ketch.data import build_char_tokenizer
from ketch.determinism import RandomForwardError, disable_dropout, keep_in_eval
from ketch.models import build_tiny_model
from ketch.protocol import DataProto
from ketch.trainer.mismatch_guard import RolloutMismatchError, measure, verdict
from ketch.trainer.ppo import PPOTrainer


@pytest.fixture
def dropout_model_dir(tiny_model_dir, tmp_path):
    """The tests' tiny Qwen2 with attention dropout 0.5 in its config."""
    out = shutil.copytree(tiny_model_dir, tmp_path / "dropout")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.5}))
    return out


def _first_step(tiny_config, model_dir, *overrides):
    trainer = PPOTrainer(
        tiny_config(f"model.path={model_dir}", "algorithm.adv_estimator=grpo", "rollout.n=2", *overrides)
    )
    trainer._open()
    try:
        return trainer._train_step(trainer.loader.next_batch(), 1)
    finally:
        trainer.groups.shutdown()


MESSAGE = re.compile(
    r"the rollout's probabilities of the sampled tokens differ from the training forward's at the first step: "
    r"Qwen2ForCausalLM \(model_type='qwen2'\), largest gap (?P<gap>[0-9.e-]+) \(mean [0-9.e-]+; rounding in float32 "
    r"explains up to 0.001, mean 0.0001\), at row (?P<row>\d+), response token (?P<token>\d+) \(rollout [0-9.]+, "
    r"training forward [0-9.]+, its eval mode [0-9.]+\); the model itself differs: its training-mode forward computes "
    r"otherwise than its eval mode \(dropout or noise that ketch did not turn off; set it to 0 with "
    r"model.override_config\); actor.mismatch_check=warn logs this and trains on"
)


def test_a_model_whose_dropout_stays_on_stops_at_the_first_step(tiny_config, dropout_model_dir, monkeypatch):
    """With ketch's dropout removal kept from running, the update's training-mode forward drops attention weights:
    the run stops before its first update, naming the family, the gap, the token and the model as the side."""
    monkeypatch.setattr("ketch.engine.heads.disable_dropout", lambda model: [])
    with pytest.raises(RolloutMismatchError) as failure:
        _first_step(tiny_config, dropout_model_dir)
    found = MESSAGE.fullmatch(str(failure.value))
    assert found, str(failure.value)
    assert float(found["gap"]) > 1e-3
    assert 0 <= int(found["row"]) < 16 and 0 <= int(found["token"]) < 8


def test_warn_logs_the_mismatch_and_trains_on(tiny_config, dropout_model_dir, monkeypatch, caplog):
    monkeypatch.setattr("ketch.engine.heads.disable_dropout", lambda model: [])
    with caplog.at_level(logging.WARNING, logger="ketch"):
        metrics = _first_step(tiny_config, dropout_model_dir, "actor.mismatch_check=warn")
    assert [bool(MESSAGE.fullmatch(r.getMessage())) for r in caplog.records if "first step" in r.getMessage()] == [True]
    assert math.isfinite(metrics["actor/pg_loss"])


def test_the_same_model_with_ketchs_dropout_removal_passes(tiny_config, dropout_model_dir):
    metrics = _first_step(tiny_config, dropout_model_dir)
    assert metrics["training/rollout_probs_diff_max"] < 1e-5


def test_measure_finds_the_largest_gap_its_mean_and_its_token():
    """Probabilities (rollout, training, eval) at three sampled tokens; the fourth is masked out."""
    rollout = torch.tensor([[0.5, 0.2], [0.9, 0.3]]).log()
    train = torch.tensor([[0.5, 0.25], [0.6, 0.9]]).log()
    evaluated = torch.tensor([[0.5, 0.2], [0.9, 0.3]]).log()
    mask = torch.tensor([[1, 1], [1, 0]])
    m = measure(rollout, train, evaluated, mask)
    assert (m.row, m.token) == (1, 0)
    assert m.largest == pytest.approx(0.3)
    assert m.mean == pytest.approx((0.0 + 0.05 + 0.3) / 3)
    assert (m.rollout, m.train, m.eval) == pytest.approx((0.9, 0.6, 0.9))


def test_an_fp8_rollouts_gap_passes_and_the_models_own_noise_still_stops_it(tiny_model_dir):
    """With `rollout.quantization=fp8` (or an FP8 KV cache) the rollout's gap is FP8's (0.3 here, corrected by
    truncated importance sampling): only the training forward against its eval mode counts, in bf16 within (0.5,
    0.01)."""
    from ketch.config import load_config

    overrides = [
        f"model.path={tiny_model_dir}",
        "rollout.quantization=fp8",
        "trainer.device=cuda",
        "model.dtype=bfloat16",
    ]
    fp8, plain = (load_config(overrides=o) for o in (overrides, overrides[:1] + overrides[2:]))
    rollout = torch.tensor([[0.5, 0.2], [0.9, 0.3]]).log()
    train = torch.tensor([[0.5, 0.25], [0.6, 0.3]]).log()
    batch = DataProto.from_single_dict({"rollout_log_probs": rollout, "response_mask": torch.ones(2, 2)})
    forwards = DataProto.from_single_dict({"train_log_prob": train, "eval_log_prob": train})
    forwards.meta_info["fast_paths"] = ["the static decoder"]
    cache = load_config(overrides=[*overrides[:1], "rollout.kv_cache_dtype=fp8", *overrides[2:]])
    for config in (fp8, cache):
        assert verdict(batch, forwards, "Qwen2ForCausalLM", config) == (
            measure(train, train, train, torch.ones(2, 2)),
            None,
        )
    mismatch, message = verdict(batch, forwards, "Qwen2ForCausalLM", plain)
    assert mismatch.mean == pytest.approx(0.0875) and message.startswith("the rollout's probabilities")
    noisy = DataProto.from_single_dict({"train_log_prob": train, "eval_log_prob": rollout})
    noisy.meta_info["fast_paths"] = []
    mismatch, message = verdict(batch, noisy, "Qwen2ForCausalLM", fp8)
    assert mismatch.largest == pytest.approx(0.3) and message.startswith(
        "with rollout.quantization=fp8 (whose gap actor.rollout_is corrects) the eval mode's probabilities of the "
        "sampled tokens differ from the training forward's at the first step: Qwen2ForCausalLM, largest gap 0.3"
    )
    assert "the model itself differs" in message


class _Noisy(torch.nn.Module):
    """Adds noise in training mode under a name no dropout rule knows."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, hidden):
        return hidden + self.scale * torch.randn_like(hidden) if self.training else hidden


def test_a_module_random_in_training_mode_under_any_name_stays_in_eval_mode_while_the_blocks_train():
    """A noise module no dropout rule names: it reads its training flag, so it stays in eval mode, while the decoder
    blocks (whose flag transformers' gradient checkpointing reads) train; two training-mode forwards then agree."""
    model = build_tiny_model(build_char_tokenizer(), hidden_size=32, intermediate_size=64, num_layers=2)
    model.model.norm = torch.nn.Sequential(model.model.norm, _Noisy())
    eval_only = disable_dropout(model)
    model.train()
    keep_in_eval(eval_only)
    assert not model.model.norm[1].training and model.model.layers[0].training and model.model.norm.training
    tokens = torch.arange(1, 9)[None]
    torch.testing.assert_close(model(input_ids=tokens).logits, model(input_ids=tokens).logits, atol=0, rtol=0)


def test_a_noise_rate_that_the_eval_mode_computes_with_is_kept():
    """PhiMoE's router jitter (0.01) also decides, in eval mode, which experts share a token: set to 0 it would change
    the model the rollout samples from, so it stays; its router, which samples experts in training mode, stays in
    eval mode."""
    from families import tiny_family_config

    config = tiny_family_config("phimoe", build_char_tokenizer())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:  # experts 0 and 1 within 1% of each other: inside the jitter's margin of 2%
        layer.mlp.router.weight.data[1] = layer.mlp.router.weight.data[0] * 1.01
    before = model.eval()(input_ids=torch.arange(1, 9)[None]).logits
    eval_only = disable_dropout(model)
    assert model.config.router_jitter_noise == 0.01
    model.train()
    keep_in_eval(eval_only)
    assert not model.model.layers[0].mlp.router.training
    torch.testing.assert_close(model(input_ids=torch.arange(1, 9)[None]).logits, before, atol=0, rtol=0)


def test_a_forward_random_in_every_mode_is_refused_naming_the_family():
    model = build_tiny_model(build_char_tokenizer(), hidden_size=32, intermediate_size=64, num_layers=2)
    original = model.model.norm.forward
    model.model.norm.forward = lambda hidden: original(hidden + torch.randn_like(hidden))
    with pytest.raises(RandomForwardError, match=r"^Qwen2ForCausalLM \(model_type='qwen2'\) computes other logits"):
        disable_dropout(model)


def test_a_bare_off_on_the_command_line_turns_the_check_off():
    """YAML reads a bare `off` as false: a key whose values include "off" takes it as "off"."""
    from ketch.config import load_config

    assert load_config(overrides=["actor.mismatch_check=off"]).actor.mismatch_check == "off"


def test_the_doctors_check_on_two_prompts(tiny_config, dropout_model_dir, monkeypatch):
    """`check_two_prompts` (for `ketch doctor`): within rounding on the model as ketch trains it, and the run's message
    once its dropout stays on."""
    from ketch.trainer.mismatch_guard import check_two_prompts

    mismatch, message = check_two_prompts(tiny_config(f"model.path={dropout_model_dir}"))
    assert mismatch.largest < 1e-5 and message is None
    monkeypatch.setattr("ketch.engine.heads.disable_dropout", lambda model: [])
    mismatch, message = check_two_prompts(tiny_config(f"model.path={dropout_model_dir}"))
    assert mismatch.largest > 1e-3 and MESSAGE.fullmatch(message), message
