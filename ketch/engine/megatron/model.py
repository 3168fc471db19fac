"""An HF Llama/Qwen2/Qwen3 config as a Megatron-Core `TransformerConfig` and the `GPTModel` chunks of this rank.

Only Megatron-Core's own modules are used (its local layer spec: Megatron's dot-product attention, with the
torch RMSNorm below), so neither Transformer Engine nor Apex is needed.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from torch.utils.checkpoint import checkpoint

from ketch.config.schema import MegatronConfig
from ketch.engine.megatron.vocab_parallel_log_probs import sum_grad_over_ranks
from ketch.engine.megatron.weights import ModelShape, rope_settings


def transformer_config(hf_config: Any, megatron: MegatronConfig, dtype: torch.dtype) -> TransformerConfig:
    """The Megatron-Core config of an HF Llama/Qwen2/Qwen3 config, with `megatron`'s parallel sizes. Parameters (and
    activations between pipeline stages) stay float32; with `dtype` bfloat16/float16 the schedules run the
    forward under autocast (as the FSDP engine's mixed precision). Activation recomputation is not Megatron's
    (`recompute_layers`)."""
    shape = ModelShape.from_hf(hf_config)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,  # the update trains the distribution the rollout sampled: no randomness
        tensor_model_parallel_size=megatron.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=megatron.virtual_pipeline_model_parallel_size,
        sequence_parallel=megatron.sequence_parallel,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        enable_autocast=dtype != torch.float32,
        autocast_dtype=dtype,
        use_cpu_initialization=True,
        init_method=_loaded_later,
        output_layer_init_method=_loaded_later,
        embedding_init_method=_loaded_later,
        calculate_per_token_loss=True,  # ketch's losses are already shares of the mini-batch mean: no rescaling
        # With two stages, a stage's previous and next peer are one rank; Megatron's even/odd ordered sends
        # keep activations and gradients apart there, which a single batched exchange does not.
        batch_p2p_comm=megatron.pipeline_model_parallel_size != 2,
    )


def recompute_layers(chunk: GPTModel) -> None:
    """Full activation recomputation: each transformer layer of `chunk` keeps only its input and runs again in
    the backward pass, under the autocast of its forward. (Megatron's own `recompute_granularity=full` reruns
    the layers outside autocast, in float32: slower than the forward and not the function that was run.)"""
    for layer in chunk.decoder.layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def _loaded_later(weight: torch.Tensor) -> None:
    """Megatron's weight initializer, as a no-op: the engine loads every weight from the HF model, and a random
    draw of a 7B model on the CPU takes a minute per process. (Megatron's `perform_initialization=False` would
    also skip marking the tensor-parallel weights, which the gradient norm reads.)"""


class VocabParallelHead(torch.nn.Module):
    """A policy's output layer in place of Megatron's (called like it, keeping its weight `output_layer.weight`,
    None where the embedding's is used): it returns the hidden states `[seq, batch, hidden]` of every position
    instead of logits. The engine projects them onto this rank's vocabulary slice a chunk of tokens at a time
    (`chunked_vocab_parallel_log_probs`), so that `[tokens x vocab / tp]` logits never exist whole."""

    def __init__(self, replaced: torch.nn.Module):
        super().__init__()
        self.weight, self.sequence_parallel = replaced.weight, replaced.sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        # each rank's projection gives part of the gradient of the states: sum it over the tensor ranks
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True), None
        return sum_grad_over_ranks(hidden_states, mpu.get_tensor_model_parallel_group()), None

    def get_extra_state(self) -> None:  # the replaced layer's (empty) state-dict entry, so checkpoints match
        return None

    def set_extra_state(self, state: Any) -> None:
        pass


class ValueHead(torch.nn.Linear):
    """A critic's scalar head in the output layer's place (called like it): replicated over tensor ranks, so
    with sequence parallelism the positions are gathered first. Parameters `output_layer.{weight,bias}`."""

    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__(hidden_size, 1)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # every rank computes the whole gradient: each keeps its positions' part
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return super().forward(hidden_states), None


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as Megatron builds its norms. It acts position by position, so it runs on
    sequence-parallel activations as well (Megatron's own torch wrapper refuses them); its weight is then
    flagged `partial_over_tensor_ranks`: each rank's gradient covers only its positions, and the engine sums
    them over the tensor ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused: Any):
        super().__init__(hidden_size, eps=eps)
        self.weight.partial_over_tensor_ranks = config.sequence_parallel


class HeadNorm(RMSNorm):
    """Qwen3's query or key norm over each head's dimensions: a rank normalizes only its own heads, so its
    gradient is partial whatever the sequence parallelism."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused: Any):
        super().__init__(config, hidden_size, eps)
        self.weight.partial_over_tensor_ranks = True


def block_spec(config: TransformerConfig, pp_rank: int, vp_stage: int | None) -> TransformerBlockSubmodules:
    """The local layer spec with `RMSNorm` before attention, before the MLP and after the last layer (and
    `HeadNorm` on queries and keys with `qk_layernorm`)."""
    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    if config.qk_layernorm:
        attention = layer.submodules.self_attention
        heads = replace(attention.submodules, q_layernorm=HeadNorm, k_layernorm=HeadNorm)
        layer = replace(
            layer, submodules=replace(layer.submodules, self_attention=replace(attention, submodules=heads))
        )
    layer = replace(layer, submodules=replace(layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm))
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=RMSNorm)


def build_chunks(hf_config: Any, config: TransformerConfig, pp_rank: int, value_head: bool = False) -> list[GPTModel]:
    """This pipeline rank's model chunks (one, or one per virtual stage), on the CPU, weights not yet loaded;
    `value_head`: a critic, whose last chunk ends in a `ValueHead`; else a policy's ends in a `VocabParallelHead`."""
    pp, chunks = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size or 1
    models = []
    for vp_stage in range(chunks):
        models.append(
            GPTModel(
                config,
                block_spec(config, pp_rank, vp_stage if config.virtual_pipeline_model_parallel_size else None),
                vocab_size=hf_config.vocab_size,
                max_sequence_length=hf_config.max_position_embeddings,
                pre_process=pp_rank == 0 and vp_stage == 0,
                post_process=pp_rank == pp - 1 and vp_stage == chunks - 1,
                share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and not value_head,
                position_embedding_type="rope",
                vp_stage=vp_stage if config.virtual_pipeline_model_parallel_size else None,
                **rope_settings(hf_config),
            )
        )
    last = models[-1]
    if last.post_process and value_head:
        last.output_layer = ValueHead(config.hidden_size, config.sequence_parallel)
    elif last.post_process:
        last.output_layer = VocabParallelHead(last.output_layer)
    return models
