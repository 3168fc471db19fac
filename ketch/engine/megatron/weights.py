"""Hugging Face Llama/Qwen2/Qwen3 weights ↔ Megatron-Core GPTModel (local layer spec) weights, sharded by rank,
and what of an HF config the mapping needs (shape, RoPE) or cannot express.

Pure tensor bookkeeping (no megatron import), so it is tested on a CPU and checked at start-up. Qwen3's query and
key norms (one RMSNorm weight over a head's dimensions each, shared by all heads) are Megatron's `q_layernorm` and
`k_layernorm`, replicated over tensor ranks. Megatron differs from HF in four ways:

- **Fused QKV.** `linear_qkv` stacks, for each key/value group g, that group's query heads, then its key head,
  then its value head: rows `[q_g0 .. q_g(h/G-1), k_g, v_g] x head_dim` for g = 0..G-1 (G = key/value heads).
  Tensor parallelism splits the rows into contiguous blocks, so each rank holds whole groups.
- **Fused gate/up.** `linear_fc1` is `[gate; up]`; tensor-parallel rank r holds `[gate_r; up_r]`.
- **Column/row parallel.** Embedding, output layer, QKV and fc1 are split on dim 0; `linear_proj` (o_proj)
  and `linear_fc2` (down_proj) on dim 1; norms are replicated.
- **Pipeline stages.** Each stage (and each virtual chunk) numbers its layers from 0; the embedding lives on the
  first stage, the final norm and output layer on the last. With tied embeddings the last stage keeps a copy
  of the embedding as `output_layer.weight` when it is not also the first stage.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ketch.architecture import FAMILIES, attention_shape, family
from ketch.config.loader import ConfigError

Kind = Literal["column", "row", "gated", "replicated"]
Coord = tuple[int, int, int]
"""(pipeline rank, virtual stage, tensor rank) of one model chunk."""

GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
LAYER = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.weight": [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ],
    "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
}
"""Megatron name within a layer -> the HF names (under `model.layers.{i}.`) fused into it, in order."""
HEAD_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
"""Qwen3's query and key norms: only models with `ModelShape.qk_norm` have them."""

VALUE_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}
"""A critic's output layer -> the HF `*ForTokenClassification` head."""

KINDS: dict[str, Kind] = {
    "embedding.word_embeddings.weight": "column",
    "output_layer.weight": "column",
    "self_attention.linear_qkv.weight": "column",
    "self_attention.linear_qkv.bias": "column",
    "self_attention.linear_proj.weight": "row",
    "mlp.linear_fc1.weight": "gated",
    "mlp.linear_fc2.weight": "row",
}
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


