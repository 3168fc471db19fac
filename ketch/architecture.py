"""What ketch knows of a model family, in one place: the engine, the rollout, the memory estimate and the config
checks ask here rather than probing a model's attributes themselves.

Most of it holds for any decoder that transformers builds on its shared attention interface (its modules call
the registered attention function, and its masks come from `masking_utils`): the decoder blocks are the one
`ModuleList` of the decoder, each block's attention is its child module whose class ends in `Attention`, and the
head counts and head size come from the config. `FAMILIES` adds what differs by family and is known only for
the families it lists (keyed by `config.model_type`): which ones split for the hf rollout's tensor parallelism,
which ones the Megatron weight adapter maps, whose experts decode with fixed shapes and which ones compute
batch-invariantly. A family with none of these
needs no entry; the families the architecture matrix test runs are listed in `tests/families.py`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    """Facts of one model family beyond those every decoder shares."""

    tensor_parallel: bool = False
    """The hf rollout's tensor-parallel split holds: separate `q_proj`/`k_proj`/`v_proj` and `gate_proj`/`up_proj`
    split by output rows, `o_proj`/`down_proj` by input columns, no norm over all heads at once."""
    megatron: bool = False
    """`engine/megatron/weights.py` maps its weights to Megatron-Core's GPT model."""
    fixed_shape_experts: bool = False
    """A mixture of experts whose experts the static decoder computes with fixed shapes (`rollout/moe_decode.py`),
    so that its decode step can be captured into a CUDA graph."""
    batch_invariant: bool = False
    """`models/batch_invariant.py` covers every reduction of its forward (linear projections, RMSNorm, a SiLU MLP,
    rotary positions, plain attention), so `rollout.exact_log_probs` holds for it."""


FAMILIES: dict[str, Family] = {
    "llama": Family(tensor_parallel=True, megatron=True, batch_invariant=True),
    "qwen2": Family(tensor_parallel=True, megatron=True, batch_invariant=True),
    "qwen3": Family(tensor_parallel=True, megatron=True, batch_invariant=True),
    "mistral": Family(tensor_parallel=True),
    "gemma": Family(tensor_parallel=True),
    "gemma3_text": Family(tensor_parallel=True),
    "granite": Family(tensor_parallel=True),
    "mixtral": Family(fixed_shape_experts=True),
    "qwen2_moe": Family(fixed_shape_experts=True),
    "qwen3_moe": Family(fixed_shape_experts=True, batch_invariant=True),
    "olmoe": Family(fixed_shape_experts=True),
    "gpt_oss": Family(fixed_shape_experts=True),
    "deepseek_v3": Family(fixed_shape_experts=True),
}
"""The families with a fact beyond those every decoder shares; any other family gets an empty `Family`."""

ENCODERS = {
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
}  # fmt: skip
"""Encoder families that transformers also gives a causal-LM class, attending causally only with `is_decoder`."""

ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
"""The `config.layer_types` of layers that attend (others, e.g. linear attention or state-space layers, do not)."""


def is_vision_model(config: Any) -> bool:
    """Whether HF `config` is a vision-language model's (it has a `vision_config`), loaded with its image-text-to-text
    class."""
    return getattr(config, "vision_config", None) is not None


def causal_lm_problem(config: Any) -> str | None:
    """Why the model of HF `config` is not a decoder-only causal LM (or a vision-language model around one) that
    ketch can train, or None."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    name = ", ".join(getattr(config, "architectures", None) or []) or f"model_type={config.model_type!r}"
    if is_vision_model(config):
        if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return None
        return f"{name} has no image-text-to-text class in transformers (AutoModelForImageTextToText)"
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model"
    if config.model_type in ENCODERS and not getattr(config, "is_decoder", False):
        return f"{name} is an encoder (bidirectional attention)"
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
        return f"{name} has no causal-LM class in transformers (AutoModelForCausalLM)"
    return None


def value_head_problem(config: Any) -> str | None:
    """Why a critic (the backbone with a scalar value head: `*ForTokenClassification`, or a vision-language model's
    backbone with one) cannot be built for the model of HF `config`, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    remote = "AutoModelForTokenClassification" in (getattr(config, "auto_map", None) or {})
    if is_vision_model(config):  # its backbone with a head of ketch's (`ketch.models.vision_critic`)
        return None
    if config.model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES and not remote:
        return f"transformers has no token-classification class for model_type={config.model_type!r}"
    return None


