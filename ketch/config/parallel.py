"""Checks of the training strategy (`actor.strategy`, `critic.strategy`), Megatron model parallelism, the
tensor-parallel rollout (`rollout.tensor_parallel_size`; the model's head counts are checked when it is built) and
the FP8 rollout's device (`rollout.quantization`).

`megatron_problems` needs the config alone and runs with the other checks when the config loads;
`check_megatron_start` also needs the model's Hugging Face config and this machine (megatron-core installed,
a GPU visible), so the trainers call it at start-up, before any worker starts.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ketch.architecture import attention_shape, is_vision_model, router, tensor_parallel_problems
from ketch.config.errors import raise_problems
from ketch.config.schema import KetchConfig, MegatronConfig


def megatron_roles(config: KetchConfig) -> dict[str, MegatronConfig]:
    """The trained roles with `strategy=megatron`, by config section name (the reference follows the actor)."""
    roles = {"actor": config.actor} | ({"critic": config.critic} if config.use_critic else {})
    return {name: role.megatron for name, role in roles.items() if role.strategy == "megatron"}


def megatron_problems(config: KetchConfig) -> list[str]:
    """What in the config alone stops a Megatron run: sizes, device, and roles whose sizes disagree."""
    roles = megatron_roles(config)
    problems = [p for name, m in roles.items() for p in _sizes(name, m)]
    if "actor" in roles and config.rollout.check_weight_sync:
        problems.append("rollout.check_weight_sync reads FSDP parameters; turn it off with actor.strategy=megatron")
    problems += [
        f"{name}.optim.offload keeps FSDP's AdamW moments in host memory and is not built for {name}.strategy="
        "megatron: leave it off, or train with strategy=fsdp"
        for name, role in _trained(config)
        if name in roles and role.optim.offload
    ]
    if roles and config.trainer.device == "cpu":
        problems.append(f"{next(iter(roles))}.strategy=megatron trains on GPUs only, but trainer.device=cpu")
    gpus = config.num_processes(gpu_visible=True)
    for name, m in roles.items():
        if m.model_parallel_size >= 1 and gpus % m.model_parallel_size:
            problems.append(
                f"{name}.megatron.tensor_model_parallel_size x pipeline_model_parallel_size = "
                f"{m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size} does not divide the "
                f"{gpus} GPUs (trainer.nnodes x trainer.n_gpus_per_node)"
            )
    if config.use_critic:
        sizes = {n: r.megatron.model_parallel_size if r.strategy == "megatron" else 1 for n, r in _trained(config)}
        if sizes["actor"] != sizes["critic"]:
            problems.append(
                f"actor and critic need the same data-parallel size, but their tensor x pipeline sizes are {sizes}; "
                "give both the same strategy and megatron sizes"
            )
    return problems


def rollout_problems(config: KetchConfig) -> list[str]:
    """What in the config alone stops a tensor-parallel hf rollout: its size must divide the processes, and the
    turn loop (whose turns differ between the ranks of a group) is not supported with it."""
    r = config.rollout
    key = f"rollout.tensor_parallel_size={r.tensor_parallel_size}"
    if r.tensor_parallel_size == 1 or r.name != "hf":
        return []
    processes = config.rollout_processes(gpu_visible=config.trainer.device != "cpu")
    problems = []
    if processes % r.tensor_parallel_size:
        where = "trainer.nnodes x " + (
            "rollout.n_workers_per_node"
            if r.placement == "standalone"
            else ("trainer.n_cpu_workers" if config.trainer.device == "cpu" else "trainer.n_gpus_per_node")
        )
        problems.append(f"{key} does not divide the {processes} worker processes ({where}); pick a divisor of it")
    if r.multi_turn.enable:
        problems.append(
            f"{key} decodes a group's prompts together, one call at a time: set it to 1 for "
            "rollout.multi_turn.enable=true"
        )
    return problems


def check_rollout_start(config: KetchConfig, model_config: Any) -> None:
    """Raise `ConfigError` when a tensor-parallel hf rollout cannot split `model_config` (the Hugging Face config
    of the policy); the trainers call it at start-up, before any worker starts."""
    raise_problems(rollout_start_problems(config, model_config))


def rollout_start_problems(config: KetchConfig, model_config: Any) -> list[str]:
    """What `check_rollout_start` raises, one line a problem."""
    r = config.rollout
    problems = tensor_parallel_problems(r.tensor_parallel_size, model_config) if r.name == "hf" else []
    for check in (fp8_rollout_problem, fp8_cache_problem):
        if problem := check(config, torch.cuda.is_available()):
            problems.append(problem)
    if config.actor.router_replay != "off" and router(model_config) is None:
        problems.append(
            f"actor.router_replay={config.actor.router_replay} replays a mixture of experts' routing, and "
            f"model_type={model_config.model_type!r} has no router (not a mixture of experts): set "
            "actor.router_replay=off"
        )
    return problems


def check_vision_start(config: KetchConfig, model_config: Any) -> None:
    """Raise `ConfigError` when the run asks a vision-language policy (`model_config`) for something ketch does not
    do with images yet; the trainers call it at start-up, before any worker starts."""
    raise_problems(vision_start_problems(config, model_config))


def vision_start_problems(config: KetchConfig, model_config: Any) -> list[str]:
    """What `check_vision_start` raises, one line a problem (none for a text-only model)."""
    if not is_vision_model(model_config):
        return []
    c, name = config, f"model.path={config.model.path} is a vision-language model ({model_config.model_type}), and"
    vllm = "rollout.name=hf (the vLLM backend is not run with images yet: its image processing needs torchvision)"
    partial = "rollout.partial.enable=false (the rows carried between rounds do not hold their images yet)"
    unsupported = {
        vllm: c.rollout.name != "hf",
        "rollout.tensor_parallel_size=1": c.rollout.tensor_parallel_size > 1,
        partial: c.rollout.partial.enable,
        "actor.strategy=fsdp": c.actor.strategy != "fsdp",
        "actor.ulysses_sequence_parallel_size=1": c.actor.ulysses_sequence_parallel_size > 1,
        "critic.strategy=fsdp": c.use_critic and c.critic.strategy != "fsdp",
        "critic.lora.rank=0 (a critic on the whole model)": c.use_critic and c.critic.lora.enabled,
    }
    return [
        f"{name} ketch does not train one with images under other settings yet: set {fix}"
        for fix, asked in unsupported.items()
        if asked
    ]


def fp8_cache_problem(config: KetchConfig, gpu_visible: bool) -> str | None:
    """Why `rollout.kv_cache_dtype=fp8` has no cache to round here: an hf rollout that decodes with `generate`
    (`rollout.hf_decoding=auto` on the CPU), whose cache is transformers' own."""
    r = config.rollout
    if r.kv_cache_dtype != "fp8" or r.name != "hf" or r.hf_decoding != "auto" or config.uses_gpu(gpu_visible):
        return None
    return (
        "rollout.kv_cache_dtype=fp8 is the static decoder's cache, and rollout.hf_decoding=auto decodes with "
        "generate on the CPU: set rollout.hf_decoding=static or rollout.kv_cache_dtype=auto"
    )


