"""The experts of a mixture of experts with fixed shapes and no host synchronisation, for the static decoder's step.

transformers' experts loop over the experts that some token chose (`.nonzero()`, then a Python loop: the host
waits for the GPU) or group the tokens by expert: a CUDA graph holds neither. `use_fixed_shape_experts` gives the
experts modules of the families whose layout is checked here (`EXPERTS`) a forward that, inside `decoding()` (the
static decoder's decode steps), computes the few tokens of a step in one of two ways whose shapes depend only on
the step's shape; outside it (the prefill, training forwards) they keep transformers' forward. The router is left
as it is: its `topk` still chooses, so routing replay records and replays the decode steps' choices as before.

- `gathered`: each token's `top_k` experts' weights are gathered (`weight[index]`) and multiplied by batched
  matmuls, `[tokens, top_k]` products per projection.
- `dense`: every expert runs over every token, and each token weighs the experts it did not choose by 0.

Which one (`reads_every_expert`) is decided by the bytes each reads, a decode step being bound by reading weights:
gathering reads the `tokens * top_k` chosen experts' matrices, writes a copy of them and the batched matmul reads
that copy (about 3 reads of `tokens * top_k` expert matrices, an expert chosen twice read twice); dense reads each
of the `experts` experts' matrices once, and its `experts / top_k` times the products needed cost little while
the step waits on memory. A step therefore gathers while `3 * tokens * top_k < experts`: Qwen3-30B-A3B (128
experts, top 8) up to 5 rows, DeepSeek-V3 (256, top 8) up to 10, Mixtral (8, top 2) at 1 row.

The layouts (from transformers' `use_experts_implementation`): `gate_up_proj` `[experts, 2 * inter, hidden]` and
`down_proj` `[experts, hidden, inter]` (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3); GPT-OSS stores them transposed
(`[experts, hidden, 2 * inter]`, `[experts, inter, hidden]`) with biases, gate and up interleaved, as its own
`_apply_gate` reads them.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch
from torch import nn

GATHER_READS = 3
"""How many times gathering reads (or writes) each chosen expert's matrices: the gather's read, its copy, the
matmul's read."""

_decoding = False


@contextmanager
def decoding():
    """Inside: the experts that `use_fixed_shape_experts` changed compute with fixed shapes."""
    global _decoding
    previous, _decoding = _decoding, True
    try:
        yield
    finally:
        _decoding = previous


def in_decode_step() -> bool:
    """Whether the code running is inside `decoding()`."""
    return _decoding


def reads_every_expert(tokens: int, top_k: int, experts: int) -> bool:
    """Whether a step of `tokens` tokens choosing `top_k` of `experts` experts each runs `dense` (reading every
    expert once costs less than gathering the chosen ones)."""
    return GATHER_READS * tokens * top_k >= experts


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """`x` `[..., m, in]` times `weight` `[..., out, in]` (`[..., in, out]` when `transposed`) plus `bias`
    `[..., out]`, broadcast over the leading dimensions: `[..., m, out]`."""
    out = torch.matmul(x, weight if transposed else weight.mT)
    return out if bias is None else out + bias.unsqueeze(-2)


def _mlp(experts: nn.Module, x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The experts' gated MLP of `x` `[..., m, hidden]` with the experts at `index` (every expert where None: the
    leading dimension is the experts'): `[..., m, hidden]`."""

    def part(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = getattr(experts, name), getattr(experts, f"{name}_bias") if experts.has_bias else None
        if index is None:
            return weight, bias
        return weight[index], None if bias is None else bias[index]

    gated = experts._apply_gate(_linear(x, *part("gate_up_proj"), experts.is_transposed))
    return _linear(gated, *part("down_proj"), experts.is_transposed)


def gathered(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output `[tokens, hidden]` for `hidden_states` `[tokens, hidden]` routed to `top_k_index` with
    `top_k_weights` (both `[tokens, top_k]`), from each token's chosen experts' weights gathered
    (`[tokens, top_k, out, in]`)."""
    out = _mlp(experts, hidden_states[:, None, None], top_k_index).squeeze(-2)  # [tokens, top_k, hidden]
    return (out * top_k_weights[..., None]).sum(1).to(hidden_states.dtype)


def dense(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`gathered`'s output from every expert over every token (`[experts, tokens, hidden]`), the experts a token
    did not choose weighed by 0."""
    weights = top_k_weights.new_zeros(len(top_k_index), experts.num_experts).scatter_add(1, top_k_index, top_k_weights)
    out = _mlp(experts, hidden_states[None], None)  # [experts, tokens, hidden]
    return (out * weights.T[..., None]).sum(0).to(hidden_states.dtype)


class FixedShapeExperts:
    """Mixed into a family's experts class: `gathered` or `dense` inside `decoding()`, the family's own forward
    outside."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if not _decoding:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        compute = dense if reads_every_expert(*top_k_index.shape, self.num_experts) else gathered
        return compute(self, hidden_states, top_k_index, top_k_weights)


CHECKED = {
    "qwen2_moe": "Qwen2MoeExperts",
    "qwen3_moe": "Qwen3MoeExperts",
    "mixtral": "MixtralExperts",
    "olmoe": "OlmoeExperts",
    "deepseek_v3": "DeepseekV3Experts",
    "gpt_oss": "GptOssExperts",
}
"""The model types, and their experts classes, whose layout `gathered` and `dense` read."""


def _fixed_shape_classes() -> dict[type, type]:
    """Each checked experts class that the installed transformers has, in the layout read here (its experts in
    3-D weights, `use_experts_implementation`: transformers 5), with its class that mixes `FixedShapeExperts` in.
    An older transformers keeps its own experts, and the decoder its step out of CUDA graphs. Each class is also a
    name of this module, where pickle finds it (the compiler cache saves a compiled block by its classes' names)."""
    found = {}
    for model_type, name in CHECKED.items():
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        family = getattr(module, name, None)
        if family is not None and hasattr(family, "_apply_gate"):
            found[family] = globals()[f"FixedShape{name}"] = type(f"FixedShape{name}", (FixedShapeExperts, family), {})
    return found


EXPERTS = _fixed_shape_classes()
"""The experts classes whose layout `gathered` and `dense` read, each with its class that mixes them in."""


def use_fixed_shape_experts(blocks: list[nn.Module]) -> list[str]:
    """Give the experts module (`mlp.experts`) of each of `blocks` (decoder layers) of a class in `EXPERTS` its
    fixed-shape class; returns the class names of experts modules left as they were (none: every step can be
    captured)."""
    left = []
    for block in blocks:
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        if type(experts) in EXPERTS:
            experts.__class__ = EXPERTS[type(experts)]
        elif experts is not None and not isinstance(experts, FixedShapeExperts):
            left.append(type(experts).__name__)
    return sorted(set(left))
