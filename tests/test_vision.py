"""Vision-language models: the processors ketch builds without torchvision, on tiny random models of each family."""

from __future__ import annotations

import io
import json
import math
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from torch import nn
from transformers import AutoConfig

from ketch.architecture import packing_problem
from ketch.config import ConfigError
from ketch.config.schema import DataConfig
from ketch.data.batching import position_ids
from ketch.data.builtin.tokenizer import build_char_tokenizer
from ketch.data.dataset import RLHFDataset
from ketch.data.errors import DatasetError
from ketch.doctor.checks import _config_rows
from ketch.engine.heads import PolicyModel
from ketch.models import load_causal_lm, vision
from ketch.models.mrope import continued_positions, rope_positions
from ketch.models.vision import (
    QWEN_IMAGE,
    VISION_MODULES,
    VisionModelError,
    image_model_inputs,
    load_image_processor,
    placeholder_token_ids,
    vision_family,
)
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder
from ketch.tracking import read_metrics
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.validation import generation_inputs
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


def test_where_the_auto_class_asks_for_torchvision_the_pil_class_is_loaded(vlm_dirs, monkeypatch):
    """transformers 5.17's `AutoImageProcessor` takes no PIL backend and asks for torchvision, which a CPU-only torch
    may lack: the `<type>Pil` class is loaded itself, with the same pixels; a version without it says what to do."""
    expected = load_image_processor(vlm_dirs["qwen2_vl"])(text=[QWEN_IMAGE], images=[_image(40, 50)])

    def asks_torchvision(*args, **kwargs):
        raise ImportError("AutoImageProcessor requires the Torchvision library")

    monkeypatch.setattr(vision.AutoImageProcessor, "from_pretrained", asks_torchvision)
    processor = load_image_processor(vlm_dirs["qwen2_vl"])
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    got = processor(text=[QWEN_IMAGE], images=[_image(40, 50)])
    assert got["input_ids"] == expected["input_ids"]
    assert torch.equal(torch.as_tensor(got["pixel_values"]), torch.as_tensor(expected["pixel_values"]))
    older = SimpleNamespace(__version__="5.0.0", Qwen2VLProcessor=vision.transformers.Qwen2VLProcessor)
    monkeypatch.setattr(vision, "transformers", older)  # no Qwen2VLImageProcessorPil
    with pytest.raises(VisionModelError, match=r"5.0.0 has no Qwen2VLImageProcessorPil: install torchvision for"):
        load_image_processor(vlm_dirs["qwen2_vl"])


def test_vision_family_names_a_text_model_none_and_refuses_an_unknown_family(tmp_path, vlm_dirs):
    assert vision_family(vlm_dirs["qwen2_vl"]) == "qwen2_vl"
    AutoConfig.for_model("llava", text_config={"model_type": "llama"}).save_pretrained(tmp_path)
    with pytest.raises(VisionModelError, match="llava vision-language model; ketch trains qwen2_vl"):
        vision_family(tmp_path)


def _png(height: int = 40, width: int = 50) -> bytes:
    out = io.BytesIO()
    _image(height, width).save(out, format="PNG")
    return out.getvalue()


def _dataset(tmp_path, rows: list[dict], processor, *more: list[dict], **data) -> RLHFDataset:
    """A dataset of `rows` (one Parquet file, `train.parquet`) and each of `more` (a file each)."""
    files = [str(tmp_path / f"train{i or ''}.parquet") for i in range(1 + len(more))]
    for file, part in zip(files, (rows, *more), strict=True):
        pq.write_table(pa.Table.from_pylist(part), file)
    tokenizer = processor.tokenizer if processor else build_char_tokenizer()
    return RLHFDataset(files, tokenizer, DataConfig(**({"max_prompt_length": 64} | data)), processor)


@pytest.fixture(scope="module")
def qwen_processor(vlm_dirs):
    return load_image_processor(vlm_dirs["qwen2_vl"])


def test_images_column_gives_prompt_ids_with_vision_tokens_and_the_image_inputs(tmp_path, qwen_processor):
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}]
    rows = [
        {"prompt": "look <image> and <image>", "images": [{"bytes": _png()}, {"bytes": _png(28, 28)}]},
        {"prompt": "no image here", "images": None},
    ]
    chats = [{"prompt": chat, "images": _png()}]
    dataset = _dataset(tmp_path, rows, qwen_processor, chats, apply_chat_template=False)
    two, plain, chat_item = dataset[0], dataset[1], dataset[2]
    image_id = qwen_processor.image_token_id
    grid = two["multi_modal_inputs"]["image_grid_thw"]
    assert grid.tolist() == [[1, 2, 4], [1, 2, 2]]  # 40x50 -> 28x56 pixels, 28x28 -> 28x28; patches of 14
    assert int((two["input_ids"] == image_id).sum()) == (8 + 4) // 4  # one token per 2x2 merged patches
    assert two["multi_modal_inputs"]["pixel_values"].shape[0] == 8 + 4
    assert int((chat_item["input_ids"] == image_id).sum()) == 2
    assert len(two["images"]) == 2 and plain["images"] == [] and plain["multi_modal_inputs"] == {}
    batch = dataset.collate([two, plain])
    assert batch["multi_modal_inputs"].shape == (2,) and batch["input_ids"].shape[0] == 2


