"""The config rows of `ketch doctor`: the model loads (a decoder-only causal LM), the data files read with the
columns the run uses, the batch sizes work for this machine's world size, which code paths the model takes, and
model parallelism (Megatron, a tensor-parallel rollout) fits the model and this machine. Built-in paths
(`builtin:`) count as fine without building them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ketch.architecture import (
    attention_implementation,
    attention_implementation_problem,
    causal_lm_problem,
    packing_problem,
    static_decoding_problem,
)
from ketch.config import BatchError, KetchConfig, derive_batch_plan
from ketch.config.memory import gpu_memory_parts, shared_rollout_parameters
from ketch.config.parallel import (
    megatron_roles,
    megatron_start_problems,
    rollout_start_problems,
    sequence_parallel_problem,
)
from ketch.config.partial import describe_partial_rollouts
from ketch.config.schema import BUILTIN_MODEL
from ketch.controller.errors import HOST_MEMORY_FIX
from ketch.data import DatasetError, RLHFDataset, build_char_tokenizer, resolve_data_files
from ketch.data.prompt_loader import PromptLoader
from ketch.disk import size_text
from ketch.models import ModelLoadError, load_model_config, load_tokenizer
from ketch.models.gguf import cached_gguf_model, is_gguf
from ketch.models.vision import image_processor_for
from ketch.rewards import UnknownDataSourceError
from ketch.rewards.registry import scorer_for
from ketch.trainer.builtin import WARMUPS, cached_builtin_model
from ketch.trainer.preflight import GIB, Check

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
TIGHT = 0.85
"""Share of a GPU above which what a run keeps there leaves too little for the activations."""


def model_row(config: KetchConfig) -> tuple[Check, Any, Any, Any]:
    """The model row, the tokenizer the run would use, the model's Hugging Face config and a vision-language
    model's image processor (each None when it does not load; the config also for a built-in model that no run has
    built yet)."""
    m = config.model
    if m.path == BUILTIN_MODEL:
        return (
            Check("model", "ok", "built-in tiny model (warmed up by the first run, then cached)"),
            build_char_tokenizer(),
            None,
            None,
        )
    built = cached_builtin_model(m.path) if m.path in WARMUPS else None
    if m.path in WARMUPS and built is None:
        detail = f"{m.path}, a built-in model (warmed up by the first run, then cached)"
        return Check("model", "ok", detail), None, None, None
    fix = "set model.path to a Hugging Face model directory (config.json, weights, tokenizer), a .gguf file or a hub id"
    try:
        path = str(built or (cached_gguf_model(m.path) if is_gguf(m.path) else m.path))  # as a run resolves it
        model = load_model_config(path, m.trust_remote_code, m.override_config)
        tokenizer = load_tokenizer(m.tokenizer_path or path, m.trust_remote_code, path)
    except ModelLoadError as err:
        return Check("model", "FAIL", str(err), fix), None, None, None
    local = Path(path).expanduser()
    if local.is_dir() and not any(next(local.glob(pattern), None) for pattern in WEIGHT_FILES):
        detail = f"{m.path} has a config but no weights ({', '.join(WEIGHT_FILES)})"
        return Check("model", "FAIL", detail, fix), None, None, None
    problem = causal_lm_problem(model)
    if problem:
        return Check("model", "FAIL", f"{m.path}: {problem}", "ketch trains decoder-only causal LMs"), None, None, None
    architecture = ", ".join(getattr(model, "architectures", None) or [model.model_type])
    text = model.get_text_config()  # a vision-language model's language model
    layers, hidden = getattr(text, "num_hidden_layers", "?"), getattr(text, "hidden_size", "?")
    detail = f"{m.path}: {architecture}, {layers} layers, hidden size {hidden}, vocabulary {len(tokenizer)}"
    return Check("model", "ok", detail), tokenizer, model, image_processor_for(model, path, tokenizer)


def paths_row(config: KetchConfig, model_config: Any, gpu_visible: bool) -> Check | None:
    """Which code paths the run's model takes (`ketch/architecture.py`): packed or padded training forwards, the
    hf rollout's static decoder or `generate`, and the attention kernel of the padded forwards and `generate` (a
    warning where it would change the model's logits); None without a model config or where the model does not
    build."""
    model = meta_model(model_config, config.model.trust_remote_code) if model_config is not None else None
    if model is None:
        return None
    gpu = config.uses_gpu(gpu_visible)
    m, r = config.model, config.rollout
    training = _training_forwards(config, model, gpu)
    static = r.hf_decoding == "static" or (r.hf_decoding == "auto" and gpu)
    if r.name != "hf":
        rollout = r.name
    elif not static:
        rollout = (
            "generate (rollout.hf_decoding="
            + r.hf_decoding
            + (", static on GPUs only)" if r.hf_decoding == "auto" else ")")
        )
    else:
        problem = static_decoding_problem(model)
        rollout = f"generate: {problem}" if problem else "static decoder"
    paths = f"training forwards {training}; rollout: {rollout}; transformers attention: {_attention(config, model)}"
    problem = attention_implementation_problem(model_config, m.attn_implementation)
    return Check("model paths", "warn" if problem else "ok", f"{type(model).__name__}: {paths}", problem or "")


def _training_forwards(config: KetchConfig, model: torch.nn.Module, gpu: bool) -> str:
    """How the actor's training forwards run for the meta-device `model`: Megatron-Core, packed, or padded and
    why."""
    m = config.model
    if config.actor.strategy == "megatron":
        return "Megatron-Core (actor.strategy=megatron)"
    if not (m.use_remove_padding if m.use_remove_padding is not None else gpu):
        return "padded (model.use_remove_padding is off" + (" on CPUs)" if m.use_remove_padding is None else ")")
    problem = packing_problem(model)
    return f"padded: {problem}" if problem else "packed, padding-free"


def _attention(config: KetchConfig, model: torch.nn.Module) -> str:
    """Transformers' attention kernel for the meta-device `model`'s padded forwards and `generate`."""
    requested = config.model.attn_implementation
    return attention_implementation(model.config, requested) or model.config._attn_implementation


def parallel_row(config: KetchConfig, model_config: Any) -> Check | None:
    """Megatron and tensor-parallel rollout sizes checked as a run checks them at start-up (megatron-core
    installed, a GPU, sizes that divide the model's heads and layers); None when the run uses neither."""
    roles = megatron_roles(config)
    rollout_tp, sequence_parallel = config.rollout.tensor_parallel_size, config.actor.ulysses_sequence_parallel_size
    if not roles and rollout_tp == 1 and sequence_parallel == 1:
        return None
    if model_config is None:
        detail = "not checked: no model config (the built-in model is built by the first run; or see the model row)"
        return Check("parallelism", "warn", detail, "")
    problems = megatron_start_problems(config, model_config, torch.cuda.is_available())
    problems += rollout_start_problems(config, model_config)
    problems += [p for p in [sequence_parallel_problem(sequence_parallel, model_config)] if p]
    if problems:
        return Check("parallelism", "FAIL", "; ".join(problems), "change the keys named in the detail")
    grids = [
        f"{name}: Megatron TP={m.tensor_model_parallel_size} x PP={m.pipeline_model_parallel_size}"
        for name, m in roles.items()
    ]
    sizes = [*grids, f"rollout TP={rollout_tp}"] + [f"sequence parallel={sequence_parallel}"] * (sequence_parallel > 1)
    return Check("parallelism", "ok", "; ".join(sizes) + ": they fit the model")


def data_row(
    config: KetchConfig, key: str, tokenizer, processor: Any | None = None
) -> tuple[Check, RLHFDataset | None]:
    """`data.<key>`: the files read as the run reads them (with a vision-language model's `processor`, the images
    too), every prompt fits, and each row can be scored."""
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
        dataset = RLHFDataset(resolve_data_files(files), tokenizer, config.data, processor)
    except (DatasetError, ValueError) as err:
        return Check(name, "FAIL", str(err), fix), None
    problem = _reward_problem(dataset, config)
    if problem:
        return Check(name, "FAIL", problem[0], problem[1]), dataset
    sources = sorted(set(map(str, dataset.rows.columns.get("data_source") or ["unknown"])))
    return Check(
        name, "ok", f"{len(dataset)} prompts in {len(dataset.rows.files)} file(s); data_source: {', '.join(sources)}"
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


def memory_row(config: KetchConfig, model_config: Any, gpu_bytes: int | None) -> Check | None:
    """What the run keeps on each GPU, per phase, the update's activations for the configured lengths included
    (`ketch/config/memory.py`), against a GPU of `gpu_bytes` (None: none here to compare with); None for a run on
    CPUs or without a model config."""
    if model_config is None or not config.uses_gpu(gpu_bytes is not None):
        return None
    model = meta_model(model_config, config.model.trust_remote_code)
    if model is None:
        return Check("GPU memory", "warn", "not estimated: the model's architecture did not build without weights")
    parameters = sum(p.numel() for p in model.parameters())
    padded = _training_forwards(config, model, gpu=True).startswith("padded")
    attention = _attention(config, model) if padded else None
    shared = shared_rollout_parameters(config, model)
    phases = gpu_memory_parts(config, model_config, parameters, gpu_bytes or 0, attention, shared)
    listed = [
        f"{phase} {sum(parts.values()) / GIB:.1f} GiB ("
        + ", ".join(f"{part} {size / GIB:.1f}" for part, size in parts.items())
        + ")"
        for phase, parts in phases.items()
    ]
    gpus = config.num_processes(gpu_visible=True)
    size = f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"
    detail = f"{size} parameters on {gpus} GPU(s), per GPU: " + "; ".join(listed)
    if gpu_bytes is None:
        return Check("GPU memory", "ok", detail + "; no GPU here to compare with")
    most = max(sum(parts.values()) for parts in phases.values())
    detail += f"; the GPU has {gpu_bytes / GIB:.1f} GiB"
    if most <= TIGHT * gpu_bytes:
        return Check("GPU memory", "ok", detail)
    fix = _memory_fix(config, eager=attention == "eager")
    return Check("GPU memory", "FAIL" if most > gpu_bytes else "warn", detail, fix)


def _memory_fix(config: KetchConfig, eager: bool) -> str:
    """The settings that shrink what a run keeps on each GPU, those that are off: the state's, then the
    activations' (with `eager` attention, also a kernel that keeps no scores)."""
    roles = {"actor": config.actor} | ({"critic": config.critic} if config.use_critic else {})
    switches = [f"{n}.optim.offload=true" for n, r in roles.items() if r.strategy == "fsdp" and not r.optim.offload]
    r = config.rollout
    if r.name == "hf" and r.placement == "hybrid" and not r.free_memory_while_training:
        switches.append("rollout.free_memory_while_training=true")
    if r.name == "hf" and r.placement == "hybrid" and r.max_num_batched_tokens is None:
        switches.append("rollout.max_num_batched_tokens (the KV cache's tokens)")
    if eager:
        switches.append("model.attn_implementation=flash_attention_2 (where installed and the model takes it)")
    switches += _activation_switches(config)
    return " or ".join([*switches, "more GPUs (trainer.n_gpus_per_node, trainer.nnodes)", "Megatron TP/PP"])


def _activation_switches(config: KetchConfig) -> list[str]:
    """The settings that shrink the update's activations, those that are off (FSDP engine)."""
    m, a = config.model, config.actor
    if a.strategy != "fsdp":
        return []
    switches = ["model.gradient_checkpointing=true"] if not m.gradient_checkpointing else []
    if not m.activation_offload:
        switches.append("model.activation_offload=true")
    if a.use_dynamic_bsz:
        switches.append(f"a smaller actor.ppo_max_token_len_per_device (now {a.ppo_max_token_len_per_device})")
    else:
        switches.append("actor.use_dynamic_bsz=true with actor.ppo_max_token_len_per_device")
    if config.num_processes(gpu_visible=True) > a.ulysses_sequence_parallel_size:
        switches.append("actor.ulysses_sequence_parallel_size > 1 (over the GPUs of a node)")
    return switches


def meta_model(model_config: Any, trust_remote_code: bool) -> torch.nn.Module | None:
    """The causal LM that `model_config` describes, built on the meta device without weights; None where the
    architecture does not build that way."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, ImportError, RuntimeError, AttributeError):
        return None


def host_memory_row(config: KetchConfig, model_config: Any, available: int | None) -> Check | None:
    """What the worker processes of one node hold in host memory at start-up, against the `available` bytes
    (`MemAvailable`; None: unknown here): each process loads the full weights of each of its models before it keeps
    its shard, and on CPUs the training state (16 bytes per trained parameter) stays there too. None without a model
    config (the built-in model is small) or a figure to compare with."""
    model = meta_model(model_config, config.model.trust_remote_code) if model_config is not None else None
    if model is None or available is None:
        return None
    parameters = sum(p.numel() for p in model.parameters())
    gpu = config.uses_gpu(torch.cuda.is_available())
    loaded = {"float32": 4, "auto": 2 if gpu else 4}.get(config.model.dtype, 2)
    models = 1 + (config.use_reference and not config.actor.lora.enabled) + config.use_critic
    processes = config.num_processes(gpu) // config.trainer.nnodes
    needed = processes * models * parameters * loaded
    if not gpu:
        needed += (1 + config.use_critic) * parameters * 16
    detail = (
        f"about {size_text(needed)} for {processes} worker process(es) x {models} model(s) of {parameters:,} "
        f"parameters; {size_text(available)} available"
    )
    if needed <= TIGHT * available:
        return Check("host memory", "ok", detail)
    return Check("host memory", "FAIL" if needed > available else "warn", detail, HOST_MEMORY_FIX)


def available_host_memory() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    found = next((line.split()[1] for line in lines if line.startswith("MemAvailable:")), None)
    return int(found) * 1024 if found else None


def partial_row(config: KetchConfig) -> Check:
    """Whether partial rollouts are on and what bounds them (`rollout.partial`; a combination they cannot run with
    is refused when the config loads)."""
    return Check("partial rollouts", "ok", describe_partial_rollouts(config))


def mismatch_row(config: KetchConfig) -> Check:
    """The first step's check that the rollout samples from the model the update trains (`actor.mismatch_check`),
    made on the first two prompts of the training data as a run makes it (`mismatch_guard.check_two_prompts`)."""
    from ketch.controller.errors import describe
    from ketch.trainer.mismatch_guard import check_two_prompts

    name, mode = "rollout vs training", config.actor.mismatch_check
    if mode == "off":
        return Check(name, "ok", "not checked (actor.mismatch_check=off)")
    try:
        mismatch, message = check_two_prompts(config)
    except Exception as err:  # the model or data rows above say why where they can
        return Check(name, "warn", f"not checked: {describe(err)}", "fix the rows above first")
    if message is None:
        detail = (
            f"two prompts sampled and scored: probabilities within {mismatch.largest:.1e} (mean {mismatch.mean:.1e})"
        )
        return Check(name, "ok", detail)
    fix = "the run would stop at its first step" if mode == "error" else "the run would warn and train on"
    return Check(name, "FAIL" if mode == "error" else "warn", message, fix)
