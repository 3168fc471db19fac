"""Model and tokenizer loading: config fix-ups, the critic head, and clear errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from ketch.models import ModelLoadError, load_causal_lm, load_critic, load_tokenizer


def test_missing_model_directory_names_the_path_and_the_key(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model path '.*nowhere' is not a directory; check model.path"):
        load_causal_lm(str(tmp_path / "nowhere"))


def _rewrite_config(model_dir, tmp_path, edit) -> str:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def test_a_config_without_rope_settings_loads_with_defaults(tiny_model_dir, tmp_path):
    def drop_rope(config):
        config.pop("rope_scaling", None)
        config.pop("rope_parameters", None)

    model = load_causal_lm(_rewrite_config(tiny_model_dir, tmp_path, drop_rope))
    assert model.config.num_hidden_layers == 2


def test_an_old_style_rope_scaling_with_type_loads(tiny_model_dir, tmp_path):
    def old_rope(config):
        config.pop("rope_parameters", None)
        config["rope_scaling"] = {"type": "linear", "factor": 2.0}
        config["rope_theta"] = 10000.0

    model = load_causal_lm(_rewrite_config(tiny_model_dir, tmp_path, old_rope))
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, model.config.vocab_size)


def test_override_config_is_applied(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), override_config={"attention_dropout": 0.25})
    assert model.config.attention_dropout == 0.25


def test_critic_has_a_scalar_head_on_the_actor_backbone(tiny_model_dir):
    actor = load_causal_lm(str(tiny_model_dir))
    critic = load_critic(str(tiny_model_dir))
    assert critic.score.out_features == 1
    torch.testing.assert_close(critic.model.embed_tokens.weight, actor.model.embed_tokens.weight)
    assert critic(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 1)


def test_a_saved_tokenizer_keeps_its_token_ids_next_to_a_qwen2_config(tiny_model_dir, tmp_path):
    loaded = load_tokenizer(str(tiny_model_dir))
    assert loaded("#### 105")["input_ids"] == [8, 8, 8, 8, 5, 22, 21, 26]
    loaded.save_pretrained(tmp_path / "again")
    (tmp_path / "again" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert load_tokenizer(str(tmp_path / "again")).decode([8, 8, 8, 8, 5, 22, 21, 26]) == "#### 105"


def test_tokenizer_without_pad_token_uses_eos(tiny_model_dir, tmp_path, caplog):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "tok")
    with caplog.at_level(logging.INFO, logger="ketch.models"):
        loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.pad_token_id == loaded.eos_token_id == 1
    assert loaded.padding_side == "left"
    assert f"the tokenizer of {tmp_path / 'tok'} has no pad; padding with '<eos>' (an EOS token of the model)" in (
        caplog.text
    )


def test_a_model_that_soft_caps_its_attention_logits_loads_with_attention_that_keeps_the_cap(
    tiny_model_dir, tmp_path, caplog
):
    """A Gemma 2 whose attention logits are capped at 1.0 (weights large enough for the cap to act): under the
    default `auto` it loads with eager attention and gives eager's logits; SDPA, which leaves the cap out, gives
    logits more than 0.1 away, and asking for it is warned of. A Qwen2 loads with SDPA."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from ketch.models import special_tokens

    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8}
    config = Gemma2Config(
        vocab_size=64, num_attention_heads=4, num_key_value_heads=2, attn_logit_softcapping=1.0, **sizes
    )
    model = Gemma2ForCausalLM(config)
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "gemma2")
    ids = torch.randint(0, 64, (2, 10))
    logits = {}
    for asked in ("auto", "eager", "sdpa"):
        loaded = load_causal_lm(str(tmp_path / "gemma2"), attn_implementation=asked).eval()
        assert loaded.config._attn_implementation == ("eager" if asked == "auto" else asked)
        with torch.no_grad():
            logits[asked] = loaded(ids).logits
    assert torch.equal(logits["auto"], logits["eager"])
    assert (logits["sdpa"] - logits["eager"]).abs().max() > 0.1
    special_tokens._said.clear()  # said once per process: a run of the suite may have said it already
    with caplog.at_level(logging.WARNING, logger="ketch.models"):
        load_causal_lm(str(tmp_path / "gemma2"), attn_implementation="sdpa")
    assert "model.attn_implementation=sdpa leaves out this model's attention soft cap" in caplog.text
    assert load_causal_lm(str(tiny_model_dir)).config._attn_implementation == "sdpa"
