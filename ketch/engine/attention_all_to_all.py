"""The all-to-all of Ulysses sequence parallelism (`ketch.engine.sequence_parallel`): queries, keys and values
sharded by tokens become sharded by heads before attention, and the attention output goes back, each an autograd
function whose backward pass is the other."""

from __future__ import annotations

import torch
import torch.distributed as dist


def heads_to_tokens(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, ...]:
    """This rank's tokens with every head `[T / P, heads, head_dim]` -> every token with this rank's share of the
    heads `[T, heads / P, head_dim]`, for the queries, keys and values."""
    return tuple(_SequenceToHeads.apply(t, group) for t in (query, key, value))


def tokens_to_heads(out: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The attention output `[T, heads / P, head_dim]` -> this rank's tokens with every head `[T / P, heads,
    head_dim]`."""
    return _HeadsToSequence.apply(out, group)


@torch.compiler.disable
def _all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """Chunk i of `tensor` (its first dimension split in the group's size) to rank i; chunk i of the result from
    rank i."""
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    return out


def _sequence_to_heads(tensor: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    tokens, heads, dim = tensor.shape
    chunks = tensor.view(tokens, size, heads // size, dim).transpose(0, 1)  # [P, T / P, heads / P, dim]
    return _all_to_all(chunks, group).reshape(tokens * size, heads // size, dim)


def _heads_to_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    tokens, heads, dim = tensor.shape
    received = _all_to_all(tensor.view(size, tokens // size, heads, dim), group)  # [P (heads), T / P, heads / P, dim]
    return received.transpose(0, 1).reshape(tokens // size, heads * size, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _sequence_to_heads(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _heads_to_sequence(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None
