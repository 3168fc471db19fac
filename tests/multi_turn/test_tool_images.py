"""Tools and environments that answer a vision-language model with images: the images' vision tokens in the
response (never sampled), every image given to the backend at every turn and to the training forward at the same
places, a bad image answered with an error. Tiny random Qwen2-VL (tests/vision_models.py), float32, no network."""

from __future__ import annotations

import io
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ketch.config import ConfigError, load_config
from ketch.data.batching import position_ids
from ketch.engine.heads import PolicyModel
from ketch.models import load_causal_lm
from ketch.models.vision import image_model_inputs, load_image_processor, placeholder_token_ids
from ketch.protocol import DataProto, object_array
from ketch.rollout.base import Rollout, rollout_output
from ketch.rollout.hf import HFRollout
from ketch.rollout.multi_turn import MultiTurnRollout, ToolEnvironment, get_parser, make_tool, resolve_tools
from ketch.trainer.ppo import PPOTrainer
from tests.vision_models import save_tiny_vlm

CALL = '<tool_call>{{"name": "{}", "arguments": {{"count": 2}}}}</tool_call>'
VISION_TOKENS = 4
"""A 56 x 56 image's vision tokens in the tiny Qwen2-VL: 4 x 4 patches of 14 pixels, merged 2 x 2."""


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vlm")
    return {family: str(save_tiny_vlm(root / family, family)) for family in ("qwen2_vl", "gemma3")}


@pytest.fixture(scope="module")
def qwen_dir(vlm_dirs) -> str:
    return vlm_dirs["qwen2_vl"]


def _dots(count: int = 3) -> Image.Image:
    return resolve_tools(["draw_dots"])["draw_dots"].fn(count=count)


class ScriptedPolicy(Rollout):
    """Answers the k-th call of every row with `turns[k]` and EOS (log-prob -0.5 each); keeps each call's prompts."""

    def __init__(self, tokenizer, turns: list[str], width: int):
        self.tokenizer, self.turns, self.width, self.calls = tokenizer, turns, width, []

    def generate(self, prompts: DataProto) -> DataProto:
        self.calls.append(prompts)
        row = self.tokenizer(self.turns[len(self.calls) - 1])["input_ids"] + [self.tokenizer.eos_token_id]
        responses = torch.zeros(len(prompts), self.width, dtype=torch.long)
        responses[:, : len(row)] = torch.tensor(row)
        log_probs = torch.full(responses.shape, -0.5)
        return rollout_output(prompts, responses, log_probs, [self.tokenizer.eos_token_id], 0)

    def update_weights(self, named_tensors) -> None: ...

    def weight_norm(self, name: str) -> float:
        return 0.0


def _config(*overrides: str):
    base = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[draw_dots]", "data.max_prompt_length=64"]
    base += ["data.max_response_length=160"]
    return load_config(overrides=[*base, *overrides])


def _prompts(count: int) -> DataProto:
    """`count` rows of the dots question, one image each (the loop renders the prompts itself)."""
    columns = {
        "raw_prompt": object_array(["<image>How many red dots?"] * count),
        "images": object_array([[_dots(i + 1)] for i in range(count)]),
    }
    return DataProto.from_dict({"input_ids": torch.zeros(count, 1, dtype=torch.long)}, columns, {"temperature": 1.0})


def _scripted(qwen_dir: str, tools: dict, turns: list[str]) -> tuple[DataProto, ScriptedPolicy]:
    processor = load_image_processor(qwen_dir)
    config = _config()
    policy = ScriptedPolicy(processor.tokenizer, turns, config.data.max_response_length)
    env = lambda: ToolEnvironment(tools, get_parser("hermes"), 5.0, images=True)  # noqa: E731
    rollout = MultiTurnRollout(policy, config, processor.tokenizer, env, processor)
    return rollout.generate(_prompts(2)), policy