@pytest.mark.parametrize(
    ("cell", "prompt", "message"),
    [
        (b"not an image", "a <image>", "image 0 (12 bytes) cannot be read as an image"),
        ("/nowhere/cat.png", "a <image>", "image 0 (the file /nowhere/cat.png) cannot be read as an image"),
        (7, "a <image>", "image 0 is a int; give PNG/JPEG bytes, a path to an image file"),
        ("two", "a <image>", "the row has 2 image(s) but its prompt has 1 <image> placeholder(s); put one <image>"),
    ],
)
def test_a_bad_image_stops_naming_the_row_the_column_and_the_fix(tmp_path, qwen_processor, cell, prompt, message):
    cell = [_png(), _png()] if cell == "two" else cell
    with pytest.raises(DatasetError) as err:
        _dataset(tmp_path, [{"prompt": prompt, "images": cell}], qwen_processor)
    assert str(err.value).startswith(f"{tmp_path / 'train.parquet'}, row 0, column 'images': ")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_images_for_a_text_only_model_stop_with_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="row 0, column 'images': the row has images but the model is text-only"):
        _dataset(tmp_path, [{"prompt": "a <image>", "images": _png()}], None)


def test_a_prompt_with_images_is_never_truncated(tmp_path, qwen_processor):
    rows = [{"prompt": "a <image>", "images": _png(56, 56)}]
    with pytest.raises(DatasetError, match=r"row 0: .* a prompt with images cannot be truncated; raise the limit"):
        _dataset(tmp_path, rows, qwen_processor, max_prompt_length=5, truncation="left")


@pytest.fixture(scope="module")
def image_task(tmp_path_factory) -> dict[str, str]:
    """train/val Parquet files of 8 prompts with one image each, scored by `ketch/arithmetic` (`#### N`)."""
    out = tmp_path_factory.mktemp("image-task")
    rows = [
        {
            "prompt": f"<image>dots {i}?",
            "images": [{"bytes": _png(28 + 4 * i, 40)}],
            "answer": str(i % 3),
            "data_source": "ketch/arithmetic",
        }
        for i in range(8)
    ]
    files = {split: str(out / f"{split}.parquet") for split in ("train", "val")}
    for file in files.values():
        pq.write_table(pa.Table.from_pylist(rows), file)
    return files


def _grpo_config(tiny_config, model_dir: str, files: dict[str, str], *overrides: str):
    """`tiny_config` (tests/conftest.py) on the vision-language model at `model_dir` and the image task `files`."""
    data = [f"data.train_files=[{files['train']}]", f"data.val_files=[{files['val']}]", "data.train_batch_size=4"]
    data += ["data.max_prompt_length=48", "data.max_response_length=6"]
    return tiny_config(f"model.path={model_dir}", *data, "algorithm.adv_estimator=grpo", "rollout.n=2", *overrides)


def _weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.actor_rollout.worker.actor.full_parameters()}


