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

from ketch.architecture import packing_problem
from ketch.data.batching import position_ids
from ketch.engine.heads import PolicyModel
from ketch.models import load_causal_lm
from ketch.models.vision import image_model_inputs, load_image_processor
from tests.test_vision import _dataset, _png
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
    packs = packing_problem(load_causal_lm(str(path))) is None  # not where the forward takes no encoded images
    assert paths == (packs, family != "gemma3") and packs <= (family != "gemma3")
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


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_images_reach_the_training_forward_on_the_gpu(family, tmp_path):
    """With this machine's transformers, in float32 on the GPU: the training forward as the defaults take it (packed
    where the model's forward takes the encoded images, `architecture.packing_problem`) gives the padded forward's
    log-probs within 1e-4, and blank pixel values change the log-probs of the rows with images, not of the row
    without (transformers 5.17 ignored the images in the packed forward before it trained padded there)."""
    path = str(save_tiny_vlm(tmp_path / family, family))
    rows = [
        {"prompt": "look <image> and <image>", "images": [{"bytes": _png()}, {"bytes": _png(28, 28)}]},
        {"prompt": "a <image>", "images": [{"bytes": _png(56, 40)}]},
        {"prompt": "none", "images": []},
    ]
    dataset = _dataset(tmp_path, rows, load_image_processor(path))
    batch = dataset.collate([dataset[i] for i in range(3)])
    responses = torch.randint(10, 90, (3, 5), generator=torch.Generator().manual_seed(0))
    input_ids = torch.cat([batch["input_ids"], responses], 1).cuda()
    mask = torch.cat([batch["attention_mask"], torch.ones(3, 5, dtype=torch.long)], 1).cuda()
    heads = [PolicyModel(load_causal_lm(path).cuda(), packed=p).eval() for p in (False, True)]
    images = {
        k: v.cuda() for k, v in image_model_inputs(heads[0].lm.config, input_ids, batch["multi_modal_inputs"]).items()
    }
    blank = images | {"pixel_values": torch.zeros_like(images["pixel_values"])}
    args = (input_ids, mask, position_ids(mask), 5)
    with torch.no_grad():
        expected = heads[0](*args, image_inputs=images)["log_prob"]
        for head in heads:
            torch.testing.assert_close(head(*args, image_inputs=images)["log_prob"], expected, atol=1e-4, rtol=0)
            without = head(*args, image_inputs=blank)["log_prob"]
            assert (without[:2] - expected[:2]).abs().max() > 1e-3
            torch.testing.assert_close(without[2], expected[2], atol=1e-5, rtol=0)
    print("vision images", family, json.dumps({"packed": heads[1].packed}))