def test_a_tool_image_puts_its_vision_tokens_in_the_response_unsampled_and_reaches_the_backend(qwen_dir):
    out, policy = _scripted(qwen_dir, resolve_tools(["draw_dots"]), [CALL.format("draw_dots"), "#### 2"])
    b, c = out.batch, out.non_tensor_batch
    image_pad = load_image_processor(qwen_dir).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (b["prompts"] == image_pad).sum(-1).tolist() == [VISION_TOKENS, VISION_TOKENS]
    assert (b["responses"] == image_pad).sum(-1).tolist() == [VISION_TOKENS, VISION_TOKENS]
    assert b["response_mask"][b["responses"] == image_pad].sum() == 0  # never sampled
    for row in c["multi_modal_inputs"]:  # the prompt's image, then the tool's
        assert row["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
        assert row["pixel_values"].shape == (32, 1176)  # 16 patches an image, 3 x 2 x 14 x 14 values each
    # the backend got the whole context with all its images at each turn: 4 vision tokens, then 8
    assert [(call.batch["input_ids"] == image_pad).sum(-1).tolist() for call in policy.calls] == [[4, 4], [8, 8]]
    grids = [
        [len(row["image_grid_thw"]) for row in call.non_tensor_batch["multi_modal_inputs"]] for call in policy.calls
    ]
    assert grids == [[1, 1], [2, 2]]
    assert c["messages"][0][2] == {"role": "tool", "name": "draw_dots", "content": "<image>"}
    assert c["tool_calls"].tolist() == [1.0, 1.0] and c["tool_errors"].tolist() == [0.0, 0.0]


def _unreadable(count: int) -> dict:
    """Returns an image part whose bytes are no image."""
    return {"type": "image", "image": b"not an image"}


def _a_float(count: int) -> float:
    """Returns a float: neither text nor an image."""
    return 0.5


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        (_unreadable, "error: ValueError: tool 'look' returned an image that cannot be read: image 0 (12 bytes)"),
        (_a_float, "error: TypeError: tool 'look' returned float, not text or images: part 0 is a float"),
    ],
)
def test_a_bad_tool_image_is_answered_with_an_error_naming_the_tool(qwen_dir, fn, error):
    out, _ = _scripted(qwen_dir, {"look": make_tool(fn, name="look")}, [CALL.format("look"), "#### 2"])
    c = out.non_tensor_batch
    answer = c["messages"][0][2]
    assert answer["role"] == "tool" and answer["content"].startswith(error)
    assert c["tool_errors"].tolist() == [1.0, 1.0]
    assert [len(row["image_grid_thw"]) for row in c["multi_modal_inputs"]] == [1, 1]  # the prompt's only


class ImageEachTurn:
    """A user environment: answers each of the model's first two turns with a tool message holding an image of
    `turn + 1` dots and a line of text; done at the third."""

    stop = ()

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["raw_prompt"]}]

    def step(self, messages: list[dict]) -> tuple[list[dict], None, bool]:
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns > 2:
            return [], None, True
        return [{"role": "tool", "name": "draw_dots", "content": [_dots(turns), "look"]}], None, False


@pytest.mark.parametrize(
    ("family", "decoding"), [("qwen2_vl", "generate"), ("qwen2_vl", "static"), ("gemma3", "generate")]
)
def test_the_training_forward_gives_the_rollouts_log_probs_with_the_tool_images(vlm_dirs, family, decoding):
    """Three turns of a tiny random vision-language model (float32), each answered with an image: the padded (and
    for Qwen the packed) training forwards over the rows with their images give the sampled tokens the rollout's
    log-probs. Gemma 3's images (4 tokens each at 32 x 32 pixels) attend both ways within the image at every prefill
    and in the training forward alike."""
    config = _config(f"rollout.hf_decoding={decoding}", "rollout.multi_turn.max_tokens_per_turn=4")
    processor = load_image_processor(vlm_dirs[family])
    torch.manual_seed(0)
    backend = HFRollout(config, vlm_dirs[family], processor.tokenizer, torch.float32, torch.device("cpu"), 0)
    assert (backend.decoder is not None) == (decoding == "static")
    rollout = MultiTurnRollout(backend, config, processor.tokenizer, ImageEachTurn, processor)
    out = rollout.generate(_prompts(3))
    b, images = out.batch, out.non_tensor_batch["multi_modal_inputs"]
    assert [len(row.get("image_grid_thw", row["pixel_values"])) for row in images] == [3, 3, 3]  # prompt's, 1 a turn
    model = load_causal_lm(vlm_dirs[family], torch.float32)
    image_pad = placeholder_token_ids(model.config)[0]
    assert (b["responses"] == image_pad).sum(-1).tolist() == [2 * VISION_TOKENS] * 3
    sampled = b["response_mask"].bool()
    assert sampled.sum() > 0 and not (b["responses"][sampled] == image_pad).any()
    inputs = image_model_inputs(model.config, b["input_ids"], images)
    args = (b["input_ids"], b["attention_mask"], position_ids(b["attention_mask"]), b["responses"].shape[-1])
    for packed in (False, True) if family != "gemma3" else (False,):
        head = PolicyModel(model, packed=packed).eval()
        with torch.no_grad():
            log_probs = head(*args, image_inputs=inputs)["log_prob"]
        torch.testing.assert_close(log_probs[sampled], b["rollout_log_probs"][sampled], atol=1e-5, rtol=0)


