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
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from ketch.architecture import is_vision_model

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VISION_FAMILIES = {
    "qwen2_vl": ("Qwen2VLProcessor", QWEN_IMAGE),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", QWEN_IMAGE),
    "qwen3_vl": ("Qwen3VLProcessor", QWEN_IMAGE),
    "gemma3": ("Gemma3Processor", "<start_of_image>"),
}
"""The vision-language families ketch trains, by `model_type`: their processor class, and the text that stands for
one image in a prompt (the processor expands it into the image's vision tokens)."""


VISION_MODULES = r"(.*\.)?(visual|vision_tower|multi_modal_projector)(\..*)?"
"""The module paths of the families' vision encoders and their projectors into the language model (Qwen's `visual`
with its mergers, Gemma 3's `vision_tower` and `multi_modal_projector`), as a regular expression (PEFT's
`exclude_modules`): LoRA adapts the language model only."""


class VisionModelError(ValueError):
    """A vision-language model or processor that ketch cannot use: the message names the path and the fix."""


def vision_family(model_path: str | Path) -> str | None:
    """The `model_type` of the model at `model_path` when it is a vision-language model (its config has a
    `vision_config`), else None; a vision-language family outside `VISION_FAMILIES` raises `VisionModelError`."""
    config = AutoConfig.from_pretrained(model_path)
    if not is_vision_model(config):
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
        image_processor = _pil_image_processor(model_path)
    except (OSError, ValueError) as err:
        raise VisionModelError(
            f"cannot load the image processor of {model_path} ({err}); the directory needs the model's "
            "preprocessor_config.json"
        ) from None
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
    return processor_class(image_processor=image_processor, tokenizer=tokenizer, **_processor_settings(model_path))


def _pil_image_processor(model_path: str | Path) -> Any:
    """The PIL backend of the image processor saved at `model_path`: `AutoImageProcessor`'s `backend="pil"`
    (transformers 5.19), or where that asks for torchvision (5.17 without it), the `<type>Pil` class itself."""
    try:
        return AutoImageProcessor.from_pretrained(model_path, backend="pil")
    except ImportError as err:
        config = json.loads((Path(model_path) / "preprocessor_config.json").read_text())
        name = f"{config.get('image_processor_type', '').removesuffix('Fast')}Pil"
        if not hasattr(transformers, name):
            raise VisionModelError(
                f"cannot load the image processor of {model_path} without torchvision ({err}), and transformers "
                f"{transformers.__version__} has no {name}: install torchvision for this torch, or transformers 5.19"
            ) from None
        return getattr(transformers, name).from_pretrained(model_path)


PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
"""The files of a model directory that describe its processor (beside the tokenizer's)."""


def copy_processor_files(model_path: str | Path, out_dir: str | Path) -> None:
    """Copy the processor's files of the vision-language model at `model_path` (those of `PROCESSOR_FILES` it has)
    into `out_dir`, so that an exported model loads with its processor."""
    for name in PROCESSOR_FILES:
        if (Path(model_path) / name).is_file():
            shutil.copyfile(Path(model_path) / name, Path(out_dir) / name)


def image_processor_for(model_config: Any, model_path: str | Path, tokenizer: Any) -> Any | None:
    """`load_image_processor(model_path, tokenizer)` for a vision-language model (HF `model_config`; None: not
    loaded), else None: what the prompt datasets take as their `processor`."""
    if model_config is None or not is_vision_model(model_config):
        return None
    return load_image_processor(model_path, tokenizer)


def _processor_settings(model_path: str | Path) -> dict[str, Any]:
    """The processor's own settings saved beside the model (`processor_config.json`, e.g. Gemma 3's
    `image_seq_length`), without the names of its parts."""
    path = Path(model_path) / "processor_config.json"
    if not path.is_file():
        return {}
    settings = json.loads(path.read_text())
    return {k: v for k, v in settings.items() if k not in ("processor_class", "image_processor", "video_processor")}


_IMAGE_TENSORS = ("pixel_values", "image_grid_thw")
"""The per-image tensors of a row's `multi_modal_inputs`, concatenated over the rows of a batch."""
_PLACEHOLDER_IDS = ("image_token_id", "video_token_id", "image_token_index", "boi_token_index")
"""The config attributes naming a family's image/video placeholder tokens (Qwen's; Gemma 3's)."""


def placeholder_token_ids(config: Any) -> list[int]:
    """The ids of the image and video placeholder tokens of the model of HF `config`, which a rollout must never
    sample: the training forward would look for an image behind each."""
    ids = [int(getattr(config, name)) for name in _PLACEHOLDER_IDS if getattr(config, name, None) is not None]
    return list(dict.fromkeys(ids))  # Gemma 3 names its image token twice


def image_model_inputs(config: Any, input_ids: torch.Tensor, rows: Any) -> dict[str, torch.Tensor]:
    """The keyword arguments that give a vision-language model (HF `config`) the images of a batch.

    Args:
        config: The model's HF config.
        input_ids: The batch's tokens `[batch, seq]`, vision tokens included.
        rows: Each row's `multi_modal_inputs` (`[batch]`, a dict each, empty for a row without images).

    Returns:
        `pixel_values` (`[patches, dim]` for Qwen, `[images, 3, height, width]` for Gemma 3) and Qwen's
        `image_grid_thw` `[images, 3]`, the rows' concatenated in order, on `input_ids`' device, with the token types
        the family reads (Qwen's `mm_token_type_ids`, 1 at image tokens, for its multimodal rotary positions; Gemma
        3's `token_type_ids`); empty without images.
    """
    parts = [row for row in rows if row]
    if not parts:
        return {}
    out = {
        name: torch.cat([row[name] for row in parts]).to(input_ids.device)
        for name in _IMAGE_TENSORS
        if name in parts[0]
    }
    if config.model_type == "gemma3":
        out["token_type_ids"] = (input_ids == config.image_token_index).long()
    else:
        out["mm_token_type_ids"] = (input_ids == config.image_token_id).int()
    return out


def freeze_vision_tower(model: nn.Module) -> None:
    """Stop gradients to the vision encoder of a vision-language `model` (`model.freeze_vision_tower`); the
    projector into the language model (Qwen's `merger`, Gemma 3's `multi_modal_projector`) and the language model
    stay trained."""
    inner = model.model
    tower = getattr(inner, "visual", None) or inner.vision_tower
    for name, param in tower.named_parameters():
        if "merger" not in name.split(".")[0]:  # Qwen's merger, Qwen3-VL's deepstack mergers
            param.requires_grad_(False)
