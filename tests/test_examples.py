"""Every example config loads and validates under the command its header names (`ketch <command> --config-path`)."""

import re
from pathlib import Path

import pytest
import yaml

from ketch.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(ROOT.glob("examples/**/*.yaml"))


def test_the_examples_are_found():
    assert {p.parent.name for p in EXAMPLES} == {"examples", "gsm8k", "math", "builtin", "own_data"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_an_example_config_loads_for_its_command(path):
    command = re.search(r"ketch (train|sft|rm) --config-path", path.read_text())
    assert command is not None, f"{path} names no `ketch <command> --config-path` line"
    config = load_config(path, command=command.group(1))
    assert config.trainer.experiment_name == yaml.safe_load(path.read_text())["trainer"]["experiment_name"]


def test_the_math_rows_score_their_reference_solutions():
    """examples/math/prepare.py: a MATH training problem's ground truth is its solution's last boxed answer, a
    MATH-500 problem's its `answer`; the scorer registered under each row's data_source gives the reference 1.0, a
    wrong answer 0.0, and a solution without an answer leaves its row out."""
    import importlib.util

    from ketch.rewards import compute_score

    spec = importlib.util.spec_from_file_location("prepare", ROOT / "examples/math/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    train = {"problem": "What is $1/2 + 1/4$?", "solution": "We add: $\\boxed{\\frac{3}{4}}$.", "level": "Level 1"}
    test = {"problem": "Compute $2^{10}$.", "solution": "...", "answer": "1024"}
    rows = [prepare.to_row(train, prepare.SOURCES["train"][0], "train", 0)]
    rows.append(prepare.to_row(test, prepare.SOURCES["test"][0], "test", 3))
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["\\frac{3}{4}", "1024"]
    assert rows[0]["prompt"][0]["content"].endswith("final answer within \\boxed{}.")
    answers = ["So $\\boxed{0.75}$.", "It is \\boxed{1024}."]
    for row, answer in zip(rows, answers, strict=True):
        truth = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], answer, truth) == 1.0
        assert compute_score(row["data_source"], "\\boxed{7}", truth) == 0.0
    assert prepare.to_row({"problem": "?", "solution": "no answer"}, "math", "train", 1) is None
