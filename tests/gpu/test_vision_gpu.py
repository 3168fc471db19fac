"""Vision-language models on one GPU with the defaults (bf16, packed forwards and the compiled static decoder with
CUDA graphs for the Qwen families; Gemma 3 padded, with `generate`): the tiny random models of
`tests/vision_models.py`, two GRPO steps each on prompts with images. Each test prints one `vision` line of
figures (benchmarks/results keeps them). Where torchvision imports, the processor ketch builds (the image
processor's PIL backend) is compared with the family's own `AutoProcessor` (torchvision's)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from gpu_models import two_grpo_steps
from PIL import Image

from ketch.models.vision import load_image_processor
from tests.vision_models import FAMILIES, save_tiny_vlm


def _image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


def _image_task(directory) -> dict[str, str]:
    """train/val Parquet files of 8 prompts with one image each, scored by `ketch/arithmetic`."""
    rows = []
    for i in range(8):
        png = io.BytesIO()
        _image(28 + 4 * i, 40, i).save(png, format="PNG")
        rows.append({"prompt": f"<image>dots {i}?", "images": [{"bytes": png.getvalue()}], "answer": str(i % 3)})
        rows[-1]["data_source"] = "ketch/arithmetic"
    files = {split: str(directory / f"{split}.parquet") for split in ("train", "val")}
    for file in files.values():
        pq.write_table(pa.Table.from_pylist(rows), file)
    return files


@pytest.mark.parametrize("family", FAMILIES)
def test_two_grpo_steps_on_the_gpu_with_the_defaults(family, tmp_path, tiny_config):
    path, files = save_tiny_vlm(tmp_path / family, family), _image_task(tmp_path)
    config = tiny_config(
        f"model.path={path}", f"data.train_files=[{files['train']}]", f"data.val_files=[{files['val']}]",
        "data.train_batch_size=4", "data.max_prompt_length=48", "data.max_response_length=16",
        "algorithm.adv_estimator=grpo", "rollout.n=2", "actor.entropy_coeff=0.01", "trainer.device=cuda",
    )  # fmt: skip
    steps, paths = two_grpo_steps(config)
    assert paths == (family != "gemma3", family != "gemma3")
    diffs = [m["training/rollout_probs_diff_max"] for m in steps]
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in steps) and max(diffs) < 0.1
    figures = {"packed": paths[0], "static": paths[1], "rollout_probs_diff_max": diffs}
    figures["step_s"] = [m.get("timing_s/step") for m in steps]
    print("vision", family, json.dumps(figures))


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_the_pil_processor_gives_the_pixels_and_tokens_of_the_familys_own(family, tmp_path):
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    path = save_tiny_vlm(tmp_path / family, family)
    ours, theirs = load_image_processor(path), AutoProcessor.from_pretrained(path)
    text = [f"a {ours.image_placeholder} b"]
    diffs = []
    for size in ((28, 40), (64, 50), (33, 61)):
        a = ours(text=text, images=[_image(*size)], return_tensors="pt")
        b = theirs(text=text, images=[_image(*size)], return_tensors="pt")
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert a["pixel_values"].shape == b["pixel_values"].shape
        diffs.append((a["pixel_values"] - b["pixel_values"]).abs().max().item())
    print("processor", family, json.dumps({"pixel_values_max_diff": diffs}))
    assert max(diffs) < 0.1  # normalised pixel values span about [-2, 2]
