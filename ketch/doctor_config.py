"""The config rows of `ketch doctor`: the model loads, the data files read with the columns the run uses, and the
batch sizes work for this machine's world size. Built-in paths (`builtin:`) count as fine without building them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ketch.config import BatchError, KetchConfig, derive_batch_plan
from ketch.config.schema import BUILTIN_MODEL
from ketch.data import DatasetError, RLHFDataset, build_char_tokenizer, resolve_data_files
from ketch.data.loader import PromptLoader
from ketch.models import ModelLoadError, load_model_config, load_tokenizer
from ketch.preflight import Check
from ketch.rewards import UnknownDataSourceError
from ketch.rewards.registry import scorer_for

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def model_row(config: KetchConfig) -> tuple[Check, Any]:
    """The model row and the tokenizer the run would use (None when it does not load)."""
    m = config.model
    if m.path == BUILTIN_MODEL:
        return Check(
            "model", "ok", "built-in tiny model (warmed up by the first run, then cached)"
        ), build_char_tokenizer()
    fix = "set model.path to a Hugging Face model directory (config.json, weights, tokenizer) or a reachable hub id"
    try:
        model = load_model_config(m.path, m.trust_remote_code, m.override_config)
        tokenizer = load_tokenizer(m.tokenizer_path or m.path, m.trust_remote_code)
    except ModelLoadError as err:
        return Check("model", "FAIL", str(err), fix), None
    local = Path(m.path).expanduser()
    if local.is_dir() and not any(next(local.glob(pattern), None) for pattern in WEIGHT_FILES):
        return Check("model", "FAIL", f"{m.path} has a config but no weights ({', '.join(WEIGHT_FILES)})", fix), None
    architecture = ", ".join(getattr(model, "architectures", None) or [model.model_type])
    layers, hidden = getattr(model, "num_hidden_layers", "?"), getattr(model, "hidden_size", "?")
    detail = f"{m.path}: {architecture}, {layers} layers, hidden size {hidden}, vocabulary {len(tokenizer)}"
    return Check("model", "ok", detail), tokenizer


def data_row(config: KetchConfig, key: str, tokenizer) -> tuple[Check, RLHFDataset | None]:
    """`data.<key>`: the files read as the run reads them, every prompt fits, and each row can be scored."""
    name, files = f"data.{key}", getattr(config.data, key)
    if not files:
        if key == "train_files":
            return Check(name, "FAIL", "no training files", "list Parquet files in data.train_files"), None
        return Check(name, "ok", "none: validation is off"), None
    if tokenizer is None:
        return Check(name, "warn", "not checked: the model's tokenizer did not load", "fix the model row first"), None
    fix = (
        f"give readable Parquet files (local paths or fsspec URLs) in {name} with the prompt column "
        f"data.prompt_key={config.data.prompt_key!r}"
    )
    try:
        dataset = RLHFDataset(resolve_data_files(files), tokenizer, config.data)
    except (DatasetError, ValueError) as err:
        return Check(name, "FAIL", str(err), fix), None
    problem = _reward_problem(dataset, config)
    if problem:
        return Check(name, "FAIL", problem[0], problem[1]), dataset
    sources = sorted(set(map(str, dataset.rows.columns.get("data_source") or ["unknown"])))
    return Check(
        name, "ok", f"{len(dataset)} prompts in {len(files)} file(s); data_source: {', '.join(sources)}"
    ), dataset


def _reward_problem(dataset: RLHFDataset, config: KetchConfig) -> tuple[str, str] | None:
    """(detail, fix) when the rows cannot be scored: no ground truth, or a data source without a scorer."""
    if len(dataset) and dataset[0]["ground_truth"] is None:
        return (
            "the rows have no ground truth for the reward (reward_model.ground_truth, answer or ground_truth)",
            "add an `answer` column (or reward_model: {ground_truth: ...}) to the files",
        )
    if config.reward.function:
        return None
    for source in sorted(set(map(str, dataset.rows.columns.get("data_source") or ["unknown"]))):
        try:
            scorer_for(source)
        except UnknownDataSourceError as err:
            return str(err), "set each row's data_source to a known one, or reward.function=path/to/file.py:fn"
    return None


def batch_row(config: KetchConfig, train_set: RLHFDataset | None) -> Check:
    """The batch plan for this machine's world size, and enough prompts for one batch."""
    world = config.world_size(torch.cuda.is_available())
    try:
        plan = derive_batch_plan(config, world_size=world)
        if train_set is not None:
            PromptLoader(train_set, config.data.train_batch_size)
    except (BatchError, ValueError) as err:
        return Check("batch sizes", "FAIL", str(err), "change the sizes named in the detail")
    a = plan.actor
    detail = (
        f"world size {world}: {plan.prompts_per_step} prompts x {plan.samples_per_prompt} = {plan.sequences_per_step} "
        f"sequences per step, {plan.sequences_per_device} per device; actor: {a.num_mini_batches} mini-batch(es), "
        f"{a.grad_accum_steps} micro-batch(es) of {a.micro_batch_per_device} per device"
    )
    return Check("batch sizes", "ok", detail)
