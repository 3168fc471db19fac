"""The built-in visual task (`builtin:dots`), its scorer, SFT with images on the tiny Qwen2-VL that the warm-up of
`builtin:tiny-dots` starts from, and a short GRPO run of `examples/vision.yaml`."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ketch.config import load_config
from ketch.config.schema import BUILTIN_DOTS_MODEL
from ketch.data import resolve_data_files
from ketch.data.builtin.dots import QUESTION, DotsTask, generate_dots_task
from ketch.protocol import DataProto
from ketch.rewards import compute_score
from ketch.tracking import read_metrics
from ketch.trainer.builtin import TINY_QWEN2_VL, WARMUPS, warmup_config
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.sft import SFTTrainer

ROOT = Path(__file__).resolve().parents[1]


def red_blobs(png: bytes) -> int:
    """The connected regions (4-neighbours) of red pixels in a PNG image."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    red = (pixels[..., 0] > 150) & (pixels[..., 1] < 100) & (pixels[..., 2] < 100)
    seen, blobs = np.zeros_like(red), 0
    for start in zip(*np.nonzero(red), strict=True):
        if seen[start]:
            continue
        blobs, stack, seen[start] = blobs + 1, [start], True
        while stack:
            y, x = stack.pop()
            for near in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                inside = 0 <= near[0] < red.shape[0] and 0 <= near[1] < red.shape[1]
                if inside and red[near] and not seen[near]:
                    seen[near] = True
                    stack.append(near)
    return blobs


def test_the_answer_of_every_image_is_its_count_of_red_blobs():
    splits = generate_dots_task(DotsTask(num_train=60, num_val=20, seed=3))
    for row in splits["train"] + splits["val"]:
        assert red_blobs(row["images"][0]) == int(row["answer"]) == int(row["response"])
        assert row["prompt"] == QUESTION == "<image>How many red dots?"
        assert Image.open(io.BytesIO(row["images"][0])).size == (56, 56)


def test_the_task_is_the_same_for_a_seed_and_its_validation_images_are_distinct_and_not_trained_on():
    task = DotsTask(num_train=40, num_val=8, seed=3)
    first, again = generate_dots_task(task), generate_dots_task(task)
    assert first == again
    assert [r["answer"] for r in first["val"]] == ["1", "1", "0", "4", "2", "2", "1", "3"]
    assert [r["extra_info"]["dots"] for r in first["val"]] == [3, 3, 0, 4, 2, 3, 3, 3]  # red and distractors
    val = {r["images"][0] for r in first["val"]}
    assert len(val) == 8 and not val & {r["images"][0] for r in first["train"]}
    assert generate_dots_task(DotsTask(num_train=40, num_val=8, seed=4)) != first


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"size": 56, "cells": 5}, "DotsTask needs cells that divide size"),
        ({"radius": 7}, "hold a dot of radius 7 with a pixel to spare"),
        ({"max_count": 15, "max_distractors": 2}, r"max_count \+ max_distractors must be at most 16"),
        ({"num_train": 0}, "DotsTask needs num_train >= 1"),
    ],
)
def test_impossible_settings_say_which_bound_they_break(settings, message):
    with pytest.raises(ValueError, match=message):
        DotsTask(**settings)


def test_too_many_distinct_validation_images_for_the_settings_stop_with_the_fix():
    with pytest.raises(ValueError, match="found 1 distinct validation images of the 2 asked for in 200 draws"):
        generate_dots_task(DotsTask(cells=1, size=14, max_count=0, max_distractors=0, num_val=2))


def test_builtin_dots_resolves_to_the_cached_splits():
    train, val = resolve_data_files(["builtin:dots/train", "builtin:dots/val"])
    assert (pq.read_metadata(train).num_rows, pq.read_metadata(val).num_rows) == (4000, 200)
    assert Path(train).parent == Path(val).parent and Path(train).parent.name.startswith("dots-")


@pytest.mark.parametrize(
    ("response", "score"), [("3", 1.0), (" 3\n", 1.0), ("2", 0.0), ("3 dots", 0.0), ("03", 0.0), ("", 0.0)]
)
def test_the_dots_scorer_takes_the_exact_count_only(response, score):
    assert compute_score("ketch/dots", response, "3") == score


@pytest.fixture(scope="module")
def init_model(tmp_path_factory) -> Path:
    """The random tiny Qwen2-VL that the warm-up of builtin:tiny-dots starts from."""
    return Path(TINY_QWEN2_VL.save(tmp_path_factory.mktemp("tiny-dots-init")))


def _warmup(init_model: Path, tmp_path: Path, *overrides: str) -> SFTTrainer:
    """The SFT of the builtin:tiny-dots warm-up on the first 32 training and validation rows."""
    warmup = WARMUPS[BUILTIN_DOTS_MODEL]
    config = warmup_config(warmup, init_model, tmp_path, "cpu", "data.max_samples=32", *overrides)
    return SFTTrainer(config, model_path=str(init_model))


def test_sft_with_images_lowers_the_loss_of_a_fixed_batch(init_model, tmp_path):
    sft = _warmup(init_model, tmp_path, "actor.optim.warmup_steps=0")
    batch = DataProto.from_single_dict(sft.train_set.collate([sft.train_set[i] for i in range(16)]))
    images = batch.non_tensor_batch["multi_modal_inputs"]
    assert [tuple(row["pixel_values"].shape) for row in images[:2]] == [(16, 1176), (16, 1176)]  # 4 x 4 patches
    image_token = sft.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (batch.batch["input_ids"] == image_token).sum(-1).tolist() == [4] * 16  # one per 2 x 2 patches
    sft._open()
    group = sft.groups.actor_rollout

    def loss() -> float:
        out = group.sft_log_prob(batch).batch
        return float(-(out["log_prob"] * out["response_mask"]).sum() / out["response_mask"].sum())

    before = loss()
    steps = [group.sft_step(batch).meta_info["metrics"]["sft/loss"] for _ in range(3)]
    after = loss()
    sft.groups.shutdown()
    assert before == pytest.approx(math.log(len(sft.tokenizer)), abs=0.1)  # a random model: ln(vocabulary)
    assert steps[0] == pytest.approx(before, abs=1e-4)
    assert after == pytest.approx(3.99, abs=0.05)  # measured: 4.64 -> 3.99 after 3 steps at lr 5e-4


def test_the_warm_up_validates_by_generating_on_the_images_and_writes_the_processor_beside_the_model(
    init_model, tmp_path
):
    metrics = _warmup(init_model, tmp_path, "trainer.total_steps=2", "trainer.test_freq=2").fit()
    assert 0.0 <= metrics["val/ketch/dots/acc"] <= 1.0
    assert 1.0 <= metrics["val/response_length/mean"] <= 3.0  # data.max_response_length=3
    assert (tmp_path / "warmup" / "model" / "preprocessor_config.json").is_file()


def test_two_grpo_steps_of_the_vision_example(init_model, tmp_path):
    overrides = [f"model.path={init_model}", "data.max_samples=16", "data.train_batch_size=4", "rollout.n=2"]
    overrides += ["actor.ppo_mini_batch_size=null"]
    overrides += ["trainer.total_steps=2", "trainer.test_freq=2", "trainer.val_before_train=false"]
    overrides += ["trainer.device=cpu", "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path}"]
    trainer = PPOTrainer(load_config(ROOT / "examples" / "vision.yaml", overrides))
    trainer.fit()
    records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "step" in r and "event" not in r]
    assert [r["step"] for r in records] == [1, 2]
    assert "val/ketch/dots/acc" in records[1] and "val/ketch/dots/acc" not in records[0]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in records)