PROJECTOR_AND_TOWER = {
    "qwen": ("lm.model.visual.merger.", "lm.model.visual.blocks."),
    "gemma3": ("lm.model.multi_modal_projector.", "lm.model.vision_tower."),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_two_grpo_steps_train_the_language_model_and_projector_with_the_images(
    tiny_config, vlm_dirs, image_task, family
):
    """The rollout reads the images at prefill and the training forward again, as on a GPU: the static decoder and
    packed forwards (Gemma 3: `generate` and padded forwards). In float32 the rollout's log-probs are the training
    forward's."""
    # a random model scores 0 everywhere (advantages 0): the entropy bonus gives every trained weight a gradient
    overrides = ("actor.entropy_coeff=0.01", "model.use_remove_padding=true", "rollout.hf_decoding=static")
    trainer = PPOTrainer(_grpo_config(tiny_config, vlm_dirs[family], image_task, *overrides))
    trainer._open()
    assert trainer.actor_rollout.worker.actor.module.packed == (family != "gemma3")
    assert (trainer.actor_rollout.worker.rollout.decoder is not None) == (family != "gemma3")
    before = _weights(trainer)
    metrics = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    after = _weights(trainer)
    trainer.groups.shutdown()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    projector, tower = PROJECTOR_AND_TOWER["gemma3" if family == "gemma3" else "qwen"]
    assert any(n.startswith("lm.model.language_model.") for n in changed)
    assert any(n.startswith(projector) for n in changed)
    assert not any(n.startswith(tower) for n in changed)  # model.freeze_vision_tower
    assert metrics[0]["training/rollout_probs_diff_max"] < 1e-5
    assert math.isfinite(metrics[1]["actor/pg_loss"])  # the second step ran its update


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_lora_adapts_the_language_model_only_and_exports_an_adapter_that_leaves_the_vision_out(
    tiny_config, vlm_dirs, image_task, family
):
    """`actor.lora` on a vision-language model: adapters on the language model's linear layers only (the vision
    encoder and projector frozen whole), the rollout decoding the merged weights, and `model/adapter` saying so."""
    overrides = ("actor.entropy_coeff=0.01", "actor.lora.rank=4", "actor.optim.lr=0.01", "trainer.total_steps=2")
    trainer = PPOTrainer(_grpo_config(tiny_config, vlm_dirs[family], image_task, *overrides))
    trainer._open()
    before = _weights(trainer)
    metrics = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    after = _weights(trainer)
    changed = {n for n in before if not torch.equal(before[n], after[n])}  # the merged weights
    module = trainer.actor_rollout.worker.actor.module
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("lm.model.language_model.") and ".lora_" in n for n in trained)
    assert changed and all(n.startswith("lm.model.language_model.") for n in changed)
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-5  # the rollout got the merged weights of step 1
    trainer.actor_rollout.save_pretrained(str(trainer.run_dir / "model"))
    trainer.groups.shutdown()
    saved = json.loads((trainer.run_dir / "model" / "adapter" / "adapter_config.json").read_text())
    assert saved["exclude_modules"] == VISION_MODULES


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_static_decoder_reads_the_images_and_never_samples_a_placeholder(vlm_dirs, family):
    """Three rows (an image, none, an image mid-prompt; left-padded, also into a bucket's shape) whose logits favour
    the image placeholder at every step: the static decoder gives `generate`'s greedy tokens with the placeholders
    suppressed, and the log-probs of the model's whole distribution, as `generate`'s raw logits give them."""
    model = load_causal_lm(vlm_dirs[family]).eval()
    bias = torch.zeros(model.lm_head.out_features)
    bias[model.config.image_token_id] = 8.0
    model.lm_head.bias = nn.Parameter(bias)
    processor, image = load_image_processor(vlm_dirs[family]), QWEN_IMAGE
    prompts = [(f"{image}dots?", [_image(28, 40)]), ("no image", None), (f"one {image} here", [_image(44, 40)])]
    encoded = [processor(text=[text], images=images, return_tensors="pt") for text, images in prompts]
    rows = [{k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out} for out in encoded]
    ids = [out["input_ids"][0] for out in encoded]
    width, pad = max(map(len, ids)), processor.tokenizer.pad_token_id
    input_ids = torch.stack([nn.functional.pad(row, (width - len(row), 0), value=pad) for row in ids])
    mask = (input_ids != pad).long()
    never = placeholder_token_ids(model.config)
    settings = {"max_new_tokens": 8, "do_sample": False, "suppress_tokens": never, "pad_token_id": pad}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
        **settings,
        **image_model_inputs(model.config, input_ids, rows),
    )
    expected = out.sequences[:, width:]
    logits = torch.stack(out.logits, 1)  # raw: before the suppression
    assert (logits.argmax(-1) == model.config.image_token_id).all()  # the placeholder would win every step
    log_probs = logits.log_softmax(-1).gather(-1, expected[..., None]).squeeze(-1)
    for buckets in (False, True):
        decoder = StaticDecoder(model, compile_step=False, buckets=buckets, never_sampled=never)
        tokens, decoded = decoder.generate(input_ids, mask, 8, Sampling(False), None, pad, images=rows)
        assert torch.equal(tokens, expected)
        assert (decoded - log_probs).abs().max() < 1e-5


def test_the_placeholder_tokens_a_rollout_never_samples_are_the_familys_image_and_video_tokens(vlm_dirs):
    qwen, gemma = (AutoConfig.from_pretrained(vlm_dirs[family]) for family in ("qwen2_vl", "gemma3"))
    assert placeholder_token_ids(qwen) == [qwen.image_token_id, qwen.video_token_id]
    assert placeholder_token_ids(gemma) == [gemma.image_token_index, gemma.boi_token_index]