def family(config: Any) -> Family:
    """The known facts of `config`'s family (an empty `Family` for a family not in `FAMILIES`)."""
    return FAMILIES.get(config.model_type, Family())


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(config: Any) -> AttentionShape:
    """Query heads, key/value heads and head size of a HF decoder `config` (the key/value heads are the query
    heads without grouped-query attention; the head size is `hidden_size / heads` where the config has none); a
    vision-language model's are its language model's."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionShape(heads, kv_heads, head_dim)


def intermediate_size(config: Any) -> int:
    """The dense MLP's width: `intermediate_size`, else GPT-2's `n_inner`, else four times the hidden size."""
    return getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size


@dataclass(frozen=True)
class LogitTransform:
    """How a causal LM turns its output projection into logits: `softcap * tanh(scale * x / softcap)`, or
    `scale * x` without a soft cap."""

    scale: float = 1.0
    softcap: float | None = None


PLAIN_LOGITS = LogitTransform()
"""The logits are the output projection."""


def logit_transform(config: Any) -> LogitTransform:
    """Granite divides the logits by `logits_scaling`, Cohere multiplies them by `logit_scale`, Gemma 2 and 3
    soft-cap them at `final_logit_softcapping`, RecurrentGemma at `logits_soft_cap`: the training forward's log-probs
    must see the logits that sampling saw."""
    scale = 1.0 / (getattr(config, "logits_scaling", None) or 1.0)
    scale *= getattr(config, "logit_scale", None) or 1.0
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    return LogitTransform(scale, softcap)


@dataclass(frozen=True)
class Router:
    """A mixture-of-experts model's routing: each token's `top_k` experts, and the weight of the load-balancing
    loss in the model's own training loss."""

    top_k: int
    aux_loss_coef: float


def router_outputs(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The modules of a mixture of experts whose outputs hold its router logits `[tokens, experts]`, each with the
    index of the logits in its output, from transformers' own record of them (`_can_record_outputs["router_logits"]`:
    a module class, a suffix of the modules' names or an `OutputRecorder`, or a list of them; the index is 1 where
    only a class or a name is given, as transformers takes it). An `OutputRecorder`'s `layer_name` narrows its class
    to the modules of that name (Jamba records `nn.Linear` named `router`, not every linear layer)."""
    recorders = [getattr(type(m), "_can_record_outputs", None) or {} for m in model.modules()]
    found = next((r["router_logits"] for r in recorders if "router_logits" in r), None)
    specs = [] if found is None else found if isinstance(found, list) else [found]
    outputs = []
    for target, suffix, layer, index in map(_recorded, specs):
        outputs += [
            (module, index)
            for name, module in model.named_modules()
            if ((target is not None and isinstance(module, target)) or (suffix is not None and name.endswith(suffix)))
            and (layer is None or f".{layer.strip('.')}." in f".{name}.")
        ]
    return outputs


def unrecorded_router(model: nn.Module) -> str | None:
    """Why the router logits of `model`, a mixture of experts (its config routes each token to
    `num_experts_per_tok` experts), cannot be read, or None (they can, or it is not one): the installed
    transformers records none for it (DeepSeek-V3's and GraniteMoE's before 5.19)."""
    if not getattr(model.config, "num_experts_per_tok", None) or router_outputs(model):
        return None
    from transformers import __version__

    return f"transformers {__version__} records no router logits of {type(model).__name__} (5.19 records them)"


def _recorded(spec: Any) -> tuple[type | None, str | None, str | None, int]:
    """The module class, module-name suffix, layer name and output index of one entry of transformers'
    `_can_record_outputs`."""
    if isinstance(spec, type):
        return spec, None, None, 1
    if isinstance(spec, str):
        return None, spec, None, 1
    return spec.target_class, spec.class_name, getattr(spec, "layer_name", None), spec.index


def router(config: Any) -> Router | None:
    """The routing of a mixture-of-experts `config` whose model returns its router logits (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE: `output_router_logits`), or None."""
    if not hasattr(config, "output_router_logits") or not getattr(config, "num_experts_per_tok", None):
        return None
    return Router(config.num_experts_per_tok, getattr(config, "router_aux_loss_coef", None) or 0.0)


def decoder(model: nn.Module) -> nn.Module:
    """The backbone of a HF causal LM (`get_decoder()`), or the backbone itself. Llama 4's text model answers
    `get_decoder()` with itself: its `model` child is taken there."""
    found = model.get_decoder() if hasattr(model, "get_decoder") else model
    return getattr(model, "model", found) if found is model else found


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a HF causal LM, or of its backbone: the decoder's one `ModuleList` (`layers`,
    GPT-2's `h`); empty where there is none."""
    lists = [child for child in decoder(model).children() if isinstance(child, nn.ModuleList)]
    return list(lists[0]) if len(lists) == 1 else []