class UnsupportedModelError(ConfigError):
    """An HF model whose architecture or settings the Megatron adapter does not map."""


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs to know about an HF Llama/Qwen2 model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each query and key head."""
    hidden: int = 0
    ffn: int = 0
    vocab: int = 0
    value_head: bool = False
    """A critic: the output layer is the scalar head `score` (weight `[1, hidden]`, bias `[1]`), replicated."""

    @classmethod
    def from_hf(cls, config: Any, value_head: bool = False) -> ModelShape:
        """Read an HF config (`value_head`: of a `*ForTokenClassification` critic); raises `UnsupportedModelError`
        for what the local Megatron spec cannot express."""
        kind = config.model_type
        if not family(config).megatron:
            known = ", ".join(name for name, f in FAMILIES.items() if f.megatron)
            raise UnsupportedModelError(f"strategy=megatron maps model_type {known}, not model_type={kind!r}")
        if kind != "qwen2" and (getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)):
            raise UnsupportedModelError(
                f"strategy=megatron: {kind} with attention_bias or mlp_bias (an o_proj or MLP bias) is not mapped"
            )
        shape = attention_shape(config)
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=shape.heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            tied=bool(config.tie_word_embeddings) and not value_head,
            qkv_bias=kind == "qwen2",
            qk_norm=kind == "qwen3",
            hidden=config.hidden_size,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
            value_head=value_head,
        )

    def has(self, layer_name: str) -> bool:
        """Whether this model's layers have the Megatron weight `layer_name` (its QKV bias, its q/k norms)."""
        if layer_name == "self_attention.linear_qkv.bias":
            return self.qkv_bias
        return self.qk_norm or layer_name not in HEAD_NORMS

    def kind(self, megatron_name: str) -> Kind:
        """How `megatron_name` is split over tensor-parallel ranks (a critic's scalar head is replicated)."""
        return "replicated" if self.value_head and megatron_name in VALUE_HEAD else kind_of(megatron_name)

    def full_shape(self, megatron_name: str) -> tuple[int, ...]:
        """Shape of the full (TP=1) Megatron tensor `megatron_name` (global or per-layer name)."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.value_head and megatron_name in VALUE_HEAD:
            return (1, self.hidden) if megatron_name.endswith("weight") else (1,)
        shapes = {
            "embedding.word_embeddings.weight": (self.vocab, self.hidden),
            "output_layer.weight": (self.vocab, self.hidden),
            "decoder.final_layernorm.weight": (self.hidden,),
            "input_layernorm.weight": (self.hidden,),
            "pre_mlp_layernorm.weight": (self.hidden,),
            "self_attention.linear_qkv.weight": (qkv, self.hidden),
            "self_attention.linear_qkv.bias": (qkv,),
            "self_attention.q_layernorm.weight": (self.head_dim,),
            "self_attention.k_layernorm.weight": (self.head_dim,),
            "self_attention.linear_proj.weight": (self.hidden, self.num_heads * self.head_dim),
            "mlp.linear_fc1.weight": (2 * self.ffn, self.hidden),
            "mlp.linear_fc2.weight": (self.hidden, self.ffn),
        }
        return shapes[megatron_name]


LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama 3.1 RoPE scaling Megatron-Core implements (only its `factor` is a parameter there)."""


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """`GPTModel` RoPE arguments: base (theta) and Llama 3.1 scaling; other scalings are refused."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rotary_base": theta, "rope_scaling": False}
    if kind == "llama3" and all(params.get(k, v) == v for k, v in LLAMA3_ROPE_DEFAULTS.items()):
        return {"rotary_base": theta, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise UnsupportedModelError(f"strategy=megatron does not map the model's RoPE scaling {params}")


def check_supported(hf_config: Any) -> None:
    """Raise `UnsupportedModelError` (a `ConfigError`) at start-up for a model the adapter cannot map."""
    ModelShape.from_hf(hf_config)
    rope_settings(hf_config)


@dataclass(frozen=True)
class Parallel:
    """Tensor, pipeline and virtual pipeline sizes."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None

    def coords(self) -> list[Coord]:
        return [(p, v, t) for p in range(self.pp) for v in range(self.vpp or 1) for t in range(self.tp)]

    def layers(self, num_layers: int, pp_rank: int, vp_stage: int) -> range:
        """Global layer indices of one model chunk (Megatron's interleaved order when vpp is set)."""
        chunks = self.vpp or 1
        per_chunk = num_layers // (self.pp * chunks)
        start = vp_stage * (num_layers // chunks) + pp_rank * per_chunk
        return range(start, start + per_chunk)

    def is_first(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == 0 and vp_stage == 0

    def is_last(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == self.pp - 1 and vp_stage == (self.vpp or 1) - 1


# ------------------------------------------------------------------ fusing and sharding one tensor
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q/k/v projections (weights `[heads*d, hidden]` or biases `[heads*d]`) -> Megatron's grouped layout."""
    groups, per_group, d = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * d, *rest)
    k, v = k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    """Inverse of `fuse_qkv`: [q, k, v] in HF layout."""
    groups, per_group, d = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return [x.reshape(-1, *rest) for x in (q, k, v)]


def shard(tensor: torch.Tensor, kind: Kind, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s piece of a full (TP=1) Megatron tensor."""
    if kind == "replicated" or tp == 1:
        return tensor
    if kind == "gated":
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return tensor.chunk(tp, dim=0 if kind == "column" else 1)[rank]


def unshard(pieces: list[torch.Tensor], kind: Kind) -> torch.Tensor:
    """The full (TP=1) tensor from every tensor-parallel rank's piece, in rank order."""
    if kind == "replicated" or len(pieces) == 1:
        return pieces[0]
    if kind == "gated":
        halves = [p.chunk(2) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(pieces, dim=0 if kind == "column" else 1)


def kind_of(megatron_name: str) -> Kind:
    """How a Megatron parameter (global or per-layer name) is split over tensor-parallel ranks."""
    match = _LAYER_NAME.fullmatch(megatron_name)
    return KINDS.get(match.group(2) if match else megatron_name, "replicated")


# ------------------------------------------------------------------ whole-name mapping
def to_megatron(megatron_name: str, layer: int | None, get_hf: Callable[[str], torch.Tensor], shape: ModelShape):
    """The full Megatron tensor `megatron_name` (a per-layer name when `layer` is given), read from HF tensors
    by name through `get_hf`."""
    if layer is None:
        return get_hf(_global_hf_name(megatron_name, shape))
    parts = [get_hf(f"model.layers.{layer}.{name}") for name in LAYER[megatron_name]]
    if megatron_name.startswith("self_attention.linear_qkv"):
        return fuse_qkv(*parts, shape)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _global_hf_name(megatron_name: str, shape: ModelShape) -> str:
    if shape.value_head and megatron_name in VALUE_HEAD:
        return VALUE_HEAD[megatron_name]
    if megatron_name == "output_layer.weight" and shape.tied:
        return "model.embed_tokens.weight"
    return GLOBAL[megatron_name]


def to_hf(megatron_name: str, layer: int | None, tensor: torch.Tensor, shape: ModelShape):
    """(HF name, tensor) pairs of one full Megatron tensor (global name, or per-layer name with its global layer)."""
    if layer is None:
        return [(_global_hf_name(megatron_name, shape), tensor)]
    names = [f"model.layers.{layer}.{name}" for name in LAYER[megatron_name]]
    if megatron_name.startswith("self_attention.linear_qkv"):
        return list(zip(names, split_qkv(tensor, shape), strict=True))
    return list(zip(names, tensor.chunk(len(names)), strict=True))


def chunk_names(
    shape: ModelShape, parallel: Parallel, pp_rank: int, vp_stage: int
) -> Iterator[tuple[str, str, int | None]]:
    """(chunk-local Megatron name, per-layer or global name, global layer or None) of one model chunk's weights."""
    if parallel.is_first(pp_rank, vp_stage):
        yield "embedding.word_embeddings.weight", "embedding.word_embeddings.weight", None
    layer_names = [n for n in LAYER if shape.has(n)]
    for local, layer in enumerate(parallel.layers(shape.num_layers, pp_rank, vp_stage)):
        for name in layer_names:
            yield f"decoder.layers.{local}.{name}", name, layer
    if parallel.is_last(pp_rank, vp_stage):
        yield "decoder.final_layernorm.weight", "decoder.final_layernorm.weight", None
        if not shape.tied or not parallel.is_first(pp_rank, vp_stage):
            yield "output_layer.weight", "output_layer.weight", None
        if shape.value_head:
            yield "output_layer.bias", "output_layer.bias", None


def hf_to_megatron_chunk(
    get_hf: Callable[[str], torch.Tensor], shape: ModelShape, parallel: Parallel, coord: Coord
) -> dict[str, torch.Tensor]:
    """The state dict of one model chunk (`coord`), reading only the HF tensors it needs through `get_hf`."""
    pp_rank, vp_stage, tp_rank = coord
    return {
        local: shard(to_megatron(name, layer, get_hf, shape), shape.kind(name), parallel.tp, tp_rank)
        for local, name, layer in chunk_names(shape, parallel, pp_rank, vp_stage)
    }


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: ModelShape, parallel: Parallel) -> dict[Coord, dict]:
    """Every model chunk's state dict, by (pipeline rank, virtual stage, tensor rank)."""
    return {coord: hf_to_megatron_chunk(hf.__getitem__, shape, parallel, coord) for coord in parallel.coords()}


def megatron_to_hf(chunks: dict[Coord, dict[str, torch.Tensor]], shape: ModelShape, parallel: Parallel) -> dict:
    """The HF state dict from every chunk's state dict; tied models get no `lm_head.weight`."""
    hf: dict[str, torch.Tensor] = {}
    for pp_rank in range(parallel.pp):
        for vp_stage in range(parallel.vpp or 1):
            for local, name, layer in chunk_names(shape, parallel, pp_rank, vp_stage):
                if name == "output_layer.weight" and shape.tied:
                    continue
                pieces = [chunks[(pp_rank, vp_stage, t)][local] for t in range(parallel.tp)]
                hf.update(to_hf(name, layer, unshard(pieces, shape.kind(name)), shape))
    return hf
