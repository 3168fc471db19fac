import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ketch.data import resolve_data_files
from ketch.data.builtin import ArithmeticTask, generate_arithmetic_task, write_arithmetic_task

SMALL = ArithmeticTask(num_train=200, num_val=20)


def _problems(rows):
    return {row["prompt"] for row in rows}


def test_every_answer_is_correct():
    for rows in generate_arithmetic_task(SMALL).values():
        for row in rows:
            left, op, right = re.fullmatch(r"(\d+)([+-])(\d+)=", row["prompt"]).groups()
            expected = int(left) + int(right) if op == "+" else int(left) - int(right)
            assert row["answer"] == str(expected)
            assert row["response"] == f"#### {expected}"


def test_negative_results_are_written_with_a_minus_sign():
    rows = generate_arithmetic_task(ArithmeticTask(ops=("-",), num_train=200, num_val=0))["train"]
    negative = [row for row in rows if int(row["answer"]) < 0]
    assert negative
    assert all(row["answer"].startswith("-") and row["response"] == f"#### {row['answer']}" for row in negative)


def test_split_sizes():
    splits = generate_arithmetic_task(SMALL)
    assert (len(splits["train"]), len(splits["val"])) == (200, 20)


def test_validation_problems_are_distinct_and_never_trained_on():
    splits = generate_arithmetic_task(SMALL)
    assert len(_problems(splits["val"])) == 20
    assert not _problems(splits["train"]) & _problems(splits["val"])


def _one_digit_sums(rows) -> int:
    return sum(re.fullmatch(r"\d\+\d=", row["prompt"]) is not None for row in rows)


def test_training_problems_are_drawn_like_the_validation_problems():
    # Digit counts are uniform in {1, 2}, so a quarter of all draws are sums of two one-digit numbers, of which
    # there are only 100. The k of them in validation are left out of training, whose draws may repeat the rest:
    # a share of 0.25 * (100 - k) / 100 / (1 - 0.25 * k / 100) of the training problems. Drawn distinct, the
    # 8000 training problems could hold at most the 100 - k left: under 1.3%.
    splits = generate_arithmetic_task(ArithmeticTask(num_train=8000, num_val=400))
    k = _one_digit_sums(splits["val"])
    assert k == 70
    expected = 0.25 * (100 - k) / 100 / (1 - 0.25 * k / 100)  # 0.0909
    assert abs(_one_digit_sums(splits["train"]) / 8000 - expected) < 0.01


def test_same_seed_gives_same_rows():
    assert generate_arithmetic_task(SMALL) == generate_arithmetic_task(ArithmeticTask(num_train=200, num_val=20))


def test_other_seed_gives_other_rows():
    other = generate_arithmetic_task(ArithmeticTask(num_train=200, num_val=20, seed=1))
    assert other["train"] != generate_arithmetic_task(SMALL)["train"]


def test_validation_split_does_not_depend_on_num_train():
    assert (
        generate_arithmetic_task(ArithmeticTask(num_train=50, num_val=20))["val"]
        == (generate_arithmetic_task(SMALL)["val"])
    )


def test_prompts_stay_within_16_characters_at_the_most_digits():
    rows = generate_arithmetic_task(ArithmeticTask(max_digits=7, num_train=200, num_val=0))["train"]
    assert max(len(row["prompt"]) for row in rows) <= 16


def test_operands_have_between_min_and_max_digits():
    rows = generate_arithmetic_task(ArithmeticTask(min_digits=2, max_digits=2, num_train=200, num_val=0))["train"]
    operands = [int(n) for row in rows for n in re.findall(r"\d+", row["prompt"])]
    assert min(operands) >= 10
    assert max(operands) <= 99


def test_row_layout():
    row = generate_arithmetic_task(SMALL)["val"][3]
    assert sorted(row) == ["answer", "data_source", "extra_info", "prompt", "response"]
    assert row["data_source"] == "ketch/arithmetic"
    assert row["extra_info"] == {"index": 3, "split": "val"}


def test_too_many_digits_is_rejected():
    with pytest.raises(ValueError, match="max_digits <= 7"):
        ArithmeticTask(max_digits=8)


def test_unknown_operator_is_rejected():
    with pytest.raises(ValueError, match=r"ops must be distinct operators from \['\+', '-'\]"):
        ArithmeticTask(ops=("*",))


def test_more_problems_than_the_settings_allow_is_rejected():
    with pytest.raises(ValueError, match="asks for 150 distinct validation problems but its settings allow 200"):
        ArithmeticTask(max_digits=1, ops=("+", "-"), num_train=100, num_val=150)


def test_write_arithmetic_task_writes_both_splits(tmp_path: Path):
    paths = write_arithmetic_task(tmp_path / "out", SMALL)
    assert paths == {"train": tmp_path / "out" / "train.parquet", "val": tmp_path / "out" / "val.parquet"}
    assert pq.read_table(paths["train"]).to_pylist() == generate_arithmetic_task(SMALL)["train"]
    assert pq.read_table(paths["val"]).num_rows == 20
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.parquet", "val.parquet"]


def test_resolve_replaces_builtin_entries_with_cached_files(cache: Path):
    files = resolve_data_files(["builtin:arithmetic/train", "other.parquet", "builtin:arithmetic/val"], SMALL)
    folder = cache / "data" / f"arithmetic-{SMALL.settings_hash()}"
    assert files == [str(folder / "train.parquet"), "other.parquet", str(folder / "val.parquet")]
    assert pq.read_table(files[0]).num_rows == 200


def test_resolve_does_not_rewrite_cached_files():
    first = resolve_data_files(["builtin:arithmetic/train"], SMALL)
    before = Path(first[0]).stat().st_mtime_ns
    second = resolve_data_files(["builtin:arithmetic/train"], SMALL)
    assert second == first
    assert Path(second[0]).stat().st_mtime_ns == before


def test_resolve_uses_one_folder_per_setting(cache: Path):
    resolve_data_files(["builtin:arithmetic/val"], SMALL)
    resolve_data_files(["builtin:arithmetic/val"], ArithmeticTask(num_train=200, num_val=20, seed=7))
    assert len(list((cache / "data").iterdir())) == 2


def test_resolve_rejects_an_unknown_builtin_entry():
    with pytest.raises(ValueError, match=r"builtin:arithmetic/test.*builtin:arithmetic/train, builtin:arithmetic/val"):
        resolve_data_files(["builtin:arithmetic/test"], SMALL)