def block_attention(block: nn.Module) -> nn.Module | None:
    """A block's attention module (`self_attn`, GPT-2's `attn`, GPT-NeoX's `attention`): its one child whose
    class name ends in `Attention`."""
    found = [child for child in block.children() if type(child).__name__.endswith("Attention")]
    return found[0] if len(found) == 1 else None


def attention_implementation(config: Any, requested: str) -> str | None:
    """The attention kernel to ask transformers for, for a model of `config` under `model.attn_implementation`:
    `auto` is `eager` for a model that soft-caps its attention logits (Gemma 2), whose cap SDPA leaves out without
    a word (the logits would not be the model's), else None: transformers' own choice, SDPA where the model
    supports it and eager where not (GPT-OSS); any other value as given."""
    if requested != "auto":
        return requested
    return "eager" if getattr(config, "attn_logit_softcapping", None) else None


def attention_implementation_problem(config: Any, requested: str) -> str | None:
    """Why the attention kernel `requested` computes other logits than the model's own, or None: SDPA on a model
    that soft-caps its attention logits."""
    cap = getattr(config, "attn_logit_softcapping", None)
    if requested == "sdpa" and cap:
        return (
            f"model.attn_implementation=sdpa leaves out this model's attention soft cap (config.attn_logit_softcapping"
            f"={cap}), so its logits are not the model's: use auto or eager (or flash_attention_2 where installed)"
        )
    return None


def packing_problem(model: nn.Module) -> str | None:
    """Why `model`'s training forwards cannot run packed (`engine/packing.py`), or None when they can: the sequence
    offsets must reach the packed attention through transformers' attention interface, and the model must need no
    more than it computes (`_fast_path_problem`). A vision-language model packs where its multimodal rotary
    positions come from `get_rope_index` (the Qwen families'; `engine/vision_forward.py`), not where its image tokens
    attend both ways (Gemma 3's), and only where its forward takes the images encoded apart (`mm_encoder_outputs`,
    transformers 5.19): an older forward ignores them, and the language model would train without its images."""
    if is_vision_model(model.config):
        if not hasattr(model.model, "get_rope_index"):
            return "its image tokens attend to each other both ways, which the packed attention (causal) does not"
        if "mm_encoder_outputs" not in inspect.signature(model.model.forward).parameters:
            from transformers import __version__

            return (
                f"its forward in transformers {__version__} takes no mm_encoder_outputs (5.19's does), "
                "through which the packed forward gives it the images it encoded apart"
            )
    return _fast_path_problem(model)


