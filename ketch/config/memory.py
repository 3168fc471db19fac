"""What a run keeps on each of the trainer's GPUs, by phase: the trained models' state, the frozen reference, the
hf rollout's weights and KV cache (or vLLM's share of the GPU), and the activations of one update micro-batch.
`ketch doctor` compares the larger phase with the GPU before a run starts.

The training state is float32 weights (4 bytes per parameter) and AdamW's two moments (8, none on the GPU with
`optim.offload`), with float32 gradients (4) during the update only: the FSDP engine frees them after each
optimizer step. FSDP shards it over every trainer GPU, Megatron over its tensor x pipeline group. A role that
trains LoRA adapters keeps its frozen base in model.dtype and that training state for its adapters only (counted
as on every linear layer, `all-linear`: at most what a list of layers takes); its reference is the actor itself.

Activations are an estimate for a dense decoder in bf16 (`activation_bytes`): per token and block, about 8 x
hidden + 4 x intermediate numbers are kept for the backward pass (the block's input, norms, q/k/v, attention
output, MLP projections and their activation), which came within 20% of the peaks measured on the Qwen2.5-0.5B and
7B shapes on an H200 (with the gathered bf16 weights a world of one process keeps from forward to backward); with
recomputation, each block's input (none with `model.activation_offload`) and `RECOMPUTED_BLOCKS` blocks' worth;
plus the lm-head pass's chunk of logits, whatever the rollout. The Megatron engine's are counted alike, split over
its tensor-parallel group (pipeline stages keep about one micro-batch of all layers between them). Transformers'
eager attention (Gemma 2's soft cap, GPT-OSS's sinks, or asked for) also keeps every layer's `[heads, T, T]`
scores, quadratic in the sequence length (`eager_score_bytes`: the bytes that saved-tensor hooks count on a tiny
Gemma 2 and Llama on the CPU, within 15% of the peaks measured on an H200, `benchmarks/eager_attention_memory.py`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ketch.architecture import attention_shape, intermediate_size
from ketch.config.batch import derive_batch_plan
from ketch.config.partial import in_flight_prompts
from ketch.config.schema import KetchConfig

PHASES = ("update", "generation")
RECOMPUTED_BLOCKS = 6
"""With recomputation, a block's activations per token times this (the recomputed block, its gradients, what the
compiled block saves): the 7B shape's peaks at 4,096 and 16,384 tokens per micro-batch differed by 1.45 MB a token."""
EAGER_LAYERS = 2
"""With recomputation, eager attention's scores of this many layers at once: the recomputed layer's and their
gradients."""
LM_HEAD_BYTES = 3 * 4 * 2**26
"""The lm-head pass's chunk on a GPU: 2^26 logits (`ketch.engine.fused_log_probs.LOGIT_ELEMENTS`) in about three float32
tensors at a time (the fused kernels' inputs, outputs and the gradient)."""


