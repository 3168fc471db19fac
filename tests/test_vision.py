"""Vision-language models: the processors ketch builds without torchvision, on tiny random models of each family."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from PIL import Image

from ketch.models.vision import VisionModelError, load_image_processor, vision_family
from tests.vision_models import FAMILIES, save_tiny_vlm


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vlm")
    return {family: str(save_tiny_vlm(root / family, family)) for family in FAMILIES}


def _image(height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_expands_each_placeholder_into_the_vision_tokens_without_torchvision(vlm_dirs, family):
    processor = load_image_processor(vlm_dirs[family])
    placeholder = processor.boi_token if family == "gemma3" else "<|vision_start|><|image_pad|><|vision_end|>"
    out = processor(text=[f"a {placeholder} b"], images=[_image(40, 50)], return_tensors="pt")
    if family == "gemma3":  # <start_of_image>, then the soft tokens (mm_tokens_per_image of them)
        assert int((out["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")).sum()) == 4
        assert tuple(out["pixel_values"].shape) == (1, 3, 32, 32)
    else:
        assert (
            int((out["input_ids"] == processor.image_token_id).sum()) == int(out["image_grid_thw"].prod()) // 4
        )  # one token per 2x2 merged patches
    assert "torchvision" not in sys.modules


def test_vision_family_names_a_text_model_none_and_refuses_an_unknown_family(tmp_path, vlm_dirs):
    assert vision_family(vlm_dirs["qwen2_vl"]) == "qwen2_vl"
    from transformers import AutoConfig

    AutoConfig.for_model("llava", text_config={"model_type": "llama"}).save_pretrained(tmp_path)
    with pytest.raises(VisionModelError, match="llava vision-language model; ketch trains qwen2_vl"):
        vision_family(tmp_path)