def fp8_rollout_problem(config: KetchConfig, gpu_visible: bool) -> str | None:
    """Why `rollout.quantization=fp8` cannot decode here: the CPU, or (hf rollout) a GPU older than compute
    capability 8.9, which has no FP8 matmuls (vLLM picks its own FP8 kernels)."""
    if config.rollout.quantization != "fp8":
        return None
    if not config.uses_gpu(gpu_visible):
        return (
            "rollout.quantization=fp8 decodes with FP8 matmuls on GPUs, and this run decodes on the CPU "
            "(trainer.device): set rollout.quantization=none"
        )
    capability = torch.cuda.get_device_capability()
    if config.rollout.name == "hf" and capability < (8, 9):
        return (
            f"rollout.quantization=fp8 needs FP8 matmuls (compute capability 8.9 or newer: Ada, Hopper, Blackwell), "
            f"and this GPU, {torch.cuda.get_device_name()}, has compute capability {capability[0]}.{capability[1]}: "
            "set rollout.quantization=none"
        )
    return None


def sequence_parallel_problem(size: int, model_config: Any) -> str | None:
    """Why `size` ranks cannot share the attention heads of the model that `model_config` describes (each rank
    attends with an equal share of the query heads and of the key/value heads), or None."""
    shape = attention_shape(model_config)
    if shape.heads % size or shape.kv_heads % size:
        return (
            f"actor.ulysses_sequence_parallel_size={size} must divide the model's attention heads ({shape.heads}) "
            f"and key/value heads ({shape.kv_heads}); pick a common divisor"
        )
    return None


