"""Tensor-parallel decoding for the `hf` rollout (`rollout.tensor_parallel_size`).

The processes form groups of `size` consecutive ranks. Each rank of a group holds a smaller model of the same
architecture: its share of the query and key/value heads and of the MLP's intermediate width, built from the
model's config with those counts divided by `size`. The column-parallel projections (`q_proj`, `k_proj`,
`v_proj`, `gate_proj`, `up_proj`) keep their slice of output rows, the row-parallel ones (`o_proj`,
`down_proj`) their slice of input columns, and the outputs of the latter are summed over the group (one
all-reduce after each, two per layer). Embedding, norms and output projection stay whole on every rank, so
every rank computes the same logits. Since the local model is an ordinary Hugging Face model, `generate`, the
static decoder and its KV cache (sized from the local config) work on it unchanged.

The ranks of a group decode together: each brings the prompts the controller gave it, the group decodes the
union (`group_prompts`), and each keeps its own rows. Sampling draws the same random numbers on every rank of
the group (`same_random_numbers`), so the ranks pick the same tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from transformers import AutoModelForCausalLM

from ketch.architecture import attention_shape, intermediate_size, tensor_parallel_problems
from ketch.config.errors import ConfigError, raise_problems
from ketch.protocol import DataProto

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections split by output rows (attention heads, intermediate channels)."""
ROW = ("o_proj", "down_proj")
"""Projections split by input columns; their outputs are partial sums."""
KEY = "rollout.tensor_parallel_size"


class TensorParallel:
    """This process's place in its tensor-parallel group; every process of the world builds one (collective)."""

    def __init__(self, size: int):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % size:
            raise ConfigError(f"{KEY}={size} does not divide the {world} rollout processes; pick a divisor of it")
        rank = dist.get_rank()
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
        self.size, self.rank, self.group = size, rank % size, groups[rank // size]

    def shard_model(self, full: nn.Module, device: torch.device) -> nn.Module:
        """This rank's model (see the module doc), on `device`, with its shards of `full`'s weights."""
        config = sharded_config(full.config, self.size)
        dtype = next(full.parameters()).dtype
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                local = AutoModelForCausalLM.from_config(config, attn_implementation=full.config._attn_implementation)
        finally:
            torch.set_default_dtype(default)
        full_params = dict(full.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, param in local.named_parameters(remove_duplicate=False):
                param.copy_(self.shard(name, full_params[name]))
        sum_row_parallel_outputs(local, self.group)
        return local.eval()

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full weight `name` (a view where it is a slice): a row-parallel bias is added
        once, by the group's first rank (the others hold zeros)."""
        module, kind = name.split(".")[-2:]
        if module in COLUMN:
            return tensor.chunk(self.size, dim=0)[self.rank]
        if module in ROW and kind == "weight":
            return tensor.chunk(self.size, dim=1)[self.rank]
        if module in ROW:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor

    def group_prompts(self, prompts: DataProto, pad_token_id: int) -> tuple[DataProto, slice, int]:
        """The prompts of the whole group, left-padded to one length, in rank order (every rank calls it with its
        own `prompts`); the slice of this rank's rows in them; and a seed shared by the group (its first rank's)."""
        seed = int(torch.randint(2**62, ()))
        mine = (prompts.batch["input_ids"].cpu(), prompts.batch["attention_mask"].cpu(), seed)
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        length = max(ids.shape[-1] for ids, _, _ in everyone)
        ids = [nn.functional.pad(i, (length - i.shape[-1], 0), value=pad_token_id) for i, _, _ in everyone]
        mask = torch.cat([nn.functional.pad(m, (length - m.shape[-1], 0)) for _, m, _ in everyone])
        first = sum(len(i) for i, _, _ in everyone[: self.rank])
        batch = {"input_ids": torch.cat(ids), "attention_mask": mask}
        group = DataProto.from_dict(batch, meta_info=dict(prompts.meta_info))
        return group, slice(first, first + len(mine[0])), everyone[0][2]


@contextmanager
def same_random_numbers(seed: int, device: torch.device) -> Iterator[None]:
    """Draw from generators seeded with `seed` (shared by the group), then restore this process's own."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def check_shardable(config, size: int) -> None:
    """A `ConfigError` naming `rollout.tensor_parallel_size` where the HF `config`'s family does not split, or `size`
    does not divide its heads, key/value heads or intermediate width."""
    raise_problems(tensor_parallel_problems(size, config))


def sharded_config(config, size: int):
    """A copy of the HF `config` with `size` times fewer attention heads, key/value heads and intermediate
    channels, and the head size spelled out (it must not be recomputed from the fewer heads)."""
    check_shardable(config, size)
    shape = attention_shape(config)
    local = copy.deepcopy(config)
    local.head_dim = shape.head_dim
    local.num_attention_heads = shape.heads // size
    local.num_key_value_heads = shape.kv_heads // size
    local.intermediate_size = intermediate_size(config) // size
    return local


def sum_row_parallel_outputs(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum the outputs of every `o_proj` and `down_proj` over `group` (a traceable collective, so the static
    decoder's compiled step keeps it in its graph). Refuses models without the expected projections."""
    layers = model.config.num_hidden_layers
    names = [name for name, _ in model.named_modules()]
    found = {p: sum(n.endswith(f".{p}") for n in names) for p in COLUMN + ROW}
    if any(count != layers for count in found.values()):
        raise ConfigError(
            f"{KEY}>1 splits the projections {', '.join(COLUMN + ROW)} of each of the {layers} layers, but this "
            f"model ({type(model).__name__}) has {found}; use {KEY}=1 for it"
        )
    for name, module in model.named_modules():
        if name.split(".")[-1] in ROW:
            module.register_forward_hook(lambda _module, _inputs, out: funcol.all_reduce(out, "sum", group))