ENVIRONMENT = """
from ketch.rollout.multi_turn.builtin_tools import draw_dots


class ImageEachTurn:
    stop = ()

    def reset(self, row):
        return [{"role": "user", "content": row["raw_prompt"]}]

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns > 1:
            return [], None, True
        return [{"role": "tool", "name": "draw_dots", "content": [draw_dots(count=turns)]}], None, False
"""


def test_two_grpo_steps_of_a_multi_turn_run_with_tool_images_keep_each_rows_images(tmp_path, qwen_dir):
    files = {}
    for split in ("train", "val"):
        rows = [
            {"prompt": "<image>How many red dots?", "images": [_png(_dots(i % 3))], "answer": str(i % 3)}
            for i in range(4)
        ]
        files[split] = tmp_path / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist([r | {"data_source": "ketch/dots"} for r in rows]), files[split])
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    config = load_config(
        overrides=[
            f"model.path={qwen_dir}",
            f"data.train_files=[{files['train']}]",
            f"data.val_files=[{files['val']}]",
            "data.train_batch_size=2",
            "data.max_prompt_length=48",
            "data.max_response_length=48",
            "algorithm.adv_estimator=grpo",
            "rollout.n=2",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.environment={tmp_path / 'env.py'}:ImageEachTurn",
            "rollout.multi_turn.max_tokens_per_turn=4",
            "actor.ppo_mini_batch_size=null",
            "actor.entropy_coeff=0.01",
            "trainer.total_steps=2",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            "trainer.device=cpu",
            f"trainer.default_local_dir={tmp_path / 'runs'}",
        ]
    )
    trainer = PPOTrainer(config)
    trainer._open()
    scored, score = [], trainer._score
    trainer._score = lambda batch: score(scored.append(batch) or batch)
    metrics = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    trainer.groups.shutdown()
    image_pad = load_image_processor(qwen_dir).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(scored) == 2
    for batch in scored:
        b = batch.batch
        assert not (b["responses"] == image_pad)[b["response_mask"].bool()].any()  # never sampled
        for row, images in zip(b["input_ids"], batch.non_tensor_batch["multi_modal_inputs"], strict=True):
            assert len(images["image_grid_thw"]) == 2  # the prompt's image and the one answer's
            assert (row == image_pad).sum() == images["image_grid_thw"].prod(-1).sum() // 4 == 2 * VISION_TOKENS
    assert all(m["training/rollout_probs_diff_max"] < 1e-5 for m in metrics)
    assert math.isfinite(metrics[1]["actor/pg_loss"])


def test_partial_rollouts_of_a_vision_language_model_stop_at_start_up_with_the_reason(qwen_dir):
    partial = ("rollout.partial.enable=true", "actor.rollout_is=token", "algorithm.adv_estimator=grpo")
    config = _config(f"model.path={qwen_dir}", *partial)
    with pytest.raises(ConfigError, match=r"set rollout.partial.enable=false \(the rows carried between rounds do not"):
        PPOTrainer(config)


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