def test_a_setting_not_yet_taken_with_images_stops_at_start_up_naming_the_fix(tiny_config, vlm_dirs, image_task):
    overrides = ("rollout.name=vllm", "algorithm.adv_estimator=gae", "critic.lora.rank=4")
    config = _grpo_config(tiny_config, vlm_dirs["qwen2_vl"], image_task, *overrides)
    with pytest.raises(ConfigError) as err:
        PPOTrainer(config)
    message = str(err.value)
    assert "is a vision-language model (qwen2_vl), and ketch does not train one with images under other" in message
    assert "set rollout.name=hf" in message and "set critic.lora.rank=0 (a critic on the whole model)" in message


def test_a_run_validates_with_the_images_and_exports_a_model_that_loads_with_its_processor(
    tiny_config, vlm_dirs, image_task
):
    overrides = ("trainer.val_before_train=true", "trainer.test_freq=1", "trainer.total_steps=1")
    trainer = PPOTrainer(
        _grpo_config(tiny_config, vlm_dirs["qwen2_5_vl"], image_task, *overrides, "actor.use_kl_loss=true")
    )
    trainer.fit()
    validated = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "val/ketch/arithmetic/acc" in r]
    assert [r["step"] for r in validated] == [0, 1]
    exported = trainer.run_dir / "model"
    assert type(load_causal_lm(str(exported))).__name__ == "Qwen2_5_VLForConditionalGeneration"
    processor = load_image_processor(exported)
    assert processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[_image(28, 28)])["input_ids"]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_packed_log_probs_equal_the_padded_ones_in_float32(tmp_path, vlm_dirs, family):
    processor = load_image_processor(vlm_dirs[family])
    rows = [
        {"prompt": "look <image> and <image>", "images": [{"bytes": _png()}, {"bytes": _png(28, 28)}]},
        {"prompt": "a <image>", "images": [{"bytes": _png(56, 40)}]},
        {"prompt": "none", "images": []},
    ]
    dataset = _dataset(tmp_path, rows, processor)
    batch = dataset.collate([dataset[i] for i in range(len(dataset))])
    prompts, prompt_mask = batch["input_ids"], batch["attention_mask"]
    responses = torch.randint(10, 90, (3, 5))
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    input_ids, mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, response_mask], 1)
    padded, packed = (PolicyModel(load_causal_lm(vlm_dirs[family]), packed=p).eval() for p in (False, True))
    assert packed.packed and not padded.packed
    images = image_model_inputs(padded.lm.config, input_ids, batch["multi_modal_inputs"])
    args = (input_ids, mask, position_ids(mask), 5)
    expected, got = (head(*args, image_inputs=images)["log_prob"] for head in (padded, packed))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got[response_mask == 0] == 0).all()
    blank = images | {"pixel_values": torch.zeros_like(images["pixel_values"])}
    for head in (padded, packed):  # the images reach the language model on both paths (rows 0 and 1 have some)
        without = head(*args, image_inputs=blank)["log_prob"]
        assert (without[:2] - expected[:2]).abs().max() > 1e-3
        torch.testing.assert_close(without[2], expected[2], atol=1e-6, rtol=0)
    # the rollout's carried positions: the prompts' from get_rope_index, the responses' counted on from them
    carried = continued_positions(
        rope_positions(padded.lm.model, prompts, prompt_mask, batch["multi_modal_inputs"]), mask
    )
    full, _ = padded.lm.model.get_rope_index(
        input_ids, images["mm_token_type_ids"], image_grid_thw=images["image_grid_thw"], attention_mask=mask
    )
    assert carried.shape == (3, 3, input_ids.shape[1]) and torch.equal(carried, full.transpose(0, 1))
    for head in (padded, packed):
        got = head(input_ids, mask, carried, 5, image_inputs=images)["log_prob"]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_forward_that_takes_no_encoded_images_trains_padded(vlm_dirs):
    """The packed forward encodes the images apart and gives them to the model as `mm_encoder_outputs`; a model
    forward without that parameter (transformers 5.17's, on 2026-12-07's GPU machine) ignored them, and the built-in
    visual task's warm-up and GRPO trained the language model without its images. Such a model trains padded."""
    model = load_causal_lm(vlm_dirs["qwen2_vl"])
    assert packing_problem(model) is None
    backbone = type(model.model)

    def forward(self, input_ids=None, pixel_values=None, image_grid_thw=None, **kwargs):
        return backbone.forward(self, input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw)

    model.model.__class__ = type("OlderQwen2VLModel", (backbone,), {"forward": forward})
    assert packing_problem(model).startswith("its forward in transformers ")
    assert "takes no mm_encoder_outputs (5.19's does)" in packing_problem(model)
    assert not PolicyModel(model, packed=True).packed


