"""Every example config loads and validates under the command its header names (`ketch <command> --config-path`)."""

import re
from pathlib import Path

import pytest
import yaml

from ketch.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(ROOT.glob("examples/**/*.yaml"))


def test_the_examples_are_found():
    assert {p.parent.name for p in EXAMPLES} == {"examples", "gsm8k", "builtin", "own_data"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_an_example_config_loads_for_its_command(path):
    command = re.search(r"ketch (train|sft|rm) --config-path", path.read_text())
    assert command is not None, f"{path} names no `ketch <command> --config-path` line"
    config = load_config(path, command=command.group(1))
    assert config.trainer.experiment_name == yaml.safe_load(path.read_text())["trainer"]["experiment_name"]