def gpu_memory_parts(
    config: KetchConfig, model: Any, parameters: int, gpu_bytes: int, attention: str | None = None, shared: int = 0
) -> dict[str, dict[str, int]]:
    """Bytes per GPU of each part, by phase, for a policy of `parameters` parameters whose Hugging Face config is
    `model` (layers, key/value heads, head size for the KV cache), on GPUs of `gpu_bytes` (vLLM's share). The
    critic counts as the policy's size. `attention` is transformers' attention kernel where the update's forwards
    run padded (None where they are packed): `eager` adds its attention scores. `shared` parameters the hf
    rollout reads from the actor's (`shared_rollout_parameters`) take no memory of the rollout's. Parts a phase does
    not hold are left out."""
    parts: dict[str, dict[str, int]] = {phase: {} for phase in PHASES}
    frozen = _frozen_bytes(config)
    gpus = config.num_processes(gpu_visible=True)
    trained = {"actor": config.actor} | ({"critic": config.critic} if config.use_critic else {})
    for name, role in trained.items():
        shards = role.megatron.model_parallel_size if role.strategy == "megatron" else gpus
        kept = 4 + (0 if role.optim.offload else 8)
        gradients = 4 if role.strategy == "fsdp" else 0  # the Megatron engine keeps them until its next update
        trained_count, frozen_bytes = parameters, 0
        if role.lora.enabled:
            trained_count, frozen_bytes = lora_parameters(model, role.lora.rank), parameters * frozen
        parts["update"][f"{name} state"] = (trained_count * (kept + 4) + frozen_bytes) // shards
        parts["generation"][f"{name} state"] = (trained_count * (kept + 4 - gradients) + frozen_bytes) // shards
    if config.use_reference and not config.actor.lora.enabled:
        for phase in PHASES:
            parts[phase]["reference"] = parameters * frozen // gpus
    parts["update"]["activations"] = activation_bytes(config, model)
    if attention == "eager":
        parts["update"]["eager attention scores"] = eager_score_bytes(config, model)
    if gpus == 1 and config.actor.strategy == "fsdp" and not config.model.gradient_checkpointing:
        parts["update"]["gathered weights"] = parameters * frozen  # kept from the forward to the backward pass
    r = config.rollout
    if r.placement == "standalone":
        return parts
    if r.name == "vllm":
        parts["generation"]["vLLM (rollout.gpu_memory_utilization)"] = int(r.gpu_memory_utilization * gpu_bytes)
        return parts
    own = (parameters - shared) * frozen // r.tensor_parallel_size
    rollout = {"rollout weights": own, "KV cache": _kv_bytes(config, model)}
    for phase in PHASES if not r.free_memory_while_training else ("generation",):
        parts[phase].update(rollout)
    return parts


def shared_rollout_parameters(config: KetchConfig, model: nn.Module) -> int:
    """The parameters a hybrid hf rollout reads in place from the actor's frozen ones (`Rollout.share_weights`):
    with `actor.lora` on one process (FSDP, no tensor-parallel rollout), those outside the adapted linear layers but
    the dense MLPs' gate and up projections (the static decoder computes with a fused copy of them); 0 otherwise.
    `model`: the policy built on the meta device."""
    a, r = config.actor, config.rollout
    one = a.strategy == "fsdp" and config.num_processes(gpu_visible=True) == 1 and r.tensor_parallel_size == 1
    if not (a.lora.enabled and one and r.name == "hf" and r.placement == "hybrid"):
        return 0
    targets = [a.lora.target_modules] if isinstance(a.lora.target_modules, str) else list(a.lora.target_modules)
    output = model.get_output_embeddings()
    adapted = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not output
        and (targets == ["all-linear"] or name.rpartition(".")[2] in targets)
    }  # fmt: skip
    fused = ("gate_proj.weight", "up_proj.weight")
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.rpartition(".")[0] not in adapted and not name.endswith(fused)
    )


def lora_parameters(model: Any, rank: int) -> int:
    """Adapter parameters of rank `rank` on every linear layer of the decoder blocks of the HF config `model` (q, k,
    v, o; gate, up, down): rank x (inputs + outputs) of each."""
    shape, hidden = attention_shape(model), model.hidden_size
    queries, keys = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = 2 * (hidden + queries) + 2 * (hidden + keys) + 3 * (hidden + intermediate_size(model))
    return rank * per_layer * model.num_hidden_layers


