"""Vision-language models: which families ketch takes, and their processors built without the video half.

A family's processor (`AutoProcessor`) pairs the tokenizer with an image processor and, for Qwen2-VL, Qwen2.5-VL and
Qwen3-VL, a video processor, which transformers builds only with torchvision installed; torchvision has no build
for a CPU-only torch on some machines, and its fast image processors need it too. ketch trains on images only, so
it builds the family's processor class without its video processor, around the image processor's PIL backend
(numpy and PIL: the same resizing, rescaling, normalisation and patches as the processor's own). Placeholders in a
prompt are expanded by the family's own processor code (`<|image_pad|>` repeated once per merged patch; Gemma 3's
`<start_of_image>` sequence), so the vision tokens are the ones the model expects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VISION_FAMILIES = {
    "qwen2_vl": ("Qwen2VLProcessor", QWEN_IMAGE),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", QWEN_IMAGE),
    "qwen3_vl": ("Qwen3VLProcessor", QWEN_IMAGE),
    "gemma3": ("Gemma3Processor", "<start_of_image>"),
}
"""The vision-language families ketch trains, by `model_type`: their processor class, and the text that stands for
one image in a prompt (the processor expands it into the image's vision tokens)."""


class VisionModelError(ValueError):
    """A vision-language model or processor that ketch cannot use: the message names the path and the fix."""


def vision_family(model_path: str | Path) -> str | None:
    """The `model_type` of the model at `model_path` when it is a vision-language model (its config has a
    `vision_config`), else None; a vision-language family outside `VISION_FAMILIES` raises `VisionModelError`."""
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "vision_config", None) is None:
        return None
    if config.model_type not in VISION_FAMILIES:
        raise VisionModelError(
            f"{model_path} is a {config.model_type} vision-language model; ketch trains {', '.join(VISION_FAMILIES)}: "
            "convert the checkpoint to one of them or train a text-only model"
        )
    return config.model_type


def _image_only(processor_class: type, placeholder: str) -> type:
    """`processor_class` without its video processor among the parts it is built from, whose `image_placeholder` is
    `placeholder`."""

    class ImageOnly(processor_class):
        image_placeholder = placeholder

        @classmethod
        def get_attributes(cls) -> list[str]:
            return [name for name in super().get_attributes() if name != "video_processor"]

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class.__name__
    return ImageOnly


def load_image_processor(model_path: str | Path, tokenizer: Any | None = None) -> Any:
    """The processor of the vision-language model at `model_path`, built from its tokenizer (`tokenizer`, else the
    one saved there) and its image processor's PIL backend, without a video processor (see the module's docstring).

    Calling it as `processor(text=[...], images=[...], return_tensors="pt")` gives `input_ids` with the vision tokens
    expanded, and the family's image inputs (`pixel_values`; Qwen's `image_grid_thw` `[images, 3]`). Its
    `image_placeholder` is the text that stands for one image in a prompt.
    """
    family = vision_family(model_path)
    if family is None:
        raise VisionModelError(f"{model_path} has no vision_config: it is not a vision-language model")
    processor_class = _image_only(getattr(transformers, VISION_FAMILIES[family][0]), VISION_FAMILIES[family][1])
    try:
        image_processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
    except (OSError, ValueError) as err:
        raise VisionModelError(
            f"cannot load the image processor of {model_path} ({err}); the directory needs the model's "
            "preprocessor_config.json"
        ) from None
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
    return processor_class(image_processor=image_processor, tokenizer=tokenizer, **_processor_settings(model_path))


def _processor_settings(model_path: str | Path) -> dict[str, Any]:
    """The processor's own settings saved beside the model (`processor_config.json`, e.g. Gemma 3's
    `image_seq_length`), without the names of its parts."""
    path = Path(model_path) / "processor_config.json"
    if not path.is_file():
        return {}
    settings = json.loads(path.read_text())
    return {k: v for k, v in settings.items() if k not in ("processor_class", "image_processor", "video_processor")}