CAUSAL_VISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""The vision-language families whose prompt attends causally, image tokens included (Gemma 3's image tokens attend
to each other both ways): the static decoder prefills them with their images and multimodal rotary positions."""


def static_decoding_problem(model: nn.Module) -> str | None:
    """Why the static decoder (`rollout/static_decoding.py`) cannot decode `model`, or None when it can: every
    block has one attention module, whose calls to transformers' attention interface the decoder's KV cache hooks
    into, the model needs no more than the decoder's attention computes (`_fast_path_problem`), and keys and
    values have the config's head size (the cache's pages hold one size). Of the vision-language models, those whose
    prompt attends causally, images included (`CAUSAL_VISION`), decode here; the others with `generate`."""
    if is_vision_model(model.config) and model.config.model_type not in CAUSAL_VISION:
        return "its image tokens attend to each other both ways at prefill, which generate computes"
    blocks = decoder_blocks(model)
    if not blocks or any(block_attention(block) is None for block in blocks):
        return "its decoder blocks have no single attention module each"
    problem = _fast_path_problem(model)
    if problem:
        return problem
    attention, head_dim = block_attention(blocks[0]), attention_shape(model.config).head_dim
    if {getattr(attention, "qk_head_dim", head_dim), getattr(attention, "v_head_dim", head_dim)} != {head_dim}:
        return "its keys and values are not of its config's head size (multi-head latent attention)"
    return None


def _fast_path_problem(model: nn.Module) -> str | None:
    """What keeps `model` off ketch's own attention (packed and decode), or None: attention outside transformers'
    interface, attention that computes more than scaled dot-product attention (`_attention_problem`), or layers
    that are not full or sliding-window attention (a convolution or linear-attention layer would run over a
    packed row as one sequence)."""
    if not getattr(model, "_supports_attention_backend", False):
        return "its attention does not go through transformers' attention interface"
    return _attention_problem(model) or _layer_problem(model.config) or _block_problem(model) or _keyword_problem(model)


def _block_problem(model: nn.Module) -> str | None:
    """Why not every decoder block of `model` attends (a recurrent block, RecurrentGemma's, would run over a packed
    row as one sequence), or None."""
    blocks = decoder_blocks(model)
    if blocks and any(block_attention(block) is None for block in blocks):
        return "not all of its decoder blocks have an attention module (recurrent or state-space blocks)"
    return None


PROBE = "ketch_probe"
"""The attention function that `_keyword_problem` registers for a moment."""


class _Reached(Exception):
    """Raised by the probe attention: whether the probe's keyword argument reached it."""


def _probe_attention(module: nn.Module, query: torch.Tensor, *args, **kwargs) -> None:
    raise _Reached(PROBE in kwargs)


def _keyword_problem(model: nn.Module) -> str | None:
    """Why keyword arguments given to `model`'s backbone do not reach its attention function, or None: ketch's packed
    and decode attention get the sequence offsets and the cache slots that way, and a block that drops them
    (Nemotron's) would attend without them. Found by calling the backbone on one token with a probe attention, which
    stops the forward at the first attention call (so only the embedding and one block's projections run)."""
    from transformers import AttentionInterface

    blocks = decoder_blocks(model)
    if blocks and hasattr(block_attention(blocks[0]), "qkv_weight"):
        return None  # fused by the static decoder (`fused_projections.py`): its own forward passes them on
    AttentionInterface.register(PROBE, _probe_attention)
    before, device = model.config._attn_implementation, next(model.parameters()).device
    model.set_attn_implementation(PROBE)
    reached = False
    try:
        with torch.no_grad():
            decoder(model)(input_ids=torch.ones(1, 1, dtype=torch.long, device=device), **{PROBE: True})
    except _Reached as probe:
        reached = probe.args[0]
    except TypeError:  # a forward that takes no such keyword
        reached = False
    except (RuntimeError, NotImplementedError):
        if device.type != "meta":
            raise
        reached = True  # without weights (`ketch doctor`'s model) GPT-2 stops before its attention: the run will tell
    finally:
        model.set_attn_implementation(before)
    return None if reached else "its decoder blocks do not pass keyword arguments on to its attention function"