def activation_bytes(config: KetchConfig, model: Any) -> int:
    """The activations of one actor update micro-batch on one GPU (see the module's docstring): its tokens (a token
    budget, or the micro-batch's sequences of data.max_prompt_length + data.max_response_length tokens; a sequence
    longer than the budget alone), shared over the sequence-parallel ranks (Megatron's tensor-parallel ones)."""
    m, a = config.model, config.actor
    shards = a.megatron.tensor_model_parallel_size if a.strategy == "megatron" else a.ulysses_sequence_parallel_size
    tokens = -(-_micro_batch_tokens(config) // shards)
    width = _frozen_bytes(config)
    block = (8 * model.hidden_size + 4 * intermediate_size(model)) * width
    if not m.gradient_checkpointing:
        return tokens * model.num_hidden_layers * block + LM_HEAD_BYTES
    checkpoints = 0 if m.activation_offload else model.num_hidden_layers * model.hidden_size * width
    return tokens * (RECOMPUTED_BLOCKS * block + checkpoints) + LM_HEAD_BYTES


def eager_score_bytes(config: KetchConfig, model: Any) -> int:
    """The attention scores that transformers' eager attention keeps in one actor update micro-batch on one GPU:
    `[sequences, heads, T, T]` in each layer for T = data.max_prompt_length + data.max_response_length (the
    sequence-parallel ranks share the heads), each score as softmax's float32 output and model.dtype's copy of it,
    with a soft cap (Gemma 2) also the cap's tanh; with recomputation `EAGER_LAYERS` layers' worth. Flash and SDPA
    kernels keep none of it."""
    sequence = _sequence_length(config)
    sequences = max(1, _micro_batch_tokens(config) // sequence)
    heads = -(-attention_shape(model).heads // config.actor.ulysses_sequence_parallel_size)
    width = _frozen_bytes(config)
    per_score = 4 + width + (width if getattr(model, "attn_logit_softcapping", None) else 0)
    layers = EAGER_LAYERS if config.model.gradient_checkpointing else model.num_hidden_layers
    return sequences * heads * sequence**2 * per_score * layers


def _micro_batch_tokens(config: KetchConfig) -> int:
    """Tokens of one actor update micro-batch on one GPU: the token budget (a sequence longer than it alone), or
    the micro-batch's sequences of data.max_prompt_length + data.max_response_length tokens."""
    a, sequence = config.actor, _sequence_length(config)
    if a.use_dynamic_bsz:
        return max(a.ppo_max_token_len_per_device, sequence)
    plan = derive_batch_plan(config, world_size=config.world_size(gpu_visible=True))
    return plan.actor.micro_batch_per_device * sequence


def _sequence_length(config: KetchConfig) -> int:
    """The longest sequence: data.max_prompt_length + data.max_response_length."""
    return config.data.max_prompt_length + config.data.max_response_length


def _kv_bytes(config: KetchConfig, model: Any) -> int:
    """The hf rollout's KV cache on one GPU at most: its tensor-parallel group's share of the step's sequences (with
    partial rollouts, of the prompts in flight; at most the rows that rollout.max_num_batched_tokens holds), each of
    up to data.max_prompt_length + data.max_response_length tokens, keys and values in every layer. The static
    decoder's paged cache holds less where responses end early (`ketch/rollout/kv_pages.py`); this is its size when
    every response runs to the limit. An FP8 cache (`rollout.kv_cache_dtype=fp8`) takes a byte a number."""
    r, sequence = config.rollout, _sequence_length(config)
    groups = max(1, config.rollout_processes(gpu_visible=True) // r.tensor_parallel_size)
    prompts = in_flight_prompts(config) if r.partial.enable else config.data.train_batch_size
    rows = -(-prompts * r.n // groups)
    if r.max_num_batched_tokens is not None:
        rows = min(rows, max(1, r.max_num_batched_tokens // sequence))
    shape = attention_shape(model)
    per_token = model.num_hidden_layers * 2 * max(1, shape.kv_heads // r.tensor_parallel_size) * shape.head_dim
    return rows * sequence * per_token * (1 if r.kv_cache_dtype == "fp8" else _frozen_bytes(config))


def _frozen_bytes(config: KetchConfig) -> int:
    """Bytes per number of the reference, the rollout and its KV cache: model.dtype (auto: bfloat16 on GPUs)."""
    return 4 if config.model.dtype == "float32" else 2
