"""Write models as Hugging Face directories that `from_pretrained` and `vllm serve` load as they are.

Weights come either from a live engine (gathered from the FSDP shards one parameter at a time) or from a
sharded checkpoint (read on the CPU with no process group), and are written by `save_pretrained` on a
model skeleton on the meta device, so no second copy of the weights is ever allocated. A directory is written
under a temporary name next to its place and moved there only when complete: a failed write (a full disk)
leaves no directory that looks like a model without its weights.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GenerationConfig,
)

from ketch.architecture import is_vision_model
from ketch.disk import free_space, size_text, write_error_cause
from ketch.engine.engine import TrainEngine

WRAPPER_PREFIXES = ("lm.", "critic.", "reward_model.")
"""Submodule names of `PolicyModel` / `ValueModel` / `ScoreModel` in front of the HF parameter names."""


class ExportError(RuntimeError):
    """A model directory could not be written (disk full, file too large, I/O error); the message names the
    directory, the bytes it needs and the bytes free."""


def is_critic_config(hf_config) -> bool:
    return any(name.endswith("ForTokenClassification") for name in hf_config.architectures or [])


def is_reward_model_config(hf_config) -> bool:
    return any(name.endswith("ForSequenceClassification") for name in hf_config.architectures or [])


def _auto_class(hf_config):
    if is_vision_model(hf_config):
        return AutoModelForImageTextToText
    if is_critic_config(hf_config):
        return AutoModelForTokenClassification
    return AutoModelForSequenceClassification if is_reward_model_config(hf_config) else AutoModelForCausalLM


def write_hf_directory(
    state: dict[str, torch.Tensor],
    hf_config,
    out_dir: str | Path,
    tokenizer=None,
    stop_token_ids: list[int] | None = None,
    engine_config: dict[str, Any] | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Save `state` (HF parameter names) with `hf_config` as safetensors (sharded with an index above
    `max_shard_size`), plus the tokenizer, a generation config whose EOS ids are `stop_token_ids`, and
    `vllm_engine_config.json` when `engine_config` is given. The files appear in `out_dir` only once all are
    written; a failed write raises `ExportError` and leaves `out_dir` as it was."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    needed = sum(t.numel() * t.element_size() for t in state.values())  # save_pretrained empties `state`
    try:
        _write_files(staging, state, hf_config, tokenizer, stop_token_ids, engine_config, max_shard_size)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if (cause := write_error_cause(err)) is None:
            raise
        raise ExportError(
            f"could not write the model to {out} ({cause}); its weights need about {size_text(needed)} and "
            f"{free_space(out.parent)}"
        ) from err
    _move_into_place(staging, out)
    return out


def _write_files(out: Path, state, hf_config, tokenizer, stop_token_ids, engine_config, max_shard_size: str) -> None:
    """The files of `write_hf_directory`, written into `out`."""
    out.mkdir()
    with torch.device("meta"):
        skeleton = _auto_class(hf_config).from_config(hf_config)
    skeleton.save_pretrained(out, state_dict=state, max_shard_size=max_shard_size, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if stop_token_ids and not is_critic_config(hf_config):
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        GenerationConfig(
            eos_token_id=list(stop_token_ids), pad_token_id=pad, bos_token_id=hf_config.get_text_config().bos_token_id
        ).save_pretrained(out)
    if engine_config is not None:
        (out / "vllm_engine_config.json").write_text(json.dumps(engine_config, indent=2))


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename the complete `staging` to `out`; into an existing `out` (another export's, or a directory the user
    named), its files are moved one by one, `config.json` last, so that `out` holds a model's config only once
    its weights are there."""
    if not out.exists():
        staging.rename(out)
        return
    for name in sorted(os.listdir(staging), key=lambda name: name == "config.json"):
        os.replace(staging / name, out / name)
    staging.rmdir()


def gather_hf_state(engine: TrainEngine, keep: bool = True) -> dict[str, torch.Tensor]:
    """Full weights of a live engine on the CPU, by HF name. Every rank must call (the gathers are collective);
    a rank with `keep=False` takes part but keeps nothing (returns {}), so only the writing rank holds a copy."""
    state = {}
    for name, tensor in engine.full_parameters():
        if keep:
            state[_hf_name(name)] = tensor.to("cpu", copy=True)  # the gathered unit is freed after the next
    return state


def gather_trained_state(engine: TrainEngine, keep: bool = True) -> dict[str, torch.Tensor]:
    """The trained parameters of a live engine (LoRA adapters, a head trained with them) on the CPU, by HF name;
    every rank calls, as for `gather_hf_state`."""
    state = {}
    for name, tensor in engine.trained_parameters():
        if keep:
            state[_hf_name(name)] = tensor.to("cpu", copy=True)
    return state


def load_checkpoint_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """Model weights of a sharded engine checkpoint (see `engine.checkpoint`, or the Megatron engine's), merged
    on the CPU, by HF name."""
    manifest = Path(directory) / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("format") == "megatron":
        from ketch.engine.megatron.checkpoint import load_megatron_state

        return load_megatron_state(directory)
    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.")
    }
    state = {"model": model}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return {_hf_name(name): tensor for name, tensor in state["model"].items()}


def _hf_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name
