"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"; verl's `ulysses_sequence_parallel_size`):
the packed row of a micro-batch's real tokens is split over the ranks of a sequence-parallel group, so that one
long response spreads over several GPUs.

Each rank of the group gets the same micro-batch and runs the backbone on its slice of the packed row (the row
padded to a multiple of the group's size, the padding a sequence of its own): embeddings, norms, MLPs and rotary
embeddings work token by token. Around attention, an all-to-all turns the sequence-sharded queries, keys and
values `[T / P, heads, head_dim]` into head-sharded ones `[T, heads / P, head_dim]`, so that each rank attends
over every token with its share of the heads, and a second all-to-all turns the output back (`packed_attention`
does both when the attention call carries the group, through `ketch.engine.attention_all_to_all`). Each rank projects
only its own tokens to the vocabulary (or to values); the per-token results are put in place and summed over the
group, so every rank holds the micro-batch's whole outputs and computes the same loss. The backward pass of the sum
hands each rank the gradient of its own tokens, and FSDP's reduction over all ranks adds up the ranks' shares of each
weight's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ketch.engine.packing import Packing, to_device


def sequence_parallel_group(size: int) -> dist.ProcessGroup | None:
    """This rank's group of `size` consecutive ranks (every rank creates every group, as `new_group` requires);
    None for a size of 1."""
    if size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"actor.ulysses_sequence_parallel_size={size} does not divide the {world} processes")
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    return groups[rank // size]


@dataclass
class Shard:
    """A rank's slice `[start, stop)` of a micro-batch's packed row padded to `length` tokens, and the row's sequence
    offsets (the padding a sequence of its own)."""

    start: int
    stop: int
    length: int
    cu_seqlens: torch.Tensor
    max_len: int

    @classmethod
    def of(cls, packing: Packing, group: dist.ProcessGroup) -> Shard:
        tokens, size, rank = len(packing.index), dist.get_world_size(group), dist.get_rank(group)
        length = -(-tokens // size) * size
        cu_seqlens = packing.cu_seqlens
        if length > tokens:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), length)])
        share = length // size
        return cls(rank * share, (rank + 1) * share, length, cu_seqlens, max(packing.max_len, length - tokens))

    def local(self, packed: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a packed `[1, T, ...]` tensor, padded with zeros to the row's length."""
        missing = self.length - packed.shape[1]
        if missing:
            packed = torch.cat([packed, packed.new_zeros(1, missing, *packed.shape[2:])], dim=1)
        return packed[:, self.start : self.stop]


def sharded_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    host_mask: torch.Tensor,
    response_len: int,
    group: dist.ProcessGroup,
    real_only: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The hidden states `[n, hidden]` of this rank's tokens that come just before a response token, the tokens
    `[n]` they predict, and `place`, which turns a per-token result `[n]` into the micro-batch's `[batch,
    response_len]` float32 outputs summed over the group (zeros at response padding), for inputs `[batch, seq]`.
    `real_only`: only before real response tokens (attention mask 1); else before every response position whose
    previous token is real (a value head's outputs, which the critic masks)."""
    device = input_ids.device
    packing = Packing.from_mask(host_mask, device)
    shard = Shard.of(packing, group)
    hidden = backbone(
        input_ids=shard.local(packing.pack(input_ids)),
        position_ids=shard.local(packing.pack(position_ids)),
        attention_mask=None,
        use_cache=False,
        cu_seq_lens_q=shard.cu_seqlens,
        cu_seq_lens_k=shard.cu_seqlens,
        max_length_q=shard.max_len,
        max_length_k=shard.max_len,
        sequence_parallel_group=group,
    ).last_hidden_state[0]
    rows, columns, previous = _response_positions(host_mask, response_len, packing, real_only)
    mine = (previous >= shard.start) & (previous < shard.stop)
    local = to_device(previous[mine] - shard.start, device)
    targets = input_ids[
        to_device(rows[mine], device), to_device(columns[mine] + host_mask.shape[1] - response_len, device)
    ]
    positions = tuple(to_device(i, device) for i in (rows[mine], columns[mine]))
    shape = (input_ids.shape[0], response_len)

    def place(values: torch.Tensor) -> torch.Tensor:
        outputs = torch.zeros(shape, dtype=torch.float32, device=device).index_put(positions, values.float())
        return _SumOverGroup.apply(outputs, group)

    return hidden[local], targets, place


def _response_positions(
    host_mask: torch.Tensor, response_len: int, packing: Packing, real_only: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, response column, packed position of the token before it) of each response position whose token
    (`real_only`) or previous token is real, on the host."""
    seq = host_mask.shape[1]
    response = host_mask[:, -response_len:] if real_only else host_mask[:, -response_len - 1 : -1]
    rows, columns = response.nonzero(as_tuple=True)
    packed_of = torch.full((host_mask.numel(),), -1, dtype=torch.long)
    packed_of[packing.index.cpu()] = torch.arange(len(packing.index))
    previous = packed_of[rows * seq + columns + seq - response_len - 1]
    return rows, columns, previous


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank of the group computes the same loss from the sum,
    so the gradient of its own term is the gradient of the sum."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