def _trained(config: KetchConfig) -> list[tuple[str, Any]]:
    return [("actor", config.actor)] + ([("critic", config.critic)] if config.use_critic else [])


def _sizes(name: str, m: MegatronConfig) -> list[str]:
    key = f"{name}.megatron"
    problems = []  # the sizes themselves are >= 1: validate.RANGES checks them first
    if (m.virtual_pipeline_model_parallel_size or 1) > 1 and m.pipeline_model_parallel_size < 2:
        problems.append(
            f"{key}.virtual_pipeline_model_parallel_size={m.virtual_pipeline_model_parallel_size} interleaves "
            f"pipeline stages, but {key}.pipeline_model_parallel_size={m.pipeline_model_parallel_size}; "
            "set the pipeline size >= 2 or the virtual size to null"
        )
    if m.sequence_parallel and m.tensor_model_parallel_size < 2:
        problems.append(
            f"{key}.sequence_parallel=true splits activations over tensor-parallel ranks, but "
            f"{key}.tensor_model_parallel_size={m.tensor_model_parallel_size}; set it >= 2 or turn it off"
        )
    return problems


def check_megatron_start(config: KetchConfig, model_config: Any, gpu_visible: bool) -> None:
    """Raise `ConfigError` when a Megatron role cannot start here: megatron-core missing, no GPU, or sizes
    that do not fit the model (`model_config`: the Hugging Face config of the trained model)."""
    raise_problems(megatron_start_problems(config, model_config, gpu_visible))


def megatron_start_problems(config: KetchConfig, model_config: Any, gpu_visible: bool) -> list[str]:
    """What `check_megatron_start` raises, one line a problem."""
    roles = megatron_roles(config)
    if not roles:
        return []
    first = next(iter(roles))
    problems = []
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        problems.append(
            f"{first}.strategy=megatron needs megatron-core, which is not installed: pip install 'ketch[megatron]'"
        )
    if not config.uses_gpu(gpu_visible):
        problems.append(f"{first}.strategy=megatron trains on GPUs only, and this machine shows none (trainer.device)")
    for name, m in roles.items():
        problems += _model_fit(name, m, model_config)
    return problems


def _model_fit(name: str, m: MegatronConfig, model_config: Any) -> list[str]:
    tp, pp, vpp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    shape = attention_shape(model_config)
    layers = model_config.num_hidden_layers
    key = f"{name}.megatron"
    problems = [
        f"{key}.tensor_model_parallel_size={tp} does not divide the model's {what}={count}; pick a divisor of it"
        for what, count in (
            ("num_attention_heads", shape.heads),
            ("num_key_value_heads", shape.kv_heads),
            ("vocab_size", model_config.vocab_size),
        )
        if count % tp
    ]
    if pp > layers:
        problems.append(
            f"{key}.pipeline_model_parallel_size={pp} is larger than the model's {layers} layers (num_hidden_layers)"
        )
    elif layers % (pp * (vpp or 1)):
        problems.append(
            f"{key}.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vpp or 1} does not "
            f"divide the model's {layers} layers (num_hidden_layers)"
        )
    return problems
