"""Stop tokens and the pad token come from the tokenizer and the model's generation config together: a model
whose `generation_config.json` names an EOS that the tokenizer does not stops at it in every `hf` decoding,
in the run's `vllm_engine_config.json` and in the export; padding never uses a token that opens a turn."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ketch.config import derive_batch_plan
from ketch.controller import LocalWorkerGroup
from ketch.data import RLHFDataset, build_char_tokenizer
from ketch.models import (
    ModelLoadError,
    ensure_eos_token,
    ensure_pad_token,
    load_tokenizer,
    stop_token_ids,
    turn_start_ids,
)
from ketch.protocol import DataProto
from ketch.trainer.export import export_checkpoint
from ketch.trainer.ppo import PPOTrainer
from ketch.workers import ActorRolloutRefWorker

HASH = 8
"""The character tokenizer's id of '#', frequent in the tiny random model's output; the tokenizer's EOS is 1."""


def generate(config, rows: int = 16):
    """Responses of the actor worker's rollout to the first `rows` training prompts."""
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, config.model.path, derive_batch_plan(config), 10)
    group.init_model()
    dataset = RLHFDataset(config.data.train_files, build_char_tokenizer(), config.data)
    batch = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(rows)]))
    return group.generate_sequences(batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"])).batch


def write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content))


@pytest.fixture(scope="module")
def hash_eos_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny model with `generation_config.json` listing '#' as a second EOS (the tokenizer names only 1)."""
    out = tmp_path_factory.mktemp("hash-eos") / "model"
    shutil.copytree(tiny_model_dir, out)
    write_json(out / "generation_config.json", {"eos_token_id": [1, HASH], "pad_token_id": 0})
    return out


def test_stop_tokens_are_the_tokenizer_eos_then_the_generation_config_then_the_config(tmp_path):
    tokenizer = build_char_tokenizer()
    write_json(tmp_path / "config.json", {"eos_token_id": 7})
    assert stop_token_ids(tokenizer, str(tmp_path), [9, 1]) == [1, 7, 9], "config.json when no generation config"
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [5, 1, 6]})
    assert stop_token_ids(tokenizer, str(tmp_path), [9]) == [1, 5, 6, 9]
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 4})
    assert stop_token_ids(tokenizer, str(tmp_path)) == [1, 4]


@pytest.mark.parametrize("decoding", ["generate", "static"])
def test_a_generation_config_eos_the_tokenizer_does_not_name_ends_responses(tiny_config, hash_eos_model_dir, decoding):
    config = tiny_config(
        f"model.path={hash_eos_model_dir}", "data.max_response_length=12", f"rollout.hf_decoding={decoding}"
    )
    out = generate(config)
    responses, mask = out["responses"], out["response_mask"]
    stopped = 0
    for row, row_mask in zip(responses, mask, strict=True):
        length = int(row_mask.sum())
        hashes = (row[:length] == HASH).nonzero().flatten().tolist()
        if hashes:
            assert hashes == [length - 1], "the response ends with its first '#', which stays in it"
            stopped += 1
        assert (row[length:] == 0).all(), "nothing after the stop token"
    assert stopped > 0, "no response said #"


def test_the_run_and_its_export_stop_at_the_generation_config_eos(tiny_config, hash_eos_model_dir, tmp_path):
    config = tiny_config(f"model.path={hash_eos_model_dir}", "rollout.stop_token_ids=[9]", "trainer.total_steps=1")
    trainer = PPOTrainer(config)
    trainer.fit()
    checkpoint = trainer.run_dir / "checkpoints" / "global_step_1"
    engine = json.loads((checkpoint / "vllm_engine_config.json").read_text())
    assert engine["stop_token_ids"] == [1, HASH, 9]
    out = export_checkpoint(checkpoint, tmp_path / "export")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, HASH, 9]
    assert generation["pad_token_id"] == 0


def chatml_tokenizer_without_pad(eos: str):
    """Ids: `<|im_start|>` 0, `<|im_end|>` 1, `<pad>` 2, `<eos>` 3, `<bos>` 4, then the characters (102 tokens);
    no pad token, EOS `eos` (a converted tokenizer may name `<|im_start|>` as EOS)."""
    tokenizer = build_char_tokenizer(extra_specials=("<|im_start|>", "<|im_end|>"), chat_template="chatml")
    tokenizer.pad_token = None
    tokenizer.eos_token = eos
    return tokenizer


def test_turn_starts_are_bos_and_start_tokens():
    assert turn_start_ids(chatml_tokenizer_without_pad("<eos>")) == {0, 4}


def test_an_eos_that_opens_a_turn_becomes_the_generation_configs_eos(tmp_path, caplog):
    tokenizer = chatml_tokenizer_without_pad("<|im_start|>")
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [0, 1]})
    with caplog.at_level(logging.INFO, logger="ketch.models"):
        ensure_eos_token(tokenizer, str(tmp_path))
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 1), "0 is <|im_start|>: skipped"
    assert "names EOS '<|im_start|>'; using the generation config's '<|im_end|>'" in caplog.text
    tokenizer = chatml_tokenizer_without_pad("<eos>")
    ensure_eos_token(tokenizer, str(tmp_path))
    assert tokenizer.eos_token == "<eos>", "an EOS that opens no turn stays"


def test_the_generation_configs_pad_is_preferred(tmp_path):
    tokenizer = chatml_tokenizer_without_pad("<|im_start|>")
    write_json(tmp_path / "generation_config.json", {"eos_token_id": 1, "pad_token_id": 2})
    ensure_pad_token(tokenizer, str(tmp_path))
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", 2)


def test_an_eos_pads_but_never_one_that_opens_a_turn(tmp_path, caplog):
    tokenizer = chatml_tokenizer_without_pad("<|im_start|>")
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [0, 1]})
    with caplog.at_level(logging.INFO, logger="ketch.models"):
        ensure_pad_token(tokenizer, str(tmp_path))
        ensure_pad_token(chatml_tokenizer_without_pad("<|im_start|>"), str(tmp_path))
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 1)
    assert caplog.text.count("padding with '<|im_end|>' (an EOS token of the model)") == 1, "said once"


def test_a_pad_token_is_added_when_no_eos_can_pad(tmp_path):
    tokenizer = chatml_tokenizer_without_pad("<|im_start|>")
    write_json(tmp_path / "config.json", {"eos_token_id": 0, "vocab_size": 128})
    ensure_pad_token(tokenizer, str(tmp_path))
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|ketch_pad|>", 102)


def test_no_room_for_a_pad_token_is_an_error_naming_the_model(tmp_path):
    tokenizer = chatml_tokenizer_without_pad("<|im_start|>")
    tokenizer.save_pretrained(tmp_path)
    write_json(tmp_path / "config.json", {"eos_token_id": 0, "vocab_size": 102})
    with pytest.raises(ModelLoadError, match=f"tokenizer of {tmp_path}.*no room for a new token.*pad_token"):
        load_tokenizer(str(tmp_path))