def test_carried_positions_count_each_response_on_from_its_prompts_largest():
    """Row 0: text, a 2 x 2 image grid (positions 2-3 high and wide), text; its response counts on from 4. Row 1:
    left-padded text. Padding is 0, as get_rope_index gives it."""
    prompt = torch.tensor(
        [
            [[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]],
            [[0, 0, 0, 0, 0, 1, 2]] * 3,
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]])
    out = continued_positions(prompt, mask)
    assert out[0, :, 7:].tolist() == [[5, 6, 0]] * 3
    assert out[1, :, 7:].tolist() == [[3, 0, 0]] * 3
    assert torch.equal(out[:, :, :7], prompt)
    with pytest.raises(ValueError, match=r"prompt positions \(2, 3, 7\) do not fit an attention mask of \(2, 5\)"):
        continued_positions(prompt, mask[:, :5])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_rollout_carries_the_positions_and_the_training_forward_reads_them(
    tiny_config, vlm_dirs, image_task, family
):
    """The static-decoded rollout returns `position_ids` `[batch, 3, seq]`: get_rope_index's for prompt and
    response. The packed old log-probs read them: equal to those of positions computed in the forward (rows without
    carried ones), within 1e-5 of the rollout's."""
    overrides = ("model.use_remove_padding=true", "rollout.hf_decoding=static")
    trainer = PPOTrainer(_grpo_config(tiny_config, vlm_dirs[family], image_task, *overrides))
    trainer._open()
    batch = trainer._expand(trainer.loader.next_batch())
    batch = batch.union(trainer.generator.generate_sequences(generation_inputs(batch)))
    carried = batch.batch["position_ids"]
    model = trainer.actor_rollout.worker.rollout.model
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    images = image_model_inputs(model.config, ids, batch.non_tensor_batch["multi_modal_inputs"])
    full, _ = model.model.get_rope_index(
        ids, images["mm_token_type_ids"], image_grid_thw=images["image_grid_thw"], attention_mask=mask
    )
    assert carried.shape == (8, 3, ids.shape[1]) and torch.equal(carried, full.transpose(0, 1))
    old = trainer.actor_rollout.compute_log_prob(batch).batch["old_log_prob"]
    batch.batch["position_ids"] = position_ids(mask)
    computed = trainer.actor_rollout.compute_log_prob(batch).batch["old_log_prob"]
    trainer.groups.shutdown()
    torch.testing.assert_close(old, computed, atol=1e-6, rtol=0)
    response_mask = batch.batch["response_mask"].bool()
    assert (old - batch.batch["rollout_log_probs"])[response_mask].abs().max() < 1e-5


def test_ppo_with_a_critic_on_the_vision_language_model_reads_the_images(tiny_config, vlm_dirs, image_task):
    """`algorithm.adv_estimator=gae` on a tiny Qwen2-VL: the critic is its backbone with a value head, reading the
    images and the carried positions packed; two PPO steps train its language model and head, not its vision
    tower, with finite values and value loss."""
    overrides = ("algorithm.adv_estimator=gae", "rollout.n=1", "model.use_remove_padding=true")
    trainer = PPOTrainer(
        _grpo_config(tiny_config, vlm_dirs["qwen2_vl"], image_task, *overrides, "rollout.hf_decoding=static")
    )
    trainer._open()
    critic = trainer.critic.worker.critic
    assert critic.module.packed
    before = {n: t.clone() for n, t in critic.full_parameters()}
    metrics = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    changed = {n for n, t in critic.full_parameters() if not torch.equal(before[n], t)}
    trainer.groups.shutdown()
    for step in metrics:
        assert math.isfinite(step["critic/vf_loss"]) and math.isfinite(step["critic/vpred_mean"])
    assert "critic.score.weight" in changed
    assert any(n.startswith("critic.model.language_model.") for n in changed)
    assert not any(n.startswith("critic.model.visual.blocks.") for n in changed)  # model.freeze_vision_tower


def test_doctor_reads_the_images_and_checks_the_first_steps_log_probs(tiny_config, vlm_dirs, image_task):
    rows = {row.name: row for row in _config_rows(_grpo_config(tiny_config, vlm_dirs["qwen2_vl"], image_task))}
    assert "Qwen2VLForConditionalGeneration, 2 layers, hidden size 64" in rows["model"].detail
    assert rows["data.train_files"].status == "ok" and rows["rollout vs training"].status == "ok"