def _attention_problem(model: nn.Module) -> str | None:
    """What `model`'s attention computes beyond scaled dot-product attention over its keys, which ketch's packed and
    decode attention do not: soft-capped logits (Gemma 2), sink logits (GPT-OSS)."""
    if getattr(model.config, "attn_logit_softcapping", None):
        return "it soft-caps its attention logits (config.attn_logit_softcapping)"
    blocks = decoder_blocks(model)
    attention = block_attention(blocks[0]) if blocks else None
    if attention is not None and hasattr(attention, "sinks"):
        return "its attention adds sink logits (attention sinks)"
    return None


def _layer_problem(config: Any) -> str | None:
    """Why not every layer of a model of `config` is full or sliding-window attention (a convolution, linear
    attention, state-space or chunked-attention layer), or None."""
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds <= ATTENTION_LAYERS:
        return f"not all of its layers are full or sliding-window attention (config.layer_types: {sorted(kinds)})"
    return None


def compile_problem(config: Any, dtype: torch.dtype) -> str | None:
    """Why the training blocks of the model of `config`, computing in `dtype`, cannot be compiled, or None: the
    experts of a mixture of experts compile in bfloat16 only (transformers' grouped matmul; its fallback has shapes
    that depend on the routing)."""
    if router(config) is not None and dtype != torch.bfloat16:
        return f"its experts compile in bfloat16 only, and it computes in {str(dtype).removeprefix('torch.')}"
    return None


def cuda_graph_problem(config: Any) -> str | None:
    """Why the static decoder's step cannot be captured into a CUDA graph for the model of `config`, or None: a
    mixture of experts outside the families whose experts the decoder computes with fixed shapes
    (`Family.fixed_shape_experts`) dispatches its tokens with waits for the GPU (transformers' expert loops)."""
    if router(config) is None or family(config).fixed_shape_experts:
        return None
    known = ", ".join(name for name, f in FAMILIES.items() if f.fixed_shape_experts)
    return f"its experts dispatch tokens with host synchronisation (fixed-shape experts: {known})"


def batch_invariant_problem(config: Any) -> str | None:
    """Why the model of HF `config` cannot compute batch-invariantly (`rollout.exact_log_probs`), or None: a family
    whose ops `models/batch_invariant.py` does not all cover (`Family.batch_invariant`), or an MLP other than SiLU."""
    known = ", ".join(name for name, f in FAMILIES.items() if f.batch_invariant)
    if is_vision_model(config) or not family(config).batch_invariant:
        return f"model_type={config.model_type!r} is not a family whose every op it covers ({known})"
    if config.hidden_act != "silu":
        return f"its MLP's activation is {config.hidden_act!r}; it covers SiLU"
    return None


def tensor_parallel_problems(size: int, config: Any) -> list[str]:
    """Where the hf rollout's tensor parallelism of `size` ranks cannot split the model of HF `config`: a family
    whose split is not known to hold, or head counts and MLP width that `size` does not divide. Nothing to check
    for `size` 1."""
    key = "rollout.tensor_parallel_size"
    if size <= 1:
        return []
    if not family(config).tensor_parallel:
        known = ", ".join(name for name, f in FAMILIES.items() if f.tensor_parallel)
        return [
            f"{key}={size}: the tensor-parallel split of model_type={config.model_type!r} is not known (known: "
            f"{known}); use {key}=1, or more rollout processes with one model each"
        ]
    shape = attention_shape(config)
    sizes = {
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "intermediate_size": intermediate_size(config),
    }
    return [
        f"{key}={size} does not divide the model's {name}={value}; pick a divisor of it"
        for name, value in sizes.items()
        if value % size
    ]
