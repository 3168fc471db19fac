"""The built-in model resolves through `ketch.trainer.builtin`; `SFTTrainer` takes the resolved path."""

from __future__ import annotations

import pytest

from ketch.config import load_config
from ketch.trainer.builtin import resolve_model_path
from ketch.trainer.sft import SFTTrainer


def test_sft_on_the_unresolved_builtin_model_says_how_to_resolve_it():
    with pytest.raises(ValueError, match=r"model.path=builtin:tiny-arithmetic must be resolved first"):
        SFTTrainer(load_config(command="sft"))


def test_a_local_model_path_resolves_to_its_absolute_path(tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tiny_model_dir.parent)
    config = load_config(overrides=[f"model.path={tiny_model_dir.name}"])
    assert resolve_model_path(config) == str(tiny_model_dir.resolve())
